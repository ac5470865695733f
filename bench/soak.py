"""Soak: many clients over many models for minutes, against real Redis, real Postgres and real
worker processes. No future may get stuck, every op must be done exactly once, and the
workers' memory must stay flat.

The load (all of it real, nothing tuned for the run; production lease/heartbeat/linger):

- `--clients` (20) ServiceClients in this process, each with its own background loop and
  Redis connections, as that many users would have. The `--models` (50) training runs are dealt
  out among them. Each client sends pings at random (Poisson) times, `--rate` (5) per second
  on average, over its models, with at most `--window` (16) in flight; each ping's `delay_ms`
  is drawn from 0 (run inline: the queue's own cost), 1, 5 and 20 ms (the compute thread), so
  ops queue behind each other on a model, workers claim and release models, and the publish
  pipeline sees batches of every size. The load is steady and below saturation (a soak, not a
  stress test), so round trips stay meaningful.
- `--workers` (2) queue-only worker processes serve those pings.
- `--lora-clients` (2) training runs on `queue-tinker/tiny-llama`, served by one LoRA worker
  process: forward_backward + optim_step in a loop, and every `--sample-every` steps
  save_weights_and_get_sampling_client + one short sample, so the torch worker's adapters,
  snapshots, checkpoints and sampler cache are exercised as well. The workers keep at most
  `--max-resident` (8) adapters, so that cache is full within the first minute and every later
  round evicts one: from then on memory must be flat. It computes with one torch thread
  (OMP_NUM_THREADS=1), so it takes one core, not all of them. `--lora-clients 0` leaves it
  out.

Every `--sample-s` (5) seconds the resident memory of each worker process (/proc/<pid>/status,
VmRSS), of this client process, and Redis' used_memory are sampled. A future that does not
resolve within `--stuck-after` (60) seconds counts as stuck. At the end: ops done, p50/p99
round trips, stuck futures, exactly-once checks (every ping's job hash done with attempts 1,
the publish counter equal to the pings done, each model's results numbered 2..n+1 without a
gap or a repeat), and the memory trend: mean of the first minute against the last minute, and
the slope of a least-squares line after the first minute (MiB/min). Results go to stdout and
to the `## Soak` section of docs/benchmarks.md.

    .venv/bin/python -m bench.soak --minutes 5 --clients 20 --models 50
    .venv/bin/python -m bench.soak --minutes 0.5 --no-docs          # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import redis

from bench.harness import cli
from bench.harness.data import datums
from bench.harness.meters import status_kib
from bench.harness.report import publish, save
from bench.harness.run import service_run
from bench.harness.services import (
    delete_matching,
    service_client,
)
from bench.harness.workers import lora_worker, wait_for_workers, worker_proc
from bench.soak_report import (
    DELAYS_MS,
    LORA_MODEL,
    Outcome,
    Tally,
    print_summary,
    render,
    results_json,
)
from queue_tinker import types
from queue_tinker.client import ServiceClient, TrainingClient
from queue_tinker.errors import QueueTinkerError
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings


# --- what the run saw --------------------------------------------------------------------------
class MemorySampler:
    """Resident memory of named processes, this one and Redis', every `interval` seconds."""

    def __init__(self, pids: dict[str, int], redis_url: str, interval: float) -> None:
        self.pids = {**pids, "client process": os.getpid()}
        self.redis_url = redis_url
        self.interval = interval
        self.rows: list[tuple[float, str, int]] = []  # (seconds since start, name, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qt-soak-memory", daemon=True)
        self._started = 0.0

    def __enter__(self) -> MemorySampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        client = redis.Redis.from_url(self.redis_url)
        try:
            while True:
                now = time.monotonic() - self._started
                for name, pid in self.pids.items():
                    rss = process_rss(pid)
                    if rss is not None:
                        self.rows.append((now, name, rss))
                self.rows.append(
                    (now, "Redis used_memory", int(client.info("memory")["used_memory"]))
                )
                if self._stop.wait(self.interval):
                    return
        finally:
            client.close()

    def series(self) -> dict[str, list[tuple[float, int]]]:
        out: dict[str, list[tuple[float, int]]] = defaultdict(list)
        for t, name, value in self.rows:
            out[name].append((t, value))
        return dict(out)


def process_rss(pid: int) -> int | None:
    """VmRSS of a process in bytes, None once it is gone."""
    rss = status_kib(pid, "VmRSS")
    return None if rss is None else rss * 1024


