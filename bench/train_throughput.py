"""Training throughput: aggregate training tokens/s of N models training at once, served three
ways: one worker with cross-adapter batching on, one worker with it off, one worker per model.

For each base model (queue-tinker/tiny-llama, queue-tinker/llama-100m) and each N (1, 4, 8, 16):
N `TrainingClient`s (rank-32 LoRA each) run forward_backward + optim_step steps without pause,
concurrently, on a fixed batch (1 × 32 and 4 × 64 datums × tokens on the tiny model, 4 × 64 on
the 100M; `--shapes` picks others), against real worker processes, the local
Redis and a scratch Postgres database:

- batched: one worker, `QT_CROSS_ADAPTER_BATCH=1` (the default);
- one at a time: one worker, `QT_CROSS_ADAPTER_BATCH=0`;
- process per model: N workers, each its own deployment (key prefix) serving one model, with
  max(1, cores // N) torch threads each.

After a warm-up, a window of steady state: each model's step rate there, summed over models and
times tokens per step, is the aggregate. Also measured: the bare PEFT loop (bench.train_step's)
on one model in this process, forward_backward ops per compute pass on the one worker (from the
Redis-clock start/finish times of the ops), and the CPU other processes used meanwhile. Results
go to the `## Training throughput: many models on one worker` section of docs/benchmarks.md.

    .venv/bin/python -m bench.train_throughput            # full run (about 12 minutes)
    .venv/bin/python -m bench.train_throughput --quick    # smoke run, docs left alone
"""

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.harness import cli
from bench.harness.baselines import ADAM, BareLoop
from bench.harness.data import RANK, datums, token_rows
from bench.harness.meters import CpuMeter
from bench.harness.models import ensure_model
from bench.harness.report import publish, save
from bench.harness.run import TORCH, service_run
from bench.harness.services import (
    deployment,
    job_times,
    service_client,
)
from bench.harness.workers import lora_workers, quiet_transformers
from bench.train_throughput_report import (
    BATCHED,
    MODES,
    PROCESSES,
    Cell,
    Size,
    SizeResult,
    print_table,
    render,
    results_json,
)
from queue_tinker.client import TrainingClient
from queue_tinker.errors import QueueTinkerError
from queue_tinker.queue.keys import Keys
from queue_tinker.types import Datum

BATCH_ENV = "QT_CROSS_ADAPTER_BATCH"  # read by `queue-tinker worker` (Settings.cross_adapter_batch)
CORES = os.cpu_count() or 1


@dataclass
class StepLog:
    """One model's finished steps: when (perf_counter) and the forward_backward's job id."""

    done: list[float] = field(default_factory=list)
    fb_ids: list[str] = field(default_factory=list)

    def in_window(self, t0: float, t1: float) -> list[int]:
        return [i for i, t in enumerate(self.done) if t0 < t <= t1]


@dataclass
class Window:
    t0: float
    t1: float
    foreign: float
    cut_short: bool = False  # closed at --max-cell-s before every model had its steps
    mark: tuple[float, int, int] | None = None  # the CPU meter's mark at t0


# --- driving N models --------------------------------------------------------------------------
async def train(
    tc: TrainingClient,
    data: list[Datum],
    log: StepLog,
    stop: asyncio.Event,
    progress: asyncio.Condition,
) -> None:
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


async def drive(
    clients: list[TrainingClient],
    data: list[Datum],
    size: Size,
    args: argparse.Namespace,
    meter: CpuMeter,
) -> tuple[list[StepLog], Window]:
    """Every client trains; the window opens once each has done `size.warmup` steps and closes
    after `size.seconds` once each has done `args.min_steps` more, or when `args.max_cell_s`
    have passed since the start (cut short). A failing loop raises: the cell fails."""
    logs = [StepLog() for _ in clients]
    stop, progress = asyncio.Event(), asyncio.Condition()
    loops = [
        asyncio.create_task(train(tc, data, log, stop, progress))
        for tc, log in zip(clients, logs, strict=True)
    ]
    win: list[Window] = []  # the window as far as it got

    async def window() -> None:
        async with progress:
            await progress.wait_for(lambda: all(len(g.done) >= size.warmup for g in logs))
        win.append(Window(time.perf_counter(), 0.0, 0.0, cut_short=True, mark=meter.mark()))
        await asyncio.sleep(size.seconds)
        async with progress:
            await progress.wait_for(
                lambda: all(
                    len(g.in_window(win[0].t0, time.perf_counter())) >= args.min_steps for g in logs
                )
            )
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
        if win[0].mark is not None:
            win[0].foreign = meter.foreign_since(win[0].mark)
        stop.set()
        await asyncio.gather(*loops)
    finally:
        for task in [timer, *loops]:
            task.cancel()
    return logs, win[0]


