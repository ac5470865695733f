"""What bench.soak saw, as data, and how it is shown: the `## Soak` section of
docs/benchmarks.md, the summary on stdout and the raw JSON."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from bench.harness.report import json_document, machine_line, reproduce, table
from bench.harness.stats import Latency

SECTION = "## Soak"
COMMAND = ".venv/bin/python -m bench.soak --minutes 5 --clients 20 --models 50"
LORA_MODEL = "queue-tinker/tiny-llama"
DELAYS_MS = (0, 0, 1, 5, 20)  # drawn uniformly: 40% inline, the rest on the compute thread
MIB = 1024 * 1024


@dataclass
class Tally:
    """Everything the clients observed, shared by their coroutines (one event loop)."""

    ping_s: list[float] = field(default_factory=list)
    overhead_s: list[float] = field(default_factory=list)  # round trip minus the ping's delay
    step_s: list[float] = field(default_factory=list)
    samples: int = 0
    job_ids: list[str] = field(default_factory=list)
    seqs: defaultdict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    stuck: list[str] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)

    @property
    def pings(self) -> Latency:
        return Latency(self.ping_s or [0.0])

    @property
    def overheads(self) -> Latency:
        return Latency(self.overhead_s or [0.0])

    def fail(self, exc: BaseException) -> None:
        name = type(exc).__name__
        if name not in self.failed:
            print(f"warning: op failed: {name}: {exc}", file=sys.stderr, flush=True)
        self.failed[name] = self.failed.get(name, 0) + 1


@dataclass
class Trend:
    """One process's memory over the run."""

    first_min_mib: float
    last_min_mib: float
    slope_mib_per_min: float  # least squares, after the first minute (or over all, if shorter)
    samples: int

    @property
    def growth_mib(self) -> float:
        return self.last_min_mib - self.first_min_mib


def trend(series: list[tuple[float, int]]) -> Trend:
    t = np.array([s for s, _ in series])
    mib = np.array([v for _, v in series]) / MIB
    window = min(60.0, t[-1] / 2) if len(t) > 1 else 0.0
    first = mib[t <= t[0] + window] if window else mib
    last = mib[t >= t[-1] - window] if window else mib
    settled = t >= 60.0 if t[-1] >= 120.0 else np.ones_like(t, dtype=bool)
    slope = float(np.polyfit(t[settled] / 60, mib[settled], 1)[0]) if settled.sum() > 2 else 0.0
    return Trend(float(first.mean()), float(last.mean()), slope, len(t))


@dataclass
class Outcome:
    """A soak's result: what the clients saw, how long the load ran, the exactly-once checks
    and every process's memory over time; its memory trends and verdicts follow from them."""

    tally: Tally
    seconds: float
    once: dict[str, int]
    series: dict[str, list[tuple[float, int]]]
    max_slope: float  # MiB/min of worker memory growth still called flat
    trends: dict[str, Trend] = field(init=False)
    checks: dict[str, bool] = field(init=False)

    def __post_init__(self) -> None:
        self.trends = {name: trend(points) for name, points in self.series.items()}
        self.checks = verdicts(self)


def verdicts(outcome: Outcome) -> dict[str, bool]:
    tally, most = outcome.tally, outcome.max_slope
    workers = [t for n, t in outcome.trends.items() if n.startswith("worker")]
    return {
        "no stuck futures": not tally.stuck,
        "no failed or wrong op": not tally.failed and not tally.wrong,
        "every op done exactly once": not any(outcome.once.values()),
        f"worker memory flat (slope ≤ {most:g} MiB/min)": all(
            t.slope_mib_per_min <= most for t in workers
        ),
    }


# --- output ------------------------------------------------------------------------------------
def result_lines(args: argparse.Namespace, outcome: Outcome) -> list[str]:
    tally, seconds, once = outcome.tally, outcome.seconds, outcome.once
    pings, overheads = tally.pings, tally.overheads
    rows: list[tuple[str, object]] = [
        (
            "pings done",
            f"{len(tally.ping_s):,} in {seconds:.0f} s ({len(tally.ping_s) / seconds:,.0f}/s) "
            f"over {args.models} models, {args.clients} clients",
        ),
        (
            "ping round trip (submit → result)",
            f"p50 {pings.p50:.1f} ms, p99 {pings.p99:.1f} ms, max {pings.max:.0f} ms",
        ),
        (
            "the same minus each ping's `delay_ms`",
            f"p50 {overheads.p50:.1f} ms, p99 {overheads.p99:.1f} ms",
        ),
    ]
    if tally.step_s:
        steps = Latency(tally.step_s)
        rows.append(
            (
                "LoRA steps (forward_backward + optim_step)",
                f"{len(tally.step_s):,} over {args.lora_clients} runs; p50 {steps.p50:.0f} ms, "
                f"p99 {steps.p99:.0f} ms; {tally.samples} save-and-sample rounds",
            )
        )
    failed = ", ".join(f"{n} × {k}" for k, n in tally.failed.items()) or "none"
    rows += [
        (f"stuck futures (unresolved after {args.stuck_after:g} s)", len(tally.stuck)),
        ("failed ops / wrong results", f"{failed} / {len(tally.wrong)}"),
        ("pings not done with attempts 1", once["not_done_once"]),
        ("models whose results skip or repeat a seq", once["models_with_gaps"]),
        ("ping publishes minus pings done", once["published_minus_done"]),
    ]
    judged = [(name, "**met**" if ok else "**not met**") for name, ok in outcome.checks.items()]
    return [*table(("what", "value"), rows), "", *table(("check", "verdict"), judged)]


