"""Gateway round trip: the same training round trip through the official `tinker` SDK and the
HTTP gateway (`queue-tinker serve`), and through queue_tinker's own client (Redis directly), the
doors alternating on one LoRA worker. How: the `## Gateway` section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import tinker
from sqlalchemy.engine import make_url
from tinker import types as sdk_types

from bench.harness import cli
from bench.harness.data import RANK, token_rows
from bench.harness.gateway import gateway_proc, make_key, requests_by_endpoint
from bench.harness.meters import CpuMeter, find_pids, process_cpu_s
from bench.harness.report import Report, Table, docs_of, emit
from bench.harness.run import Run, service_run
from bench.harness.services import hash_fields, service_client
from bench.harness.stats import Latency
from bench.harness.workers import lora_worker
from queue_tinker import types as qt_types
from queue_tinker.client import ServiceClient
from queue_tinker.queue.keys import Keys

SECTION = "## Gateway: the official SDK against the Python client"
COMMAND = ".venv/bin/python -m bench.gateway_round_trip"
CLIENT, SDK = "client", "SDK"
SEED = 0
RESULT_TIMEOUT_S = 120.0
# Where a round trip goes, in order (they add up to it; the docs say what each is).
STAGES = ("in", "pick-up", "op 1", "op 1 -> op 2", "op 2", "out")
NO_OP = None  # a stage a round trip does not have (a forward has no second op)
OpTimes = tuple[float, ...]  # an op's (queued_at, started_at, finished_at), Redis clock
KNOBS = {
    "--rounds": (400, "measured rounds per shape (one round trip per door each)"),
    "--warmup": (20, "warm-up round trips per door and shape, not measured"),
}


@dataclass(frozen=True)
class Shape:
    """One kind of round trip, `op` "forward" or "step" (forward_backward + optim_step)."""

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
class Door:
    """One door's training client of one shape, its batch and Adam params in that API's own
    types (the APIs share the method names, so one function drives both), its round trips."""

    name: str
    trainer: Any  # queue_tinker.client.TrainingClient or tinker.TrainingClient
    data: list[Any]
    adam: Any
    first_loss: float = float("nan")
    trips: list[Trip] = field(default_factory=list)
    stages: list[tuple[float | None, ...]] = field(default_factory=list)  # seconds, STAGES

    @property
    def latency(self) -> Latency:
        return Latency([t.total_s for t in self.trips])

    def cpu_ms(self) -> dict[str, float]:
        """Mean CPU ms per round trip, by part."""
        n = max(1, len(self.trips))
        labels = self.trips[0].cpu_s if self.trips else {}
        return {label: sum(t.cpu_s[label] for t in self.trips) * 1000 / n for label in labels}

    def stage_medians_ms(self) -> list[float | None]:
        """Median of each stage in ms (None for a stage these round trips do not have)."""
        if not self.stages:
            return [NO_OP] * len(STAGES)
        medians = np.median(np.asarray(self.stages, dtype=float), axis=0) * 1000
        return [None if np.isnan(v) else float(v) for v in medians]

    def json(self) -> dict[str, Any]:
        return {
            "model_id": self.trainer.model_id,
            "first_loss": self.first_loss,
            "trips": [asdict(t) for t in self.trips],
            "stages": self.stages,
            "latency": self.latency.summary(),
            "cpu_ms_per_trip": self.cpu_ms(),
            "stages_p50_ms": self.stage_medians_ms(),
        }


@dataclass
class ShapeResult:
    shape: Shape
    doors: dict[str, Door]
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


def doors(
    service: ServiceClient, sdk: tinker.ServiceClient, model: str, shape: Shape
) -> list[Door]:
    """A fresh training client of each API, with the shape's batch in its own types."""
    rows = token_rows(shape.batch, shape.seq)
    client = service.create_lora_training_client(model, rank=RANK, seed=SEED)
    # SDK 0.38: create_lora_training_client returns a future.
    trainer = sdk.create_lora_training_client(base_model=model, rank=RANK, seed=SEED).result()
    made = []
    for name, types, door_trainer in ((CLIENT, qt_types, client), (SDK, sdk_types, trainer)):
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(row[1:].astype(np.int64)),
                    "weights": types.TensorData.from_numpy(np.ones(len(row) - 1, np.float32)),
                },
            )
            for row in rows
        ]
        made.append(Door(name, door_trainer, data, types.AdamParams(learning_rate=1e-4)))
    return made


@dataclass
class Parts:
    """The processes a round trip's CPU is counted for, by label: this process (all threads, the
    SDK's event loops too) precisely, the others from /proc in 10 ms ticks (fair over many)."""

    gateway: int
    worker: int
    database: str  # the run's scratch database: its Postgres backends
    others: dict[str, list[int]] = field(default_factory=dict)

    def refresh(self) -> None:
        """Look the Postgres backends and Redis up again (pools open connections lazily)."""
        self.others = {
            "gateway": [self.gateway],
            "worker": [self.worker],
            "Postgres (the run's backends)": find_pids(self.database.encode()),
            "Redis (whole server)": find_pids(b"redis-server"),
        }

    def cpu_s(self) -> dict[str, float]:
        totals = {"this process": time.process_time()}
        for label, pids in self.others.items():
            totals[label] = 0.0
            for pid in pids:
                with contextlib.suppress(OSError):  # a backend that has gone
                    totals[label] += process_cpu_s(pid)
        return totals


