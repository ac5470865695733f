"""Soak: many clients over many models for minutes against real Redis, Postgres and workers:
no future stuck, every op done exactly once, worker memory flat (exit 1 when a check is not
met). The load and the checks: the `## Soak` section of docs/benchmarks.md.

    .venv/bin/python -m bench.soak --minutes 5 --clients 20 --models 50
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import threading
import time
from argparse import Namespace
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import redis

from bench.harness import cli
from bench.harness.data import datums
from bench.harness.meters import status_kib
from bench.harness.report import Report, Table, Target, docs_of, emit
from bench.harness.run import service_run
from bench.harness.services import delete_matching, hash_fields, service_client
from bench.harness.stats import Latency
from bench.harness.workers import lora_worker, running_workers, wait_for_workers
from queue_tinker import types
from queue_tinker.client import ServiceClient, TrainingClient
from queue_tinker.errors import QueueTinkerError
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

SECTION = "## Soak"
COMMAND = ".venv/bin/python -m bench.soak --minutes 5 --clients 20 --models 50"
LORA_MODEL = "queue-tinker/tiny-llama"
DELAYS_MS = (0, 0, 1, 5, 20)  # drawn uniformly: 40% inline, the rest on the compute thread
MIB = 1024 * 1024
Series = dict[str, list[tuple[float, int]]]  # per process: (seconds since start, bytes)
KNOBS = {
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
}
QUICK = {"minutes": 0.5, "clients": 4, "models": 8, "max_slope": 1000.0}


# --- what the run saw --------------------------------------------------------------------------
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
    seconds: float = 0.0  # how long the load ran, until the last result

    def fail(self, exc: BaseException) -> None:
        name = type(exc).__name__
        if name not in self.failed:
            print(f"warning: op failed: {name}: {exc}", file=sys.stderr, flush=True)
        self.failed[name] = self.failed.get(name, 0) + 1


@contextlib.contextmanager
def sampling_memory(pids: dict[str, int], redis_url: str, interval: float) -> Iterator[Series]:
    """Resident memory of named processes, this one and Redis', every `interval` seconds, into
    the series it yields."""
    pids = {**pids, "client process": os.getpid()}
    series: Series = defaultdict(list)
    stop = threading.Event()
    began = time.monotonic()

    def sample() -> None:
        with redis.Redis.from_url(redis_url) as client:
            while True:
                now = time.monotonic() - began
                for name, pid in pids.items():
                    if (rss := status_kib(pid, "VmRSS")) is not None:  # None once it is gone
                        series[name].append((now, rss * 1024))
                series["Redis used_memory"].append((now, int(client.info("memory")["used_memory"])))
                if stop.wait(interval):
                    return

    thread = threading.Thread(target=sample, name="qt-soak-memory", daemon=True)
    thread.start()
    try:
        yield series
    finally:
        stop.set()
        thread.join()


@dataclass
class Trend:
    """One process's memory over the run."""

    first_min_mib: float
    last_min_mib: float
    slope_mib_per_min: float  # least squares, after the first minute (or over all, if shorter)
    samples: int


def trend(series: list[tuple[float, int]]) -> Trend:
    t = np.array([s for s, _ in series])
    mib = np.array([v for _, v in series]) / MIB
    window = min(60.0, t[-1] / 2) if len(t) > 1 else 0.0
    first = mib[t <= t[0] + window] if window else mib
    last = mib[t >= t[-1] - window] if window else mib
    settled = t >= 60.0 if t[-1] >= 120.0 else np.ones_like(t, dtype=bool)
    slope = float(np.polyfit(t[settled] / 60, mib[settled], 1)[0]) if settled.sum() > 2 else 0.0
    return Trend(float(first.mean()), float(last.mean()), slope, len(t))


# --- the load ----------------------------------------------------------------------------------
async def ping_client(
    models: list[TrainingClient], deadline: float, args: Namespace, rng: random.Random, tally: Tally
) -> None:
    """Pings at Poisson times, `args.rate` per second, over `models` until the deadline; at
    most `args.window` in flight."""
    slots = asyncio.Semaphore(args.window)
    tasks: set[asyncio.Task[None]] = set()

    async def one(tc: TrainingClient, n: int) -> None:
        try:
            delay = rng.choice(DELAYS_MS)
            began = time.perf_counter()
            future = await tc.ping_async(n, delay_ms=delay)
            try:
                result = await future.result_async(timeout=args.stuck_after)
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


