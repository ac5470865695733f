"""Training throughput: aggregate training tokens/s of N models training at once, batched on one
worker, one at a time on one, and on a worker each. How: the `## Training throughput` section of
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from bench.harness import cli
from bench.harness.baselines import ADAM, BareLoop
from bench.harness.data import RANK, datums, token_rows
from bench.harness.meters import CpuMeter
from bench.harness.models import ensure_model
from bench.harness.report import Report, Table, Target, docs_of, emit
from bench.harness.run import TORCH, Run, service_run
from bench.harness.services import job_times, service_client
from bench.harness.workers import lora_workers, quiet_transformers
from bench.train_step import QUIET_CORES, Batch, cells
from queue_tinker.client import TrainingClient
from queue_tinker.errors import QueueTinkerError
from queue_tinker.queue.keys import Keys

SECTION = "## Training throughput: many models on one worker"
COMMAND = ".venv/bin/python -m bench.train_throughput"
# The targets: with this many concurrent models, batched over one at a time.
TARGET_MODELS, TARGET_CPU, TARGET_GPU = 8, 2.0, 3.0
BATCH_ENV = "QT_CROSS_ADAPTER_BATCH"  # read by `queue-tinker worker` (Settings.cross_adapter_batch)
CORES = os.cpu_count() or 1
BATCHED, SERIAL, PROCESSES = "batched", "one at a time", "process per model"
MODES: tuple[str, ...] = (BATCHED, SERIAL, PROCESSES)
# Per base model: the most worker processes the per-model mode starts (a 100M worker holds
# ~1 GB) and the step shapes (datums, tokens) measured by default (the docs say why these).
SIZES: dict[str, tuple[str, int, tuple[tuple[int, int], ...]]] = {
    "tiny": ("queue-tinker/tiny-llama", 16, ((1, 32), (4, 64))),
    "100m": ("queue-tinker/llama-100m", 8, ((4, 64),)),
}
KNOBS = {
    "--warmup": (3, "steps per model before the window, tiny model"),
    "--big-warmup": (1, "the same, 100M"),
    "--min-steps": (3, "steps every model finishes in the window (2 at least)"),
    "--seconds": (10.0, "least window, tiny model"),
    "--big-seconds": (15.0, "least window, 100M"),
    "--max-cell-s": (300.0, "close a cell's window after this long (cut short)"),
    "--bare-steps": (10, "bare PEFT loop steps"),
}


@dataclass(frozen=True)
class Size(Batch):
    """One base model, the batch each step trains on and the model counts to measure."""

    counts: tuple[int, ...]
    warmup: int  # steps every model finishes before the window opens
    seconds: float  # least measured seconds per cell
    max_processes: int  # most worker processes the per-model mode starts (memory)


@dataclass
class Cell:
    """One mode at one model count: what each model's training loop did in the window."""

    mode: str
    models: int
    tokens_per_step: int
    step_rates: list[float]  # steps per second of each model over the window
    window_s: float
    steps: int  # steps finished in the window, all models together
    foreign: float  # cores' worth of CPU other processes (plus steal) used in the window
    threads: int  # torch threads of each worker process
    ops_per_pass: float | None = None  # forward_backward ops per compute pass (one worker)
    cut_short: bool = False  # the window closed at the time limit, not at its steps

    @property
    def tokens_per_s(self) -> float:
        return sum(self.step_rates) * self.tokens_per_step

    def tokens_text(self) -> str:
        """tokens/s; marked * for a window cut short at the time limit, † for a disturbed one."""
        marks = ("*" if self.cut_short else "") + ("†" if self.foreign >= QUIET_CORES else "")
        return f"{self.tokens_per_s:,.0f}{marks}"

    @property
    def fairness(self) -> float:
        """Slowest model's step rate over the fastest's (1: every model got the same)."""
        return min(self.step_rates) / max(self.step_rates) if max(self.step_rates) else 0.0


@dataclass
class SizeResult:
    size: Size
    params: int
    lora_params: int
    bare_tokens_s: float  # the bare PEFT loop, one model, in-process
    cells: list[Cell] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # cells that failed, and why

    def cell(self, mode: str, models: int) -> Cell | None:
        return next((c for c in self.cells if c.mode == mode and c.models == models), None)

    def ratio(self, mode: str, other: str, n: int, other_n: int | None = None) -> float | None:
        """tokens/s of `mode` at `n` models over `other` at `other_n` (default the same)."""
        a, b = self.cell(mode, n), self.cell(other, n if other_n is None else other_n)
        if a is None or b is None or not b.tokens_per_s:
            return None
        return a.tokens_per_s / b.tokens_per_s

    def target(self) -> Target:
        what = (
            f"batched ≥ {TARGET_CPU:g}× one at a time, {TARGET_MODELS} models, "
            f"`{self.size.model}`, {self.size.batch} × {self.size.seq}"
        )
        speedup = self.ratio(BATCHED, SERIAL, TARGET_MODELS)
        if speedup is None:
            return Target(what, "not measured", None)
        return Target(what, f"{speedup:.2f}×", speedup >= TARGET_CPU)