def memory_lines(trends: dict[str, Trend]) -> list[str]:
    columns = (
        "process",
        "first minute, mean MiB",
        "last minute, mean MiB",
        "growth MiB",
        "slope after the first minute, MiB/min",
        "samples",
    )
    rows = (
        (
            name,
            f"{t.first_min_mib:.1f}",
            f"{t.last_min_mib:.1f}",
            f"{t.growth_mib:+.1f}",
            f"{t.slope_mib_per_min:+.2f}",
            t.samples,
        )
        for name, t in trends.items()
    )
    return table(columns, rows)


def render(args: argparse.Namespace, info: dict[str, str], outcome: Outcome) -> str:
    load = (
        f"{args.clients} clients (each a `ServiceClient` with its own loop and "
        f"connections, in one process) send pings at random times, {args.rate:g} per "
        f"second each on average (at most {args.window} in flight), over {args.models} "
        f"training runs served by {args.workers} queue-only workers; each ping's "
        f"`delay_ms` is drawn from {', '.join(map(str, DELAYS_MS))} (0 runs inline, the "
        f"others on the worker's compute thread)."
    )
    if args.lora_clients:
        load += (
            f" Beside them, {args.lora_clients} training runs on `{LORA_MODEL}` train "
            f"without a pause on one LoRA worker (forward_backward + optim_step; every "
            f"{args.sample_every} steps `save_weights_and_get_sampling_client` and one "
            f"8-token sample). Workers keep at most {args.max_resident} adapters "
            f"(`QT_MAX_RESIDENT_ADAPTERS`), so the sampler cache is full within the first "
            f"minute and every later round evicts one; it computes with one torch thread "
            f"(`OMP_NUM_THREADS=1`). One LoRA worker with two runs is what fits beside the "
            f"ping load on this machine's two cores; the point is its memory over time, "
            f"not its speed."
        )
    return "\n".join(
        [
            SECTION,
            "",
            "Many clients over many models for minutes, against the real Redis and Postgres and "
            "real worker processes, with production settings: no future may get stuck, every op "
            "must be done exactly once, worker memory must stay flat. " + load,
            "",
            "Reproduce (`--help` lists the knobs; `--no-docs` leaves this file alone):",
            "",
            *reproduce(COMMAND),
            "",
            machine_line(info) + ".",
            f"The load ran {outcome.seconds:.0f} s. Clients, workers, Redis and Postgres share "
            "this machine's cores.",
            "",
            *result_lines(args, outcome),
            "",
            f"Resident memory, sampled every {args.sample_s:g} s (VmRSS from /proc; Redis: "
            "`used_memory`). The first minute includes start-up (the model, the first "
            "allocations), so the slope, fitted after it, is the measure of a leak. The client "
            "process keeps every round trip and request id for the checks (a few hundred bytes "
            "per op), and Redis keeps each job's hash for `QT_RESULT_TTL_S` (an hour by "
            "default): both grow with the ops done, as they should.",
            "",
            *memory_lines(outcome.trends),
            "",
        ]
    )


def print_summary(outcome: Outcome) -> None:
    tally, seconds = outcome.tally, outcome.seconds
    pings, overhead = tally.pings, tally.overheads
    print(
        f"\npings {len(tally.ping_s):,} in {seconds:.0f} s ({len(tally.ping_s) / seconds:,.0f}"
        f"/s): p50 {pings.p50:.1f} ms p99 {pings.p99:.1f} ms max {pings.max:.0f} ms; minus "
        f"delay_ms: p50 {overhead.p50:.1f} ms p99 {overhead.p99:.1f} ms"
    )
    if tally.step_s:
        steps = Latency(tally.step_s)
        print(
            f"lora steps {len(tally.step_s)}: p50 {steps.p50:.0f} ms p99 {steps.p99:.0f} ms; "
            f"samples {tally.samples}"
        )
    print(
        f"stuck {len(tally.stuck)} {tally.stuck[:5]}; failed {tally.failed}; "
        f"wrong {len(tally.wrong)}; exactly once {outcome.once}"
    )
    for name, t in outcome.trends.items():
        print(
            f"{name:<28} first {t.first_min_mib:8.1f} MiB  last {t.last_min_mib:8.1f} MiB  "
            f"growth {t.growth_mib:+7.1f} MiB  slope {t.slope_mib_per_min:+6.2f} MiB/min"
        )
    for name, ok in outcome.checks.items():
        print(f"{'ok ' if ok else 'FAIL'} {name}")


def results_json(info: dict[str, str], outcome: Outcome) -> str:
    tally = outcome.tally
    return json_document(
        info,
        indent=1,
        seconds=outcome.seconds,
        pings=tally.pings.summary(),
        ping_overhead=tally.overheads.summary(),
        lora_steps=Latency(tally.step_s).summary() if tally.step_s else None,
        samples=tally.samples,
        stuck=tally.stuck,
        failed=tally.failed,
        wrong=tally.wrong,
        exactly_once=outcome.once,
        checks=outcome.checks,
        memory={
            name: {**vars(t), "series": outcome.series[name]} for name, t in outcome.trends.items()
        },
    )