def step_rates(logs: list[StepLog], win: Window) -> list[float]:
    """Each model's steps per second between its first and last step in the window."""
    rates = []
    for log in logs:
        times = [log.done[i] for i in log.in_window(win.t0, win.t1)]
        span = times[-1] - times[0] if len(times) >= 2 else 0.0
        rates.append((len(times) - 1) / span if span > 0 else 0.0)
    return rates


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
            passes, end = passes + 1, finish
        else:
            end = max(end, finish)
    return len(spans) / passes


# --- one cell: a mode at a model count ---------------------------------------------------------
def cell_env(mode: str, models: int) -> dict[str, str]:
    """What the mode's worker processes get on top of the deployment's settings."""
    if mode == PROCESSES:
        # Each process's best case: threads enough to share the cores out, never more.
        return {BATCH_ENV: "1", "OMP_NUM_THREADS": str(max(1, CORES // models))}
    return {BATCH_ENV: "1" if mode == BATCHED else "0"}


def run_cell(
    args: argparse.Namespace,
    size: Size,
    mode: str,
    models: int,
    database_url: str,
    data_dir: Path,
    threads: int,
) -> Cell:
    """Fresh workers and N fresh models; drive them; the cell."""
    data = datums(token_rows(size.batch, size.seq))
    env = cell_env(mode, models)
    deployments = models if mode == PROCESSES else 1
    tag = f"{size.label}-{mode.replace(' ', '-')}-{models}"
    with contextlib.ExitStack() as stack:
        settings = [
            stack.enter_context(deployment(args.redis_url, database_url, f"tput-{tag}", data_dir))
            for _ in range(deployments)
        ]
        logs = [data_dir / f"worker-{tag}-{i}.log" for i in range(deployments)]
        began = time.perf_counter()
        procs = stack.enter_context(lora_workers(settings, size.model, logs, env))
        print(
            f"    {mode}, {models} models: {deployments} worker(s) ready in "
            f"{time.perf_counter() - began:.0f} s",
            flush=True,
        )
        services = [stack.enter_context(service_client(s)) for s in settings]
        clients = [
            services[i % deployments].create_lora_training_client(size.model, rank=RANK, seed=i)
            for i in range(models)
        ]
        meter = CpuMeter([os.getpid(), *(p.pid for p in procs)])
        step_logs, win = asyncio.run(drive(clients, data, size, args, meter))
        passes = (
            None
            if mode == PROCESSES
            else ops_per_pass(args.redis_url, Keys(settings[0].key_prefix), step_logs, win)
        )
    cell = Cell(
        mode,
        models,
        size.tokens,
        step_rates(step_logs, win),
        win.t1 - win.t0,
        sum(len(g.in_window(win.t0, win.t1)) for g in step_logs),
        win.foreign,
        int(env.get("OMP_NUM_THREADS", threads)),
        passes,
        win.cut_short,
    )
    print(
        f"    {mode}, {models} models: {cell.tokens_per_s:,.0f} tokens/s over "
        f"{cell.window_s:.1f} s ({cell.steps} steps, ops per pass {passes or 1:.1f}, other "
        f"processes {cell.foreign:.2f} cores)",
        flush=True,
    )
    return cell


def bare_tokens_per_s(size: Size, data_dir: Path, steps: int) -> tuple[float, int, int]:
    """The bare PEFT loop on one model in this process: tokens/s of its median step, and the
    base model's and the LoRA's parameter counts."""
    bare = BareLoop(size.model, data_dir, token_rows(size.batch, size.seq))
    bare.timed(2)  # warm-up
    median = statistics.median(t for t, _ in bare.timed(steps))
    return size.tokens / median, bare.params, bare.lora_params


def measure_size(
    args: argparse.Namespace, size: Size, database_url: str, data_dir: Path, threads: int
) -> SizeResult:
    ensure_model(size.model, data_dir)  # once, not by every worker at once
    bare, params, lora = bare_tokens_per_s(size, data_dir, args.bare_steps)
    result = SizeResult(size, params, lora, bare)
    print(f"[{size.label}] {size.model}: bare PEFT loop {bare:,.0f} tokens/s", flush=True)
    for models in size.counts:
        for mode in MODES:
            if mode == PROCESSES and models > size.max_processes:
                print(
                    f"    {mode}, {models} models: skipped (more than {size.max_processes} "
                    "processes)",
                    flush=True,
                )
                continue
            try:
                result.cells.append(
                    run_cell(args, size, mode, models, database_url, data_dir, threads)
                )
            except (QueueTinkerError, TimeoutError) as exc:
                # One broken cell (an op the worker failed) costs that cell, not the run.
                print(f"    {mode}, {models} models: FAILED: {exc}", file=sys.stderr, flush=True)
                result.failures.append(
                    f"{mode}, {models} models: {type(exc).__name__}: {str(exc)[:300]}"
                )
    return result


# --- main --------------------------------------------------------------------------------------
# Per base model: the most worker processes the per-model mode starts (a 100M worker holds
# ~1 GB) and the step shapes (datums, tokens) measured by default: on the tiny model a small
# step, whose compute is mostly per-op overhead, and a bigger one, closer to compute-bound.
SIZES: dict[str, tuple[str, int, tuple[tuple[int, int], ...]]] = {
    "tiny": ("queue-tinker/tiny-llama", 16, ((1, 32), (4, 64))),
    "100m": ("queue-tinker/llama-100m", 8, ((4, 64),)),
}


def parse_shape(text: str) -> tuple[int, int]:
    """'4x64' as (4 datums, 64 tokens)."""
    match = re.fullmatch(r"(\d+)[x×](\d+)", text)
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DATUMSxTOKENS, e.g. 4x64")
    return int(match[1]), int(match[2])


def sizes(args: argparse.Namespace) -> list[Size]:
    return [
        Size(
            f"{label}-{batch}x{seq}",
            SIZES[label][0],
            batch,
            seq,
            tuple(args.counts),
            args.warmup if label == "tiny" else args.big_warmup,
            args.seconds if label == "tiny" else args.big_seconds,
            SIZES[label][1],
        )
        for label in args.models
        for batch, seq in (args.shapes or SIZES[label][2])
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.train_throughput", __doc__)
    cli.add_services(parser)
    cli.add_models(parser, SIZES, default=SIZES)
    parser.add_argument(
        "--counts", type=int, nargs="+", default=[1, 4, 8, 16], help="how many models train at once"
    )
    parser.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        default=None,
        metavar="DATUMSxTOKENS",
        help="the step shapes to measure on every model (default: 1x32 and "
        "4x64 on the tiny model, 4x64 on the 100M)",
    )
    cli.add_knobs(
        parser,
        {
            "--warmup": (3, "steps per model before the window, tiny model"),
            "--big-warmup": (1, "the same, 100M"),
            "--min-steps": (3, "steps every model finishes in the window (2 at least)"),
            "--seconds": (10.0, "least window, tiny model"),
            "--big-seconds": (15.0, "least window, 100M"),
            "--max-cell-s": (
                300.0,
                "close a cell's window after this long (reported as cut short)",
            ),
            "--bare-steps": (10, "bare PEFT loop steps"),
        },
    )
    cli.add_data_dir(parser)
    cli.add_report(parser)
    cli.add_quick(parser)
    quick = {"models": ["tiny"], "counts": [1, 2], "warmup": 2, "min_steps": 2}
    args = cli.parse(parser, argv, quick={**quick, "seconds": 2, "bare_steps": 3})
    if args.quick:
        args.shapes = args.shapes or [(1, 32)]
    if args.min_steps < 2:
        parser.error("--min-steps must be at least 2 (a rate needs two steps)")
    return args


def batching_note() -> str:
    return f"Cross-adapter batching switched by `{BATCH_ENV}` in the workers' environment."


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_transformers()
    with service_run(args, TORCH, "qt-bench-tput-") as run:
        print(batching_note(), flush=True)
        threads = run.worker_threads()["worker compute thread"]
        torch.set_num_threads(threads)  # the bare loop computes like the worker
        results = [
            measure_size(args, size, run.database_url, run.data_dir, threads)
            for size in sizes(args)
        ]
    total_s = run.total_s
    print_table(results)
    print(f"total {total_s:.0f} s")
    info = run.info
    save(args.json, results_json(info, results))
    method = {
        "rank": str(RANK),
        "warmup": f"{args.warmup} (tiny) / {args.big_warmup} (100M)",
        "min_steps": str(args.min_steps),
        "seconds": f"{args.seconds:g} s (tiny) / {args.big_seconds:g} s (100M)",
    }
    info = {
        **info,
        "torch threads per worker": f"{threads} (process per model: max(1, {CORES} ÷ N))",
    }
    publish(args.docs, args.no_docs, render(info, results, method, batching_note(), total_s))
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