# Byte tokens (the tiny model's tokenizer), next-token targets, all weights 1.
LORA_BATCHES = [
    datums(np.frombuffer(text.encode(), np.uint8).astype(np.int64) for text in texts)
    for texts in (
        ("the cat sat on the mat", "a dog ran"),
        ("queue tinker trains loras", "one two three four"),
    )
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
    args: Namespace, services: list[ServiceClient], lora: ServiceClient | None, tally: Tally
) -> None:
    """Run the whole load for args.minutes; `tally.seconds` is how long it took."""
    models = [
        await services[i % len(services)].create_lora_training_client_async("tiny")
        for i in range(args.models)
    ]
    runs = [
        await lora.create_lora_training_client_async(LORA_MODEL, rank=8)
        for _ in range(args.lora_clients)
        if lora is not None
    ]
    began = time.monotonic()
    deadline = began + args.minutes * 60
    rng = random.Random(args.seed)
    coros = [
        ping_client(models[c :: len(services)], deadline, args, random.Random(rng.random()), tally)
        for c in range(len(services))
    ]
    coros += [lora_client(tc, deadline, args.sample_every, args.stuck_after, tally) for tc in runs]
    await asyncio.gather(*coros)
    tally.seconds = time.monotonic() - began


# --- checks ------------------------------------------------------------------------------------
def exactly_once(redis_url: str, keys: Keys, tally: Tally) -> dict[str, int]:
    """Ping jobs not done with attempts 1, models whose results skip or repeat a seq, and the
    publish counter against the pings done."""
    jobs = hash_fields(
        redis_url, [keys.job(job_id) for job_id in tally.job_ids], "status", "attempts"
    )
    not_once = sum(fields != [b"done", b"1"] for fields in jobs)
    with redis.Redis.from_url(redis_url) as client:
        published = int(client.hget(keys.metrics_ops(), "ping|done") or 0)
    gaps = sum(1 for seqs in tally.seqs.values() if sorted(seqs) != list(range(2, len(seqs) + 2)))
    return {
        "not_done_once": not_once,
        "models_with_gaps": gaps,
        "published_minus_done": published - len(tally.job_ids),
    }