def timed_trip(door: Door, op: str, parts: Parts) -> tuple[Trip, float]:
    """One round trip, the same calls whichever the door; the trip and the batch loss."""
    before = parts.cpu_s()  # the CPU reads sit outside the timed span
    wall, t0 = time.time(), time.perf_counter()
    if op == "forward":
        out = door.trainer.forward(door.data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    else:  # The Tinker loop: submit the optim_step before waiting on the forward_backward.
        fb = door.trainer.forward_backward(door.data, "cross_entropy")
        optim = door.trainer.optim_step(door.adam)
        out = fb.result(timeout=RESULT_TIMEOUT_S)
        optim.result(timeout=RESULT_TIMEOUT_S)
    loss = float(out.metrics["loss:sum"])
    total = time.perf_counter() - t0
    after = parts.cpu_s()
    return Trip(wall, total, {k: after[k] - v for k, v in before.items()}), loss


def measure_shape(
    args: argparse.Namespace, shape: Shape, doors: list[Door], parts: Parts, log: Callable[[], str]
) -> ShapeResult:
    """Warm-up round trips, then `--rounds` rounds of one round trip per door, alternating."""
    warm = [timed_trip(door, shape.op, parts)[1] for door in doors * args.warmup]
    for door, loss in zip(doors, warm, strict=False):  # each door's first loss
        door.first_loss = loss
    before = requests_by_endpoint(log())
    parts.refresh()
    meter = CpuMeter([os.getpid(), parts.gateway, parts.worker])
    mark = meter.mark()
    for door in doors * args.rounds:  # round by round, a round trip of each door
        door.trips.append(timed_trip(door, shape.op, parts)[0])
    foreign = meter.foreign_since(mark)
    time.sleep(0.2)  # the gateway writes its last access lines
    by_name = {d.name: d for d in doors}
    return ShapeResult(shape, by_name, requests_by_endpoint(log()) - before, foreign)


def add_stages(redis_url: str, keys: Keys, result: ShapeResult, warmup: int) -> None:
    """Split every measured round trip into STAGES at the Redis-clock times of its ops (each
    door's training client is its own model, so its ops in seq order are its round trips')."""
    ops = ops_by_model(redis_url, keys, {d.trainer.model_id for d in result.doors.values()})
    per = result.shape.ops
    for door in result.doors.values():
        times = ops.get(door.trainer.model_id, [])[warmup * per :]
        if len(times) != len(door.trips) * per:
            print(f"warning: {door.trainer.model_id}: ops and round trips differ", file=sys.stderr)
            continue
        for i, trip in enumerate(door.trips):
            first, last = times[i * per], times[(i + 1) * per - 1]
            between = (last[1] - first[2], last[2] - last[1]) if per == 2 else (NO_OP, NO_OP)
            way_in, way_out = first[0] - trip.wall, trip.wall + trip.total_s - last[2]
            inside = (first[1] - first[0], first[2] - first[1], *between)  # pick-up to op 2
            door.stages.append((way_in, *inside, way_out))


def ops_by_model(redis_url: str, keys: Keys, models: set[str]) -> dict[str, list[OpTimes]]:
    """(queued_at, started_at, finished_at) of each model's training ops in seq order."""
    with redis.Redis.from_url(redis_url) as client:
        found_keys = client.scan_iter(match=keys.job("*"), count=1000)
        names = [k for k in found_keys if not k.endswith(b":reply")]
    fields = ("model_id", "kind", "seq", "queued_at", "started_at", "finished_at")
    rows = hash_fields(redis_url, names, *fields)
    found: dict[str, list[tuple[int, OpTimes]]] = {m: [] for m in models}
    for model, kind, seq, *times in rows:
        model_id = (model or b"").decode()
        if model_id in found and kind != b"create_model" and None not in (seq, *times):
            found[model_id].append((int(seq), tuple(float(t) for t in times)))
    return {m: [t for _, t in sorted(rows)] for m, rows in found.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """One worker and one gateway; every shape through both doors, on fresh training clients."""
    args = parse_args(argv)
    shapes = [
        Shape("ping", "forward", 1, 2),
        Shape("small", "step", *args.small_batch),
        Shape("large", "step", *args.large_batch),
    ]
    packages = ("torch", "tinker", "fastapi", "uvicorn", "httpx")
    results, tenant = [], f"bench-{uuid.uuid4().hex[:8]}"
    with (
        service_run(args, packages, "qt-bench-gateway-") as run,
        run.deployment("gateway") as settings,
        lora_worker(settings, args.model, run.data_dir / "worker.log") as worker,
        gateway_proc(settings, run.data_dir / "gateway.log") as (gateway, url),
        service_client(settings) as service,
        tinker.ServiceClient(base_url=url, api_key=make_key(settings, tenant)) as sdk,
    ):
        parts = Parts(gateway.pid, worker.pid, make_url(run.database_url).database or "")
        for shape in shapes:
            print(f"[{shape.label}] {shape.batch} × {shape.seq} tokens ...", flush=True)
            pair = doors(service, sdk, args.model, shape)
            result = measure_shape(args, shape, pair, parts, gateway.log)
            add_stages(args.redis_url, Keys(settings.key_prefix), result, args.warmup)
            results.append(result)
    emit(report(args, run, results), docs_of(args), args.json)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    quick = "smoke run (10 rounds, 3 warm-up)"
    parser = cli.parser(
        "bench.gateway_round_trip", __doc__, knobs=KNOBS, quick=quick, services=True, data_dir=True
    )
    parser.add_argument("--model", default="queue-tinker/tiny-llama", help="the worker's model")
    cli.add_batch(parser, "--small-batch", (4, 32))
    cli.add_batch(parser, "--large-batch", (8, 128))
    parser.add_argument("--out", dest="json", type=Path, help="the same as --json")
    args = cli.parse(parser, argv, quick={"rounds": 10, "warmup": 3})
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup must be at least 1")
    return args


def report(args: argparse.Namespace, run: Run, results: list[ShapeResult]) -> Report:
    """What the SDK and gateway add, round trips per door, where they go, the requests."""
    facts = [
        f"`{args.model}`, rank {RANK}; {args.warmup} warm-up round trips per door and shape, "
        f"then {args.rounds} per door, alternating.",
        f"The run took {run.total_s:.0f} s; the SDK or client, the gateway, the worker, Redis "
        "and Postgres share its cores.",
    ]
    headline = "; ".join(
        f"{r.shape.label} ({r.shape.calls}): **{r.overhead_ms()['paired_p50']:+.1f} ms** per "
        f"round trip ({r.ratio():.2f}× the client's p50)"
        for r in results
    )
    body: list[Table | str] = [
        f"What the SDK and gateway add (paired median): {headline}.",
        *tables(results, args.model),
        "\n".join(map(notes, results)),
    ]
    shapes = [
        {
            "shape": asdict(r.shape),
            "ratio_p50": r.ratio(),
            "overhead_ms": r.overhead_ms(),
            "http_requests_per_sdk_trip": r.requests_per_trip(),
            "other_processes_cores": r.foreign_cores,
            "doors": {name: d.json() for name, d in r.doors.items()},
        }
        for r in results
    ]
    results_dict = {"model": args.model, "stages": STAGES, "shapes": shapes}
    return Report(SECTION, COMMAND, run.info, facts, (), body, results_dict)


def tables(results: list[ShapeResult], model: str) -> list[Table]:
    """Per shape and door: the round trips, then where they go and the CPU spent on them."""
    trips, stages = [], []
    for r in results:
        o, s = r.overhead_ms(), r.shape
        diffs = " / ".join(f"{o[k]:+.1f}" for k in ("p50", "mean", "paired_p50"))
        gap = (f"**{r.ratio():.2f}×**", diffs)
        for name, door in r.doors.items():
            lat = door.latency
            figures = (f"{v:.1f}" for v in (lat.p50, lat.p90, lat.p99, lat.mean))
            shape = (s.label, s.calls, f"{s.batch} × {s.seq}", len(door.trips))
            trips.append((*shape, name, *figures, *(gap if name == SDK else ("", ""))))
            medians = ("–" if v is None else f"{v:.1f}" for v in door.stage_medians_ms())
            stages.append((s.label, name, *medians, *(f"{v:.1f}" for v in door.cpu_ms().values())))
    columns = "shape | calls | datums × tokens | rounds | door | p50 | p90 | p99 | mean"
    cpu = list(results[0].doors[CLIENT].cpu_ms()) if results else []
    return [
        Table(
            [*columns.split(" | "), "SDK / client (p50)", "SDK − client ms"],
            trips,
            caption=f"Round trip per door, `{model}`, ms (SDK − client: of the p50s / of the "
            "means / median of the per-round paired differences):",
        ),
        Table(
            ("shape", "door", *STAGES, *(f"CPU: {label}" for label in cpu)),
            stages,
            caption="Where a round trip goes, median ms, and the CPU each part spent per round "
            "trip, mean ms:",
        ),
    ]


def notes(r: ShapeResult) -> str:
    """HTTP requests per SDK trip, first losses (equal: same data, zero-init LoRA B), other load."""
    per_trip = ", ".join(f"`{name}` {n:.2f}" for name, n in r.requests_per_trip().items())
    client, sdk = r.doors[CLIENT].first_loss, r.doors[SDK].first_loss
    return (
        f"- {r.shape.label}: HTTP requests per SDK round trip: {per_trip or 'none'}; first loss "
        f"client {client:.4f} / SDK {sdk:.4f}; other processes used {r.foreign_cores:.2f} cores "
        "meanwhile"
    )


if __name__ == "__main__":
    sys.exit(main())
