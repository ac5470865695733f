"""Queue overhead: what one trivial op costs end to end, and how many per second the queue moves.

Measures, in one run, against real Redis, real Postgres and real worker processes:

1. Round-trip latency of a trivial op (`TrainingClient.ping`) with one worker: submit ->
   result seen by the client, sequential, through the sync API (`client.ping(i).result()`) and
   the async API (`await (await client.ping_async(i))`); p50/p90/p99/max, plus where the time
   goes (stage timestamps from the job hash: queued_at, started_at, finished_at).
2. Sustained throughput with 1 and with 2 workers: many pings in flight over several models,
   a bounded window of in-flight futures, async API -> ops/s.
3. The baseline: rq `SimpleWorker` (no fork, its own process) running a trivial job against
   the same Redis: sequential round-trip latency (enqueue, then `job.latest_result(timeout=)`,
   which blocks on rq's result stream with XREAD) and throughput (jobs enqueued up front, then
   `SimpleWorker.work(burst=True)` in a separate process, timed inside that process).

Every part uses a fresh Redis key prefix (rq: a fresh queue name) and the run uses one scratch
Postgres database, created and migrated here and dropped at the end. Workers are separate
processes (`python -m queue_tinker.cli worker --base-model tiny --device cpu`), stopped with
SIGTERM. Results go to stdout and to the `## Queue overhead` section of docs/benchmarks.md.

    .venv/bin/python -m bench.queue_overhead            # the full run (about 2-3 minutes)
    .venv/bin/python -m bench.queue_overhead --quick    # a smoke run, docs left alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: `python bench/queue_overhead.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import redis

from queue_tinker.client import ServiceClient, TrainingClient
from queue_tinker.errors import QueueTinkerError
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "benchmarks.md"
SECTION = "## Queue overhead"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
COMMAND = ".venv/bin/python -m bench.queue_overhead"

# The targets from the issue.
TARGET_P50_MS = 1.0
TARGET_P99_MS = 5.0
TARGET_OPS_1W = 2_000.0


# --- statistics --------------------------------------------------------------------------------
@dataclass
class Latency:
    """Round-trip samples in seconds, summarised in milliseconds."""

    samples: list[float]

    def pct(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.samples), q)) * 1000

    @property
    def p50(self) -> float:
        return self.pct(50)

    @property
    def p90(self) -> float:
        return self.pct(90)

    @property
    def p99(self) -> float:
        return self.pct(99)

    @property
    def max(self) -> float:
        return max(self.samples) * 1000

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples)) * 1000

    def summary(self) -> dict[str, float]:
        return {"n": len(self.samples), "p50_ms": self.p50, "p90_ms": self.p90,
                "p99_ms": self.p99, "max_ms": self.max, "mean_ms": self.mean}


@dataclass
class Stages:
    """Per-op durations (seconds) of the stages of one round trip, from the job's timestamps."""

    names: tuple[str, ...] = (
        "submit call returns (client holds the future)",
        "submit -> queued_at (client -> enqueue script)",
        "queued_at -> started_at (worker pick-up)",
        "started_at -> finished_at (execute, publish)",
        "finished_at -> result in the client's hand",
    )
    rows: list[tuple[float, ...]] = field(default_factory=list)

    def medians_ms(self) -> dict[str, float]:
        if not self.rows:
            return {}
        columns = np.asarray(self.rows).T * 1000
        return {name: float(np.median(col)) for name, col in zip(self.names, columns, strict=True)}

    def p99s_ms(self) -> dict[str, float]:
        if not self.rows:
            return {}
        columns = np.asarray(self.rows).T * 1000
        return {name: float(np.percentile(col, 99))
                for name, col in zip(self.names, columns, strict=True)}


@dataclass
class Sample:
    """One sequential op as the client saw it (wall clock, so it lines up with Redis TIME)."""

    job_id: str
    submitted: float  # time.time() just before the call
    enqueued_s: float  # how long the submit call took
    total_s: float  # submit -> result in hand


@dataclass
class Throughput:
    ops: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0