@dataclass
class StepLog:
    """One model's finished steps: when (perf_counter) and the forward_backward's job id."""

    done: list[float] = field(default_factory=list)
    fb_ids: list[str] = field(default_factory=list)

    def in_window(self, t0: float, t1: float) -> list[int]:
        return [i for i, t in enumerate(self.done) if t0 < t <= t1]

    def since(self, t0: float) -> int:  # steps finished after t0
        return sum(t > t0 for t in self.done)


@dataclass
class Window:
    t0: float
    t1: float
    foreign: float
    cut_short: bool = False  # closed at --max-cell-s before every model had its steps
    mark: tuple[float, int, int] = (0.0, 0, 0)  # the CPU meter's mark at t0


async def drive(
    clients: list[TrainingClient], size: Size, args: argparse.Namespace, meter: CpuMeter
) -> tuple[list[StepLog], Window]:
    """Every client trains; the window opens once all have warmed up, closes `size.seconds` later
    once each did `args.min_steps` more, or at `args.max_cell_s` (cut short). A failure raises."""
    data, logs = datums(token_rows(size.batch, size.seq)), [StepLog() for _ in clients]
    stop, progress = asyncio.Event(), asyncio.Condition()

    async def train(tc: TrainingClient, log: StepLog) -> None:
        """The Tinker loop, back to back, until `stop`: the step in flight always finishes."""
        while not stop.is_set():
            fb = await tc.forward_backward_async(data, "cross_entropy")
            optim = await tc.optim_step_async(ADAM)
            await fb
            await optim
            log.done.append(time.perf_counter())
            log.fb_ids.append(fb.request_id)
            async with progress:
                progress.notify_all()

    loops = [asyncio.create_task(train(tc, log)) for tc, log in zip(clients, logs, strict=True)]
    win: list[Window] = []  # the window as far as it got

    async def window() -> None:
        async with progress:
            await progress.wait_for(lambda: all(len(g.done) >= size.warmup for g in logs))
        win.append(Window(time.perf_counter(), 0.0, 0.0, cut_short=True, mark=meter.mark()))
        await asyncio.sleep(size.seconds)
        async with progress:
            await progress.wait_for(lambda: all(g.since(win[0].t0) >= args.min_steps for g in logs))
        win[0].t1, win[0].cut_short = time.perf_counter(), False

    timer = asyncio.create_task(window())
    try:
        done, _ = await asyncio.wait(
            [timer, *loops], timeout=args.max_cell_s, return_when=asyncio.FIRST_COMPLETED
        )
        for task in done:
            task.result()  # a loop only ends early by raising: surface it
        if not win:
            raise TimeoutError(f"the models did not finish warming up in {args.max_cell_s:.0f} s")
        if win[0].cut_short:
            print(f"warning: window cut short at {args.max_cell_s:.0f} s", file=sys.stderr)
            win[0].t1 = time.perf_counter()
        timer.cancel()
        win[0].foreign = meter.foreign_since(win[0].mark)
        stop.set()
        await asyncio.gather(*loops)
    finally:
        for task in [timer, *loops]:
            task.cancel()
    return logs, win[0]


def ops_per_pass(redis_url: str, keys: Keys, logs: list[StepLog], win: Window) -> float | None:
    """forward_backward ops per compute pass on one worker: ops whose Redis-clock
    [started_at, finished_at] overlap ran in one pass (one compute thread runs one at a time)."""
    ids = [log.fb_ids[i] for log in logs for i in log.in_window(win.t0, win.t1)]
    spans = sorted(t[1:] for t in job_times(redis_url, keys, ids) if t is not None)
    if not spans:
        return None
    passes, end = 0, float("-inf")
    for start, finish in spans:
        if start >= end:  # no overlap with the pass so far: a new pass
            passes += 1
        end = max(end, finish)
    return len(spans) / passes