# --- main --------------------------------------------------------------------------------------
def run(args: Namespace, settings: Settings, log_dir: Path, tally: Tally) -> Series:
    """Start the LoRA worker (first: it takes seconds to load), the queue-only ones and the
    clients; run the load while sampling memory; stop them all."""
    pids: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        if args.lora_clients:
            lora = stack.enter_context(lora_worker(settings, LORA_MODEL, log_dir / "soak-lora.log"))
            pids["worker (LoRA, tiny-llama)"] = lora.pid
        procs = stack.enter_context(running_workers(settings, args.workers, log_dir, "soak"))
        pids.update({f"worker {i + 1} (queue-only)": p.pid for i, p in enumerate(procs)})
        wait_for_workers(settings, len(pids))  # all of them, the LoRA worker too
        services = [stack.enter_context(service_client(settings)) for _ in range(args.clients)]
        lora_service = stack.enter_context(service_client(settings)) if args.lora_clients else None
        with sampling_memory(pids, settings.redis_url or "", args.sample_s) as series:
            asyncio.run(drive(args, services, lora_service, tally))
    return dict(series)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the load and the checks; hand back the report; exit 1 when a check is not met."""
    quick = "0.5 min, 4 clients, 8 models, memory not judged"
    parser = cli.parser("bench.soak", __doc__, knobs=KNOBS, quick=quick, services=True)
    args = cli.parse(parser, argv, quick=QUICK)
    # One torch thread in the LoRA worker (it inherits this), so the ping load keeps a core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tally = Tally()
    with service_run(args, ("torch",), "qt-soak-") as soak:
        print(f"soak: {args.clients} clients, {args.minutes:g} min ...", flush=True)
        data = soak.data_dir / "data"
        with soak.deployment("soak", data, max_resident_adapters=args.max_resident) as settings:
            try:
                series = run(args, settings, soak.data_dir, tally)
                once = exactly_once(args.redis_url, Keys(settings.key_prefix), tally)
            finally:
                delete_matching(args.redis_url, f"rq:*{settings.key_prefix}-housekeeping*")
    done = report(args, soak.info, tally, once, series)
    emit(done, docs_of(args), args.json)
    return 0 if all(t.met for t in done.targets) else 1


# --- the report --------------------------------------------------------------------------------
def report(
    args: Namespace, info: dict[str, str], tally: Tally, once: dict[str, int], series: Series
) -> Report:
    """The checks as targets, what the clients saw, and every process's memory trend."""
    trends = {name: trend(points) for name, points in series.items()}
    workers = [t.slope_mib_per_min for n, t in trends.items() if n.startswith("worker")]
    steepest = max(workers, default=0.0)
    failed = ", ".join(f"{n} × {k}" for k, n in tally.failed.items()) or "none"
    exact = (
        f"pings not done with attempts 1: {once['not_done_once']}; models whose results skip or "
        f"repeat a seq: {once['models_with_gaps']}; ping publishes minus pings done: "
        f"{once['published_minus_done']}"
    )
    targets = [
        Target("no stuck futures", f"{len(tally.stuck)} unresolved after {args.stuck_after:g} s",
               not tally.stuck),
        Target("no failed or wrong op", f"failed: {failed}; wrong results: {len(tally.wrong)}",
               not tally.failed and not tally.wrong),
        Target("every op done exactly once", exact, not any(once.values())),
        Target(f"worker memory flat (slope ≤ {args.max_slope:g} MiB/min)",
               f"steepest {steepest:+.2f} MiB/min", steepest <= args.max_slope),
    ]  # fmt: skip
    pings, overheads = Latency(tally.ping_s or [0.0]), Latency(tally.overhead_s or [0.0])
    steps = Latency(tally.step_s) if tally.step_s else None
    done = len(tally.ping_s)
    seen = {
        "pings done": f"{done:,} in {tally.seconds:.0f} s ({done / tally.seconds:,.0f}/s)",
        "ping round trip (submit → result)":
            f"p50 {pings.p50:.1f} ms, p99 {pings.p99:.1f} ms, max {pings.max:.0f} ms",
        "the same minus each ping's `delay_ms`":
            f"p50 {overheads.p50:.1f} ms, p99 {overheads.p99:.1f} ms",
    }  # fmt: skip
    if steps is not None:
        seen["LoRA steps (forward_backward + optim_step)"] = (
            f"{len(tally.step_s):,}; p50 {steps.p50:.0f} ms, p99 {steps.p99:.0f} ms; "
            f"{tally.samples} save-and-sample rounds"
        )
    memory = Table(
        ("process", "first minute, mean MiB", "last minute, mean MiB", "growth MiB",
         "slope after the first minute, MiB/min", "samples"),
        [(name, f"{t.first_min_mib:.1f}", f"{t.last_min_mib:.1f}",
          f"{t.last_min_mib - t.first_min_mib:+.1f}", f"{t.slope_mib_per_min:+.2f}", t.samples)
         for name, t in trends.items()],
    )  # fmt: skip
    facts = [
        f"The load ran {tally.seconds:.0f} s: {args.clients} clients, {args.rate:g} pings a second "
        f"each (at most {args.window} in flight), over {args.models} models served by "
        f"{args.workers} queue-only workers; {args.lora_clients} LoRA runs (a save-and-sample "
        f"round every {args.sample_every} steps), at most {args.max_resident} resident "
        f"adapters; memory sampled every {args.sample_s:g} s. Clients, workers, Redis and "
        "Postgres share this machine's cores."
    ]
    results = {
        "seconds": tally.seconds,
        "pings": pings.summary(),
        "ping_overhead": overheads.summary(),
        "lora_steps": None if steps is None else steps.summary(),
        **{name: getattr(tally, name) for name in ("samples", "stuck", "failed", "wrong")},
        "exactly_once": once,
        "checks": {t.what: t.met for t in targets},
        "memory": {name: {**asdict(t), "series": series[name]} for name, t in trends.items()},
    }
    body = [Table(("what", "value"), list(seen.items())), memory]
    return Report(SECTION, COMMAND, info, facts, targets, body, results)


if __name__ == "__main__":
    sys.exit(main())