# --- the load ----------------------------------------------------------------------------------
async def ping_client(
    models: list[TrainingClient],
    deadline: float,
    args: argparse.Namespace,
    rng: random.Random,
    tally: Tally,
) -> None:
    """Pings at Poisson times, `args.rate` per second, over `models` until the deadline; at
    most `args.window` in flight."""
    slots = asyncio.Semaphore(args.window)
    stuck_after = args.stuck_after
    tasks: set[asyncio.Task[None]] = set()

    async def one(tc: TrainingClient, n: int) -> None:
        try:
            delay = rng.choice(DELAYS_MS)
            began = time.perf_counter()
            future = await tc.ping_async(n, delay_ms=delay)
            try:
                result = await future.result_async(timeout=stuck_after)
            except TimeoutError:
                tally.stuck.append(future.request_id)
                return
            tally.ping_s.append(time.perf_counter() - began)
            tally.overhead_s.append(tally.ping_s[-1] - delay / 1000)
            tally.job_ids.append(future.request_id)
            tally.seqs[tc.model_id].append(result["seq"])
            if result["data"] != n:
                tally.wrong.append(future.request_id)
        except QueueTinkerError as exc:
            tally.fail(exc)
        finally:
            slots.release()

    n = 0
    next_at = time.monotonic()
    while next_at < deadline:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))  # the arrival time
        next_at += rng.expovariate(args.rate)
        await slots.acquire()
        task = asyncio.create_task(one(models[n % len(models)], n))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        n += 1
    await asyncio.gather(*tasks)


def lora_batch(texts: Sequence[str]) -> list[types.Datum]:
    """Byte tokens (the tiny model's tokenizer), next-token targets, all weights 1."""
    return datums(np.frombuffer(text.encode(), np.uint8).astype(np.int64) for text in texts)


LORA_BATCHES = [
    lora_batch(["the cat sat on the mat", "a dog ran"]),
    lora_batch(["queue tinker trains loras", "one two three four"]),
]
ADAM = types.AdamParams(learning_rate=1e-3)
PROMPT = types.ModelInput.from_ints(list(b"the cat"))
SAMPLE = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])


async def lora_client(
    tc: TrainingClient, deadline: float, sample_every: int, stuck_after: float, tally: Tally
) -> None:
    """Train until the deadline; sample from the current weights every `sample_every` steps."""
    step = 0
    while time.monotonic() < deadline:
        try:
            began = time.perf_counter()
            fb = await tc.forward_backward_async(LORA_BATCHES[step % 2], "cross_entropy")
            opt = await tc.optim_step_async(ADAM)
            for future in (fb, opt):
                try:
                    await future.result_async(timeout=stuck_after)
                except TimeoutError:
                    tally.stuck.append(future.request_id)
            tally.step_s.append(time.perf_counter() - began)
            step += 1
            if step % sample_every == 0:
                sampler = await asyncio.wait_for(
                    tc.save_weights_and_get_sampling_client_async(), stuck_after
                )
                sample = await sampler.sample_async(PROMPT, 1, SAMPLE)
                await sample.result_async(timeout=stuck_after)
                tally.samples += 1
        except QueueTinkerError as exc:
            tally.fail(exc)
        except TimeoutError:
            tally.stuck.append(f"{tc.model_id} (sample)")


async def drive(
    args: argparse.Namespace,
    services: list[ServiceClient],
    lora_service: ServiceClient | None,
    tally: Tally,
) -> float:
    """Run the whole load for args.minutes; the seconds it took (until the last result)."""
    models = [
        await services[i % len(services)].create_lora_training_client_async("tiny")
        for i in range(args.models)
    ]
    runs = (
        [
            await lora_service.create_lora_training_client_async(LORA_MODEL, rank=8)
            for _ in range(args.lora_clients)
        ]
        if lora_service
        else []
    )
    began = time.monotonic()
    deadline = began + args.minutes * 60
    rng = random.Random(args.seed)
    coros = [
        ping_client(
            [m for i, m in enumerate(models) if i % len(services) == c],
            deadline,
            args,
            random.Random(rng.random()),
            tally,
        )
        for c in range(len(services))
    ]
    coros += [lora_client(tc, deadline, args.sample_every, args.stuck_after, tally) for tc in runs]
    await asyncio.gather(*coros)
    return time.monotonic() - began