# --- processes ---------------------------------------------------------------------------------
def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child process see `settings` (as tests/procs.py does)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QT_")}
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"QT_{name.upper()}"] = str(value)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Proc:
    """A child process logging to a file, stopped with SIGTERM."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._log.close()
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def worker_proc(settings: Settings, log_path: Path) -> Proc:
    return Proc([sys.executable, "-m", "queue_tinker.cli", "worker", "--base-model", "tiny",
                 "--device", "cpu"], settings_env(settings), log_path)


@contextlib.contextmanager
def running_workers(
    settings: Settings, count: int, log_dir: Path, tag: str
) -> Iterator[list[Proc]]:
    procs = [worker_proc(settings, log_dir / f"{tag}-worker-{i}.log") for i in range(count)]
    try:
        wait_for_workers(settings, count)
        yield procs
    finally:
        for proc in procs:
            code = proc.stop()
            if code != 0:
                print(f"warning: worker {proc.pid} exited with {code}:\n{proc.log()[-2000:]}",
                      file=sys.stderr)


def wait_for_workers(settings: Settings, count: int, timeout: float = 60) -> None:
    client = redis.Redis.from_url(settings.redis_url or "")
    keys = Keys(settings.key_prefix)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if client.zcard(keys.workers()) >= count:
                return
            time.sleep(0.02)
    finally:
        client.close()
    raise TimeoutError(f"fewer than {count} workers registered within {timeout}s")


def delete_matching(redis_url: str, pattern: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        found = list(client.scan_iter(match=pattern, count=1000))
        for start in range(0, len(found), 500):
            client.delete(*found[start : start + 500])
        return len(found)
    finally:
        client.close()


@contextlib.contextmanager
def fresh_prefix(redis_url: str, part: str) -> Iterator[str]:
    prefix = f"qt-bench-{part}-{uuid.uuid4().hex[:8]}"
    try:
        yield prefix
    finally:
        delete_matching(redis_url, f"{prefix}:*")


@contextlib.contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    """A new database at the head migration, dropped afterwards."""
    from queue_tinker.store.db import create_database, drop_database, with_database
    from queue_tinker.store.migrate import upgrade

    name = f"qt_bench_{uuid.uuid4().hex[:12]}"
    asyncio.run(create_database(admin_url, name))
    try:
        url = with_database(admin_url, name)
        upgrade(url)
        yield url
    finally:
        asyncio.run(drop_database(admin_url, name))


def make_settings(redis_url: str, database_url: str, prefix: str, data_dir: Path) -> Settings:
    # Production defaults for leases, heartbeats and linger: nothing tuned for the benchmark.
    return Settings(redis_url=redis_url, database_url=database_url, key_prefix=prefix,
                    data_dir=data_dir)


def close_client(service: ServiceClient, timeout: float = 15) -> None:
    """Close the client, but never hang the benchmark on it: a close that does not return in
    `timeout` seconds is reported and left behind (its thread is a daemon)."""
    import threading

    closer = threading.Thread(target=service.close, name="qt-bench-close", daemon=True)
    closer.start()
    closer.join(timeout)
    if closer.is_alive():
        print(f"warning: ServiceClient.close() did not return within {timeout:g} s",
              file=sys.stderr, flush=True)


# --- part 1: round-trip latency ----------------------------------------------------------------
def sync_latency(client: TrainingClient, warmup: int, ops: int) -> list[Sample]:
    samples: list[Sample] = []
    for i in range(warmup + ops):
        wall = time.time()
        t0 = time.perf_counter()
        future = client.ping(i)
        t1 = time.perf_counter()
        result = future.result(timeout=30)
        t2 = time.perf_counter()
        if result["data"] != i:
            raise AssertionError(f"ping {i} returned {result!r}")
        if i >= warmup:
            samples.append(Sample(future.request_id, wall, t1 - t0, t2 - t0))
    return samples


async def async_latency(client: TrainingClient, warmup: int, ops: int) -> list[Sample]:
    samples: list[Sample] = []
    for i in range(warmup + ops):
        wall = time.time()
        t0 = time.perf_counter()
        future = await client.ping_async(i)
        t1 = time.perf_counter()
        result = await future
        t2 = time.perf_counter()
        if result["data"] != i:
            raise AssertionError(f"ping {i} returned {result!r}")
        if i >= warmup:
            samples.append(Sample(future.request_id, wall, t1 - t0, t2 - t0))
    return samples


def stage_breakdown(redis_url: str, keys: Keys, samples: list[Sample]) -> Stages:
    """Split each round trip at the Redis-clock timestamps the scripts wrote into the job hash
    (client and Redis share this host's clock)."""
    client = redis.Redis.from_url(redis_url)
    try:
        pipe = client.pipeline(transaction=False)
        for sample in samples:
            pipe.hmget(keys.job(sample.job_id), ["queued_at", "started_at", "finished_at"])
        replies = pipe.execute()
    finally:
        client.close()
    stages = Stages()
    for sample, reply in zip(samples, replies, strict=True):
        if None in reply:
            continue
        queued, started, finished = (float(v) for v in reply)
        seen = sample.submitted + sample.total_s
        stages.rows.append((sample.enqueued_s, queued - sample.submitted, started - queued,
                            finished - started, seen - finished))
    return stages


@dataclass
class LatencyResult:
    latency: Latency
    enqueue: Latency
    stages: Stages


def run_latency(args: argparse.Namespace, database_url: str, log_dir: Path
                ) -> dict[str, LatencyResult]:
    results: dict[str, LatencyResult] = {}
    with fresh_prefix(args.redis_url, "latency") as prefix:
        settings = make_settings(args.redis_url, database_url, prefix, log_dir / "data")
        with running_workers(settings, 1, log_dir, "latency"):
            service = ServiceClient(settings)
            try:
                keys = Keys(prefix)
                sync_client = service.create_lora_training_client("tiny")
                samples = sync_latency(sync_client, args.warmup, args.ops)
                results["sync"] = LatencyResult(
                    Latency([s.total_s for s in samples]), Latency([s.enqueued_s for s in samples]),
                    stage_breakdown(args.redis_url, keys, samples))
                async_client = service.create_lora_training_client("tiny")
                samples = asyncio.run(async_latency(async_client, args.warmup, args.ops))
                results["async"] = LatencyResult(
                    Latency([s.total_s for s in samples]), Latency([s.enqueued_s for s in samples]),
                    stage_breakdown(args.redis_url, keys, samples))
            finally:
                close_client(service)
    return results


# --- part 2: throughput ------------------------------------------------------------------------
async def pump(clients: list[TrainingClient], total: int, window: int
               ) -> tuple[float, dict[str, int]]:
    """Keep `window` pings in flight, spread round robin over the clients.

    Returns the seconds taken and the errors the service raised, counted by type (a typed
    queue_tinker error fails that op, not the run: the benchmark reports it). A wrong result
    or any other exception stops the run.
    """
    slots = asyncio.Semaphore(window)
    errors: dict[str, int] = {}
    fatal: list[BaseException] = []

    async def one(client: TrainingClient, i: int) -> None:
        try:
            future = await client.ping_async(i)
            result = await future
            if result["data"] != i:
                raise AssertionError(f"ping {i} returned {result!r}")
        except QueueTinkerError as exc:
            name = type(exc).__name__
            if name not in errors:
                print(f"warning: ping failed: {name}: {exc}", file=sys.stderr, flush=True)
            errors[name] = errors.get(name, 0) + 1
        except BaseException as exc:  # surfaced after the run
            fatal.append(exc)
        finally:
            slots.release()

    tasks: set[asyncio.Task[None]] = set()
    started = time.perf_counter()
    for i in range(total):
        await slots.acquire()
        if fatal:
            break
        task = asyncio.create_task(one(clients[i % len(clients)], i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    if fatal:
        raise fatal[0]
    return elapsed, errors


def owners(redis_url: str, keys: Keys, clients: list[TrainingClient]) -> dict[str, int]:
    """How many of the models each worker holds the lease on."""
    client = redis.Redis.from_url(redis_url)
    try:
        counts: dict[str, int] = {}
        for tc in clients:
            lease = client.get(keys.model_lease(tc.model_id))
            owner = lease.decode().split("|")[0] if lease else "(none)"
            counts[owner] = counts.get(owner, 0) + 1
        return counts
    finally:
        client.close()


def run_throughput(args: argparse.Namespace, database_url: str, log_dir: Path, workers: int
                   ) -> Throughput:
    with fresh_prefix(args.redis_url, f"tput{workers}") as prefix:
        settings = make_settings(args.redis_url, database_url, prefix, log_dir / "data")
        with running_workers(settings, workers, log_dir, f"tput{workers}"):
            service = ServiceClient(settings)
            try:
                keys = Keys(prefix)
                clients = [service.create_lora_training_client("tiny")
                           for _ in range(args.models)]
                warm = min(args.tput_ops // 10, 1_000)
                asyncio.run(pump(clients, warm, args.window))
                seconds, errors = asyncio.run(pump(clients, args.tput_ops, args.window))
                backlog = redis.Redis.from_url(args.redis_url)
                try:
                    record_backlog = int(backlog.xlen(keys.records()))
                finally:
                    backlog.close()
                return Throughput(args.tput_ops, seconds, {
                    "models": args.models, "window": args.window,
                    "models_per_worker": sorted(owners(args.redis_url, keys, clients).values()),
                    "record_backlog_at_end": record_backlog,
                    "errors": errors,
                })
            finally:
                close_client(service)


# --- part 3: the rq baseline -------------------------------------------------------------------
def rq_proc(redis_url: str, queue: str, log_path: Path, *, burst: bool) -> Proc:
    argv = [sys.executable, "-m", "bench.rq_worker", "--redis-url", redis_url, "--queue", queue]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return Proc([*argv, "--burst"] if burst else argv, env, log_path)


def wait_for_rq_worker(conn: redis.Redis, queue: Any, timeout: float = 30) -> None:
    from rq import Worker

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Worker.count(queue=queue) >= 1:
            return
        time.sleep(0.02)
    raise TimeoutError("the rq worker did not register")


def rq_cleanup(redis_url: str, queue_name: str, job_ids: list[str]) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start : start + 500]
            client.delete(*[f"rq:job:{j}" for j in chunk], *[f"rq:results:{j}" for j in chunk])
        client.srem("rq:queues", f"rq:queue:{queue_name}")
    finally:
        client.close()
    delete_matching(redis_url, f"rq:*{queue_name}*")


@dataclass
class RqResult:
    latency: Latency
    throughput: Throughput
    enqueue_s: float


def run_rq(args: argparse.Namespace, log_dir: Path) -> RqResult:
    from rq import Queue
    from rq.results import Result

    from bench.rq_worker import echo

    conn = redis.Redis.from_url(args.redis_url)
    name = f"qt-bench-rq-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, connection=conn)
    job_ids: list[str] = []
    try:
        # Latency: a long-running SimpleWorker; each job waited for with a blocking read.
        proc = rq_proc(args.redis_url, name, log_dir / "rq-latency.log", burst=False)
        try:
            wait_for_rq_worker(conn, queue)
            samples: list[float] = []
            for i in range(args.warmup + args.rq_ops):
                t0 = time.perf_counter()
                job = queue.enqueue(echo, i)
                result = job.latest_result(timeout=30)
                t1 = time.perf_counter()
                job_ids.append(job.id)
                if result is None or result.type != Result.Type.SUCCESSFUL or \
                        result.return_value != i:
                    raise AssertionError(f"rq job {i}: {result!r}")
                if i >= args.warmup:
                    samples.append(t1 - t0)
        finally:
            code = proc.stop()
            if code != 0:
                print(f"warning: rq worker exited with {code}:\n{proc.log()[-2000:]}",
                      file=sys.stderr)

        # Throughput: enqueue everything (pipelined), then one burst worker drains the queue.
        t0 = time.perf_counter()
        jobs = queue.enqueue_many(
            [Queue.prepare_data(echo, args=(i,)) for i in range(args.rq_tput_ops)])
        enqueue_s = time.perf_counter() - t0
        job_ids.extend(job.id for job in jobs)
        out = subprocess.run(
            [sys.executable, "-m", "bench.rq_worker", "--redis-url", args.redis_url,
             "--queue", name, "--burst"],
            cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
        report = json.loads(out.stdout.strip().splitlines()[-1])
        finished = queue.finished_job_registry.count
        if len(queue) != 0 or finished != len(job_ids):
            raise AssertionError(f"rq: {len(queue)} jobs left, {finished} of {len(job_ids)} "
                                 f"finished; burst worker: {report}")
        seconds = report["end"] - report["start"]
        return RqResult(Latency(samples), Throughput(args.rq_tput_ops, seconds), enqueue_s)
    finally:
        conn.close()
        rq_cleanup(args.redis_url, name, job_ids)


# --- the machine -------------------------------------------------------------------------------
def machine(redis_url: str, postgres_url: str) -> dict[str, str]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        if match:
            cpu = match.group(1).strip()
    ram = "unknown"
    with contextlib.suppress(OSError):
        match = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        if match:
            ram = f"{int(match.group(1)) / 1024 / 1024:.1f} GiB"
    client = redis.Redis.from_url(redis_url)
    try:
        redis_version = str(client.info("server")["redis_version"])
    finally:
        client.close()
    commit = "unknown"
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.strip()
    import rq

    return {
        "CPU": cpu,
        "cores": str(os.cpu_count()),
        "RAM": ram,
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "Redis": redis_version,
        "Postgres": postgres_version(postgres_url),
        "rq": rq.__version__,
        "redis-py": redis.__version__,
        "commit": commit,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def postgres_version(url: str) -> str:
    from sqlalchemy import text

    from queue_tinker.store.db import make_engine

    async def ask() -> str:
        engine = make_engine(url)
        try:
            async with engine.connect() as conn:
                return str((await conn.execute(text("SHOW server_version"))).scalar())
        finally:
            await engine.dispose()

    try:
        return asyncio.run(ask())
    except Exception as exc:
        return f"unknown ({type(exc).__name__})"


# --- report ------------------------------------------------------------------------------------
def errors_text(errors: dict[str, int]) -> str:
    if not errors:
        return "no op failed"
    return "**ops failed: " + ", ".join(f"{n:,} × `{name}`" for name, n in errors.items()) + "**"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def render(args: argparse.Namespace, info: dict[str, str], lat: dict[str, LatencyResult],
           tput: dict[int, Throughput], rq_result: RqResult | None, total_s: float) -> str:
    lines: list[str] = []
    add = lines.append
    add(SECTION)
    add("")
    add("What one trivial op costs when it goes through the queue, and how many per second it "
        "moves. The op is `TrainingClient.ping` (the worker decodes the payload and returns it: "
        "no model work), so everything measured is queue overhead: client, Redis scripts, "
        "worker dispatch, publish, wake-up, and the Postgres write-behind running beside it. "
        "Everything is real: the local Redis and Postgres, worker processes started as "
        "`python -m queue_tinker.cli worker --base-model tiny --device cpu` with production "
        "defaults (lease/heartbeat/linger), a scratch database migrated for the run, a fresh "
        "Redis key prefix per part.")
    add("")
    add("Reproduce (from the repository root, with Redis on 127.0.0.1:6379 and Postgres on "
        "127.0.0.1:5432; `--redis-url` / `--postgres-url` point elsewhere, `--help` lists the "
        "knobs, `--quick` is a smoke run that leaves this file alone):")
    add("")
    add("```")
    add(COMMAND)
    add("```")
    add("")
    add("Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + ".")
    add(f"The run took {total_s:.0f} s. Client, worker(s), Redis and Postgres all share this "
        "machine's cores.")
    add("")
    add("### Targets")
    add("")
    sync = lat["sync"].latency
    async_ = lat["async"].latency
    one = tput.get(1)
    add("| target | sync API | async API | verdict |")
    add("| --- | --- | --- | --- |")
    add(f"| p50 round trip ≤ {TARGET_P50_MS:g} ms | {sync.p50:.2f} ms | {async_.p50:.2f} ms | "
        f"sync {verdict(sync.p50 <= TARGET_P50_MS)}, async "
        f"{verdict(async_.p50 <= TARGET_P50_MS)} |")
    add(f"| p99 round trip ≤ {TARGET_P99_MS:g} ms | {sync.p99:.2f} ms | {async_.p99:.2f} ms | "
        f"sync {verdict(sync.p99 <= TARGET_P99_MS)}, async "
        f"{verdict(async_.p99 <= TARGET_P99_MS)} |")
    if one is not None:
        add(f"| ≥ {TARGET_OPS_1W:,.0f} ops/s, one worker | {one.per_s:,.0f} ops/s (async) | | "
            f"{verdict(one.per_s >= TARGET_OPS_1W)} |")
    add("")
    add(f"### Round trip, one worker ({args.ops:,} sequential ops after {args.warmup} warm-up)")
    add("")
    add("| system | API / wait | p50 ms | p90 ms | p99 ms | max ms | mean ms |")
    add("| --- | --- | --- | --- | --- | --- | --- |")
    for label, key in (("`client.ping(i).result()`", "sync"),
                       ("`await (await client.ping_async(i))`", "async")):
        s = lat[key].latency
        add(f"| queue_tinker | {label} | {s.p50:.2f} | {s.p90:.2f} | {s.p99:.2f} | "
            f"{s.max:.2f} | {s.mean:.2f} |")
    if rq_result is not None:
        s = rq_result.latency
        add(f"| rq {info['rq']} `SimpleWorker` | `q.enqueue(echo, i)` + "
            f"`job.latest_result(timeout=30)` ({len(s.samples):,} ops) | {s.p50:.2f} | "
            f"{s.p90:.2f} | {s.p99:.2f} | {s.max:.2f} | {s.mean:.2f} |")
    add("")
    add("rq waits with `Job.latest_result(timeout=...)`, which rq 3 implements as a blocking "
        "`XREAD` on the job's result stream (no polling loop). Its worker logs at WARNING, "
        "not rq's default INFO (two log lines per job), to give it its best case.")
    add("")
    add("Where one round trip goes (medians / p99 in ms; stage boundaries are the Redis-clock "
        "timestamps the Lua scripts write into the job hash — `queued_at`, `started_at`, "
        "`finished_at` — and the client's wall clock on the same host; the first row overlaps "
        "the others, which add up to the total). An op the engine runs inline (a ping) is "
        "marked started and finished by the one publish script, so its `started_at -> "
        "finished_at` is 0 and `queued_at -> started_at` covers pick-up, execution and the "
        "publish script:")
    add("")
    add("| stage | sync p50 | sync p99 | async p50 | async p99 |")
    add("| --- | --- | --- | --- | --- |")
    sm, sp = lat["sync"].stages.medians_ms(), lat["sync"].stages.p99s_ms()
    am, ap = lat["async"].stages.medians_ms(), lat["async"].stages.p99s_ms()
    for name in Stages().names:
        add(f"| {name} | {sm.get(name, 0):.3f} | {sp.get(name, 0):.3f} | "
            f"{am.get(name, 0):.3f} | {ap.get(name, 0):.3f} |")
    add("")
    add("### Throughput")
    add("")
    add("| system | workers | ops | in flight | ops/s | notes |")
    add("| --- | --- | --- | --- | --- | --- |")
    for workers, t in sorted(tput.items()):
        add(f"| queue_tinker (async API) | {workers} | {t.ops:,} over {t.extra['models']} models "
            f"| {t.extra['window']:,} | {t.per_s:,.0f} | models per worker "
            f"{t.extra['models_per_worker']}; records not yet in Postgres at the end: "
            f"{t.extra['record_backlog_at_end']:,}; {errors_text(t.extra['errors'])} |")
    if rq_result is not None:
        t = rq_result.throughput
        add(f"| rq {info['rq']} `SimpleWorker` | 1 | {t.ops:,} | all queued up front | "
            f"{t.per_s:,.0f} | `work(burst=True)` timed inside the worker process; enqueueing "
            f"them (`enqueue_many`, pipelined) took {rq_result.enqueue_s:.2f} s, not counted |")
    add("")
    add("queue_tinker's throughput is client-inclusive: the clock runs from the first submit "
        "to the last result seen by the client, with a bounded window of in-flight futures "
        "(asyncio semaphore), after a warm-up that lets the worker(s) claim every model. "
        "rq's is worker-only (the queue is full before its clock starts).")
    add("")
    return "\n".join(lines)


def write_docs(path: Path, section: str) -> None:
    """Replace the `## Queue overhead` section (or append it), leaving other sections alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = text.find(SECTION + "\n")
    if start < 0:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        new = text[:start] + section + ("\n" + text[end + 1 :] if end >= 0 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new.rstrip("\n") + "\n")


def print_table(lat: dict[str, LatencyResult], tput: dict[int, Throughput],
                rq_result: RqResult | None) -> None:
    print()
    print(f"{'round trip (ms)':<44}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>9}{'n':>7}")
    rows: list[tuple[str, Latency]] = [
        ("queue_tinker sync  ping(i).result()", lat["sync"].latency),
        ("queue_tinker async await ping_async(i)", lat["async"].latency),
    ]
    if rq_result is not None:
        rows.append(("rq SimpleWorker enqueue+latest_result", rq_result.latency))
    for label, s in rows:
        print(f"{label:<44}{s.p50:>8.2f}{s.p90:>8.2f}{s.p99:>8.2f}{s.max:>9.2f}"
              f"{len(s.samples):>7}")
    print()
    print(f"{'stage p50 (ms)':<50}{'sync':>8}{'async':>8}")
    sm, am = lat["sync"].stages.medians_ms(), lat["async"].stages.medians_ms()
    for name in Stages().names:
        print(f"{name:<50}{sm.get(name, 0):>8.3f}{am.get(name, 0):>8.3f}")
    print()
    print(f"{'throughput':<44}{'ops':>8}{'sec':>8}{'ops/s':>9}")
    for workers, t in sorted(tput.items()):
        print(f"{f'queue_tinker {workers} worker(s), async':<44}{t.ops:>8}{t.seconds:>8.2f}"
              f"{t.per_s:>9.0f}  {t.extra}")
    if rq_result is not None:
        t = rq_result.throughput
        print(f"{'rq SimpleWorker 1 worker, burst':<44}{t.ops:>8}{t.seconds:>8.2f}{t.per_s:>9.0f}")
    print()
    one = tput.get(1)
    print(f"target p50 <= {TARGET_P50_MS:g} ms: sync {lat['sync'].latency.p50:.2f}, "
          f"async {lat['async'].latency.p50:.2f}")
    print(f"target p99 <= {TARGET_P99_MS:g} ms: sync {lat['sync'].latency.p99:.2f}, "
          f"async {lat['async'].latency.p99:.2f}")
    if one is not None:
        print(f"target >= {TARGET_OPS_1W:,.0f} ops/s (1 worker): {one.per_s:,.0f}")


# --- main --------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.queue_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=os.environ.get("QT_BENCH_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument("--postgres-url", default=os.environ.get("QT_BENCH_DATABASE_URL",
                                                                 DEFAULT_POSTGRES),
                        help="admin URL; a scratch database is created beside it")
    parser.add_argument("--ops", type=int, default=5_000, help="sequential ops per latency run")
    parser.add_argument("--warmup", type=int, default=200, help="ops before measuring latency")
    parser.add_argument("--tput-ops", type=int, default=20_000, help="ops per throughput run")
    parser.add_argument("--models", type=int, default=8, help="models the throughput ops use")
    parser.add_argument("--window", type=int, default=2_000, help="throughput: ops in flight")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="worker counts to measure throughput with")
    parser.add_argument("--rq-ops", type=int, default=2_000, help="rq sequential jobs")
    parser.add_argument("--rq-tput-ops", type=int, default=10_000, help="rq throughput jobs")
    parser.add_argument("--no-rq", action="store_true", help="skip the rq baseline")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where to write the results")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md alone")
    parser.add_argument("--json", type=Path, default=None, help="also write raw results here")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: few ops everywhere, docs left alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.ops, args.warmup, args.tput_ops, args.window = 300, 50, 2_000, 500
        args.rq_ops, args.rq_tput_ops, args.no_docs = 200, 500, True
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    info = machine(args.redis_url, args.postgres_url)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="qt-bench-") as tmp:
        log_dir = Path(tmp)
        with scratch_database(args.postgres_url) as database_url:
            print(f"[1] round trip, 1 worker: {args.ops} sync + {args.ops} async pings ...",
                  flush=True)
            lat = run_latency(args, database_url, log_dir)
            tput: dict[int, Throughput] = {}
            for workers in args.workers:
                print(f"[2] throughput, {workers} worker(s): {args.tput_ops} pings, "
                      f"{args.models} models, {args.window} in flight ...", flush=True)
                tput[workers] = run_throughput(args, database_url, log_dir, workers)
                print(f"    {tput[workers].per_s:,.0f} ops/s", flush=True)
        rq_result = None
        if not args.no_rq:
            print(f"[3] rq SimpleWorker: {args.rq_ops} sequential jobs, "
                  f"{args.rq_tput_ops} burst ...", flush=True)
            rq_result = run_rq(args, log_dir)
    total_s = time.perf_counter() - began
    print_table(lat, tput, rq_result)
    print(f"\ntotal {total_s:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "machine": info,
            "latency": {k: {"round_trip": v.latency.summary(), "enqueue": v.enqueue.summary(),
                            "stages_p50_ms": v.stages.medians_ms(),
                            "stages_p99_ms": v.stages.p99s_ms()} for k, v in lat.items()},
            "throughput": {str(k): {"ops": t.ops, "seconds": t.seconds, "ops_per_s": t.per_s,
                                    **t.extra} for k, t in tput.items()},
            "rq": None if rq_result is None else {
                "round_trip": rq_result.latency.summary(),
                "throughput_ops_per_s": rq_result.throughput.per_s,
                "enqueue_many_s": rq_result.enqueue_s},
        }, indent=2))
    if not args.no_docs:
        write_docs(args.docs, render(args, info, lat, tput, rq_result, total_s))
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