def run_cell(
    args: argparse.Namespace, size: Size, mode: str, models: int, run: Run, threads: int
) -> Cell:
    """Fresh workers and N fresh models; drive them; the cell."""
    # What the mode's worker processes get on top of the deployment's settings; a process per
    # model its best case: threads enough to share the cores out, never more.
    env = {BATCH_ENV: "0" if mode == SERIAL else "1"}
    if mode == PROCESSES:
        env["OMP_NUM_THREADS"] = str(max(1, CORES // models))
    deployments = models if mode == PROCESSES else 1
    tag = f"{size.label}-{mode.replace(' ', '-')}-{models}"
    with contextlib.ExitStack() as stack:
        settings = [stack.enter_context(run.deployment(f"tput-{tag}")) for _ in range(deployments)]
        logs = [run.data_dir / f"worker-{tag}-{i}.log" for i in range(deployments)]
        procs = stack.enter_context(lora_workers(settings, size.model, logs, env))
        services = [stack.enter_context(service_client(s)) for s in settings]
        clients = [
            services[i % deployments].create_lora_training_client(size.model, rank=RANK, seed=i)
            for i in range(models)
        ]
        meter = CpuMeter([os.getpid(), *(p.pid for p in procs)])
        step_logs, win = asyncio.run(drive(clients, size, args, meter))
        keys = Keys(settings[0].key_prefix)
        passes = None if mode == PROCESSES else ops_per_pass(args.redis_url, keys, step_logs, win)
    rates, span = [], win.t1 - win.t0
    for log in step_logs:  # each model's steps per second from its first to its last step in it
        times = [log.done[i] for i in log.in_window(win.t0, win.t1)]
        took = times[-1] - times[0] if len(times) >= 2 else 0.0
        rates.append((len(times) - 1) / took if took > 0 else 0.0)
    steps = sum(len(g.in_window(win.t0, win.t1)) for g in step_logs)
    omp = int(env.get("OMP_NUM_THREADS", threads))
    cell = Cell(
        mode, models, size.tokens, rates, span, steps, win.foreign, omp, passes, win.cut_short
    )
    print(f"    {mode}, {models} models: {cell.tokens_per_s:,.0f} tokens/s", flush=True)
    return cell


def measure_size(args: argparse.Namespace, size: Size, run: Run, threads: int) -> SizeResult:
    """The bare PEFT loop's tokens/s (median step, in this process), then every cell."""
    ensure_model(size.model, run.data_dir)  # once, not by every worker at once
    bare = BareLoop(size.model, run.data_dir, token_rows(size.batch, size.seq))
    bare.timed(2)  # warm-up
    tokens_s = size.tokens / statistics.median(t for t, _ in bare.timed(args.bare_steps))
    result = SizeResult(size, bare.params, bare.lora_params, tokens_s)
    del bare  # its model's memory back before the workers start
    print(f"[{size.label}] {size.model}: bare PEFT loop {tokens_s:,.0f} tokens/s", flush=True)
    for models in size.counts:
        for mode in MODES:
            if mode == PROCESSES and models > size.max_processes:
                continue  # more processes than this model's memory allows
            try:
                result.cells.append(run_cell(args, size, mode, models, run, threads))
            except (QueueTinkerError, TimeoutError) as exc:
                # One broken cell (an op the worker failed) costs that cell, not the run.
                failure = f"{mode}, {models} models: {type(exc).__name__}: {str(exc)[:300]}"
                print(f"    FAILED: {failure}", file=sys.stderr, flush=True)
                result.failures.append(failure)
    return result


def parse_shape(text: str) -> tuple[int, int]:
    """'4x64' as (4 datums, 64 tokens)."""
    match = re.fullmatch(r"(\d+)[x×](\d+)", text)
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DATUMSxTOKENS, e.g. 4x64")
    return int(match[1]), int(match[2])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(
        "bench.train_throughput", __doc__, knobs=KNOBS, services=True, data_dir=True
    )
    cli.add_models(parser, SIZES, default=SIZES)
    counts = "how many models train at once"
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 4, 8, 16], help=counts)
    shapes = "the step shapes on every model (default: 1x32 and 4x64 tiny, 4x64 100M)"
    parser.add_argument(
        "--shapes", type=parse_shape, nargs="+", metavar="DATUMSxTOKENS", help=shapes
    )
    quick = {"models": ["tiny"], "counts": [1, 2], "warmup": 2, "min_steps": 2}
    args = cli.parse(parser, argv, quick={**quick, "seconds": 2, "bare_steps": 3})
    args.shapes = args.shapes or ([(1, 32)] if args.quick else None)
    if args.min_steps < 2:
        parser.error("--min-steps must be at least 2 (a rate needs two steps)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Each size's cells in turn; hand back the report. Fails when a cell failed."""
    args = parse_args(argv)
    timing = {"tiny": (args.warmup, args.seconds), "100m": (args.big_warmup, args.big_seconds)}
    sizes = [
        Size(f"{label}-{b}x{s}", model, b, s, tuple(args.counts), *timing[label], most)
        for label in args.models
        for model, most, shapes in [SIZES[label]]
        for b, s in args.shapes or shapes
    ]
    quiet_transformers()
    with service_run(args, TORCH, "qt-bench-tput-") as run:
        threads = run.worker_threads()["worker compute thread"]
        torch.set_num_threads(threads)  # the bare loop computes like the worker
        results = [measure_size(args, size, run, threads) for size in sizes]
    emit(report(args, run, threads, results), docs_of(args), args.json)
    return 1 if any(r.failures for r in results) else 0


def report(args: argparse.Namespace, run: Run, threads: int, results: list[SizeResult]) -> Report:
    """The target per size, then a table per size."""
    facts = [
        f"Torch threads per worker {threads} (process per model: max(1, {CORES} ÷ N)).",
        f"Rank {RANK}; {args.warmup} (tiny) / {args.big_warmup} (100M) warm-up steps; windows of "
        f"at least {args.seconds:g} s (tiny) / {args.big_seconds:g} s (100M) and "
        f"{args.min_steps} steps per model.",
        f"The run took {run.total_s:.0f} s.",
    ]
    targets = [r.target() for r in results]
    gpu = f"batched ≥ {TARGET_GPU:g}× one at a time, {TARGET_MODELS} models, on a GPU"
    targets.append(Target(gpu, "needs a CUDA worker: not measured by this run", None))
    per_size = [
        {**asdict(r), "cells": [{**asdict(c), "tokens_per_s": c.tokens_per_s} for c in r.cells]}
        for r in results
    ]
    body = [part for r in results for part in size_parts(r)]
    return Report(SECTION, COMMAND, run.info, facts, targets, body, {"sizes": per_size})


def row(r: SizeResult, n: int) -> tuple[object, ...]:
    def times(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}×"

    by_mode = [r.cell(mode, n) for mode in MODES]
    batched = by_mode[0]
    passes = None if batched is None else batched.ops_per_pass
    return (
        n, *("–" if c is None else c.tokens_text() for c in by_mode),
        f"**{times(r.ratio(BATCHED, SERIAL, n))}**", times(r.ratio(BATCHED, PROCESSES, n)),
        times(r.ratio(BATCHED, BATCHED, n, 1)), "–" if passes is None else f"{passes:.1f}",
        "–" if batched is None else f"{batched.fairness:.2f}",
        " / ".join("–" if c is None else f"{c.window_s:.0f}" for c in by_mode),
        " / ".join("–" if c is None else f"{c.foreign:.2f}" for c in by_mode),
    )  # fmt: skip


COLUMNS = (
    "models | batched | one at a time | process per model | batched ÷ one at a time | batched ÷ "
    "process per model | batched ÷ batched with 1 model | forward_backward ops per pass (batched) "
    "| slowest ÷ fastest model (batched) | window s (batched / one at a time / processes) "
    "| other processes, cores (same order)"
)


def size_parts(r: SizeResult) -> list[Table | str]:
    """The size's table, the bare loop beside it, and what went wrong."""
    parts: list[Table | str] = [
        Table(
            cells(COLUMNS),
            [row(r, n) for n in r.size.counts],
            caption=f"`{r.size.model}` ({r.params:,} parameters, {r.lora_params:,} in one "
            f"rank-{RANK} LoRA), steps of {r.size.batch} × {r.size.seq} tokens, tokens per "
            "second of training summed over all models:",
            note="The bare PEFT loop (bench.train_step's: one model, in the benchmark process, "
            f"no queue, same threads as a worker): {r.bare_tokens_s:,.0f} tokens/s.",
        )
    ]
    if r.failures:
        parts.append("**Failed cells** (no number for them above): " + "; ".join(r.failures) + ".")
    if any(c.foreign >= QUIET_CORES for c in r.cells):
        parts.append(f"† Other processes took {QUIET_CORES:g} cores or more during that window.")
    if any(c.cut_short for c in r.cells):
        parts.append("\\* That window closed at `--max-cell-s`, before every model had its steps.")
    return parts


if __name__ == "__main__":
    sys.exit(main())
