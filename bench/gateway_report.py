"""What bench.gateway_round_trip measures, as data, and how it is shown: the tables it prints,
the `## Gateway: the official SDK against the Python client` section of docs/benchmarks.md and
the raw JSON."""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from bench.harness.report import json_document, machine_line, reproduce
from bench.harness.stats import Latency

SECTION = "## Gateway: the official SDK against the Python client"
COMMAND = ".venv/bin/python -m bench.gateway_round_trip"
CLIENT, SDK = "client", "SDK"
# Where a round trip goes, in order (they add up to it); a forward has no second op.
STAGES = (
    ("in", "submit -> first op queued: the door's way in"),
    ("pick-up", "queued -> the worker starts it"),
    ("op 1", "first op on the worker"),
    ("op 1 -> op 2", "between the ops (a second submit that comes late shows here)"),
    ("op 2", "second op on the worker"),
    ("out", "last op finished -> every result in hand: the door's way out"),
)
NO_OP = float("nan")  # a stage a round trip does not have


# --- what is measured --------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """One kind of round trip: `op` "forward" (one op) or "step" (forward_backward +
    optim_step), on `batch` datums of `seq` tokens."""

    label: str
    op: str
    batch: int
    seq: int

    @property
    def ops(self) -> int:
        return 1 if self.op == "forward" else 2

    @property
    def calls(self) -> str:
        return "`forward`" if self.op == "forward" else "`forward_backward` + `optim_step`"


@dataclass
class Trip:
    """One round trip as this process saw it, and the CPU the parts spent meanwhile."""

    wall: float  # time.time() before the first submit (lines up with Redis TIME)
    total_s: float  # first submit -> every result in hand
    cpu_s: dict[str, float]  # CPU seconds each part spent meanwhile (see Parts)


@dataclass
class DoorResult:
    """One door's round trips of one shape."""

    model_id: str
    first_loss: float
    trips: list[Trip] = field(default_factory=list)
    stages: list[tuple[float, ...]] = field(default_factory=list)  # seconds, STAGES

    @property
    def latency(self) -> Latency:
        return Latency([t.total_s for t in self.trips])

    def cpu_ms(self) -> dict[str, float]:
        """Mean CPU ms per round trip, by part."""
        n = max(1, len(self.trips))
        labels = self.trips[0].cpu_s if self.trips else {}
        return {label: sum(t.cpu_s[label] for t in self.trips) * 1000 / n for label in labels}

    def stage_medians_ms(self) -> list[float]:
        """Median of each stage in ms (NaN for a stage these round trips do not have)."""
        if not self.stages:
            return []
        return [float(v) for v in np.median(np.asarray(self.stages), axis=0) * 1000]


@dataclass
class ShapeResult:
    shape: Shape
    doors: dict[str, DoorResult]
    requests: Counter[str]  # gateway access log during the measured rounds
    foreign_cores: float  # CPU other processes used during the measured rounds

    def ratio(self) -> float:
        return self.doors[SDK].latency.p50 / self.doors[CLIENT].latency.p50

    def overhead_ms(self) -> dict[str, float]:
        """SDK minus client per round trip: p50s, means, median of paired differences."""
        sdk, client = self.doors[SDK], self.doors[CLIENT]
        paired = [s.total_s - c.total_s for s, c in zip(sdk.trips, client.trips, strict=True)]
        return {
            "p50": sdk.latency.p50 - client.latency.p50,
            "mean": sdk.latency.mean - client.latency.mean,
            "paired_p50": statistics.median(paired) * 1000,
        }

    def requests_per_trip(self) -> dict[str, float]:
        n = max(1, len(self.doors[SDK].trips))
        return {name: count / n for name, count in sorted(self.requests.items())}


INTRO = (
    "One training round trip through each door onto the same queue, same worker, same run: the "
    "official `tinker` SDK (`tinker.ServiceClient(base_url, api_key)`, its defaults: its own "
    "background loop, long-polled `retrieve_future`, telemetry as shipped) through a "
    "`queue-tinker serve` process, against `queue_tinker.ServiceClient` talking to Redis "
    "directly. A round trip is the Tinker loop's `fb = tc.forward_backward(batch, "
    '"cross_entropy"); opt = tc.optim_step(adam); fb.result(); opt.result()`; "ping" is one '
    "`forward` of 1 datum × 2 tokens, the least model work a door can carry. One LoRA worker "
    "process (`--engine lora --device cpu`, production defaults) on `{model}`, rank 32; a "
    "fresh training client per door and shape; {warmup} warm-up round trips per door, then "
    "{rounds} per door, alternating client / SDK so drift hits both alike."
)
READING = (
    "Reading it: SDK − client is what the HTTP door adds (the SDK's own work, the gateway's, "
    "and the extra hops), so read it as absolute milliseconds per call; the ratio shrinks as "
    "the model work grows. The paired median (each SDK round trip against the client round "
    "trip next to it) is the figure drift from other jobs disturbs least. The CPU columns say "
    "who pays: on a machine where the caller, the gateway and the worker share the cores, "
    "their CPU also slows the worker's ops; with the gateway elsewhere that part goes away."
)