# --- checks ------------------------------------------------------------------------------------
def exactly_once(redis_url: str, keys: Keys, tally: Tally) -> dict[str, int]:
    """Ping jobs not done with attempts 1, models whose results skip or repeat a seq, and the
    publish counter against the pings done."""
    client = redis.Redis.from_url(redis_url)
    try:
        not_once = 0
        for start in range(0, len(tally.job_ids), 5_000):
            pipe = client.pipeline(transaction=False)
            for job_id in tally.job_ids[start : start + 5_000]:
                pipe.hmget(keys.job(job_id), ["status", "attempts"])
            not_once += sum(
                1 for status, attempts in pipe.execute() if status != b"done" or attempts != b"1"
            )
        published = int(client.hget(keys.metrics_ops(), "ping|done") or 0)
    finally:
        client.close()
    gaps = sum(1 for seqs in tally.seqs.values() if sorted(seqs) != list(range(2, len(seqs) + 2)))
    return {
        "not_done_once": not_once,
        "models_with_gaps": gaps,
        "published_minus_done": published - len(tally.job_ids),
    }


# --- main --------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.soak", __doc__)
    cli.add_services(parser)
    cli.add_knobs(
        parser,
        {
            "--minutes": (5.0, "how long the load runs"),
            "--clients": (20, "ServiceClients in this process"),
            "--models": (50, "training runs the pings go to"),
            "--rate": (5.0, "pings per second per client"),
            "--window": (16, "at most this many pings in flight per client"),
            "--workers": (2, "queue-only workers"),
            "--lora-clients": (2, "training runs on the LoRA worker (0: no LoRA worker)"),
            "--sample-every": (10, "LoRA steps between save-and-sample rounds"),
            "--max-resident": (8, "QT_MAX_RESIDENT_ADAPTERS of the workers"),
            "--sample-s": (5.0, "memory sampling period"),
            "--stuck-after": (60.0, "a future unresolved this long counts as stuck"),
            "--max-slope": (1.0, "MiB/min of worker memory growth still called flat"),
            "--seed": (7, "seed of the arrival times and delays"),
        },
    )
    cli.add_report(parser)
    return cli.parse(parser, argv)


def start_workers(
    stack: contextlib.ExitStack, args: argparse.Namespace, settings: Settings, log_dir: Path
) -> dict[str, int]:
    """The LoRA worker (first: it takes seconds to load), then the queue-only ones; all
    registered on return, stopped when the stack closes. Their pids by name."""
    pids: dict[str, int] = {}
    if args.lora_clients:
        lora = stack.enter_context(lora_worker(settings, LORA_MODEL, log_dir / "soak-lora.log"))
        pids["worker (LoRA, tiny-llama)"] = lora.pid
    for i in range(args.workers):
        proc = worker_proc(settings, log_dir / f"soak-worker-{i}.log")
        stack.callback(proc.stop_and_report, f"worker {proc.pid}")
        pids[f"worker {i + 1} (queue-only)"] = proc.pid
    wait_for_workers(settings, len(pids))
    return pids


def run(
    args: argparse.Namespace, settings: Settings, log_dir: Path, tally: Tally
) -> tuple[float, dict[str, list[tuple[float, int]]]]:
    """Start the workers and the clients, run the load while sampling memory."""
    with contextlib.ExitStack() as stack:
        pids = start_workers(stack, args, settings, log_dir)
        services = [stack.enter_context(service_client(settings)) for _ in range(args.clients)]
        lora_service = stack.enter_context(service_client(settings)) if args.lora_clients else None
        with MemorySampler(pids, settings.redis_url or "", args.sample_s) as memory:
            seconds = asyncio.run(drive(args, services, lora_service, tally))
    return seconds, memory.series()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # One torch thread in the LoRA worker (it inherits this): it takes one core, not all of
    # them, and the ping load keeps the rest.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tally = Tally()
    with service_run(args, ("torch",), "qt-soak-") as soak:
        print(
            f"soak: {args.clients} clients, {args.models} models, {args.workers} queue-only "
            f"workers, {args.lora_clients} LoRA runs, {args.minutes:g} min ...",
            flush=True,
        )
        data = soak.data_dir / "data"
        with soak.deployment("soak", data, max_resident_adapters=args.max_resident) as settings:
            try:
                seconds, series = run(args, settings, soak.data_dir, tally)
                once = exactly_once(args.redis_url, Keys(settings.key_prefix), tally)
            finally:
                delete_matching(args.redis_url, f"rq:*{settings.key_prefix}-housekeeping*")
    outcome = Outcome(tally, seconds, once, series, args.max_slope)
    print_summary(outcome)
    save(args.json, results_json(soak.info, outcome))
    publish(args.docs, args.no_docs, render(args, soak.info, outcome))
    return 0 if all(outcome.checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