def render(
    info: dict[str, str],
    model: str,
    rounds: int,
    warmup: int,
    results: list[ShapeResult],
    total_s: float,
) -> str:
    """The docs section, in Markdown: what the SDK and gateway add to each shape's round trip
    (paired median), then the tables."""
    headline = "; ".join(
        f"{r.shape.label} ({r.shape.calls}): **{r.overhead_ms()['paired_p50']:+.1f} ms** per "
        f"round trip ({r.ratio():.2f}× the client's p50)"
        for r in results
    )
    return "\n".join(
        [
            SECTION,
            "",
            INTRO.format(model=model, warmup=warmup, rounds=rounds),
            "",
            "Reproduce (`--quick` is a smoke run that leaves this file alone; `--out` writes every "
            "round trip as JSON):",
            "",
            *reproduce(COMMAND),
            "",
            machine_line(info)
            + f". The run took {total_s:.0f} s. The SDK or client, the gateway, the worker, Redis "
            "and Postgres share this machine's cores.",
            "",
            f"What the SDK and gateway add (paired median): {headline}.",
            "",
            markdown(results, model),
            "",
            READING,
            "",
        ]
    )


# --- tables and JSON ------------------------------------------------------------------------------
def markdown(results: list[ShapeResult], model: str) -> str:
    """The tables printed at the end of a run."""
    return "\n".join(
        [*latency_lines(results, model), "", *stage_lines(results), "", *note_lines(results)]
    )


def latency_lines(results: list[ShapeResult], model: str) -> list[str]:
    """Per shape and door: round-trip percentiles; on the SDK row, the ratio and overhead."""
    lines = [
        f"Round trip per door, `{model}`, ms (SDK − client: of the p50s / of the means / "
        "median of the per-round paired differences):",
        "",
        "| shape | calls | datums × tokens | rounds | door | p50 | p90 | p99 | mean | "
        "SDK / client (p50) | SDK − client ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        s = r.shape
        for name, door in r.doors.items():
            lat, o = door.latency, r.overhead_ms()
            gap = (
                (
                    f"**{r.ratio():.2f}×** | {o['p50']:+.1f} / {o['mean']:+.1f} / "
                    f"{o['paired_p50']:+.1f}"
                )
                if name == SDK
                else " | "
            )
            lines.append(
                f"| {s.label} | {s.calls} | {s.batch} × {s.seq} | {len(door.trips)} | "
                f"{name} | {lat.p50:.1f} | {lat.p90:.1f} | {lat.p99:.1f} | "
                f"{lat.mean:.1f} | {gap} |"
            )
    return lines


def stage_lines(results: list[ShapeResult]) -> list[str]:
    """Where a round trip goes (medians) and the CPU each process spent on it (means)."""
    legend = "; ".join(f"{short} = {long}" for short, long in STAGES)
    cpu_labels = list(results[0].doors[CLIENT].cpu_ms()) if results else []
    columns = [short for short, _ in STAGES] + [f"CPU: {label}" for label in cpu_labels]
    lines = [
        f"Where a round trip goes, median ms ({legend}; Redis clock and this process's "
        "clock, same host) and the CPU each part spent per round trip, mean ms:",
        "",
        "| shape | door | " + " | ".join(columns) + " |",
        "| --- | --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for r in results:
        for name, door in r.doors.items():
            medians = door.stage_medians_ms() or [NO_OP] * len(STAGES)
            stages = " | ".join("–" if np.isnan(v) else f"{v:.1f}" for v in medians)
            cpu = " | ".join(f"{v:.1f}" for v in door.cpu_ms().values())
            lines.append(f"| {r.shape.label} | {name} | {stages} | {cpu} |")
    return lines


def note_lines(results: list[ShapeResult]) -> list[str]:
    """HTTP requests per SDK round trip, first losses (equal: same data, zero-init LoRA B) and
    the machine's other load, per shape."""
    lines = []
    for r in results:
        per_trip = ", ".join(f"`{name}` {n:.2f}" for name, n in r.requests_per_trip().items())
        lines.append(
            f"- {r.shape.label}: HTTP requests per SDK round trip: {per_trip or 'none'}; "
            f"first loss client {r.doors[CLIENT].first_loss:.4f} / SDK "
            f"{r.doors[SDK].first_loss:.4f}; other processes used "
            f"{r.foreign_cores:.2f} cores meanwhile"
        )
    return lines


def results_json(
    info: dict[str, str], args: argparse.Namespace, results: list[ShapeResult], total_s: float
) -> str:
    return json_document(
        info,
        model=args.model,
        rounds=args.rounds,
        warmup=args.warmup,
        total_s=total_s,
        stages=[long for _, long in STAGES],
        shapes=[
            {
                "shape": asdict(r.shape),
                "ratio_p50": r.ratio(),
                "overhead_ms": r.overhead_ms(),
                "http_requests_per_sdk_trip": r.requests_per_trip(),
                "other_processes_cores": r.foreign_cores,
                "doors": {
                    name: {
                        "model_id": d.model_id,
                        "first_loss": d.first_loss,
                        "latency": d.latency.summary(),
                        "cpu_ms_per_trip": d.cpu_ms(),
                        "stages_p50_ms": [None if np.isnan(v) else v for v in d.stage_medians_ms()],
                        "trips": [asdict(t) for t in d.trips],
                    }
                    for name, d in r.doors.items()
                },
            }
            for r in results
        ],
    )
