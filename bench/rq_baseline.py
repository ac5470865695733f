"""The rq baseline: the same trivial op through rq, against the same Redis.

An rq `SimpleWorker` (no fork, its own process: bench/rq_worker.py) runs `echo`. Measured:
sequential round-trip latency (enqueue, then `job.latest_result(timeout=)`, which blocks on
rq's result stream with XREAD) and throughput (jobs enqueued up front, then
`SimpleWorker.work(burst=True)` in a separate process, timed inside that process). Each run
uses a fresh queue name and deletes its keys afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.harness.services import REPO, delete_matching
from bench.harness.stats import Latency, Throughput
from bench.harness.workers import Proc


@dataclass
class RqResult:
    """rq's round trips, its burst throughput, and how long enqueueing that burst took."""

    latency: Latency
    throughput: Throughput
    enqueue_s: float


def rq_argv(redis_url: str, queue: str, *, burst: bool) -> list[str]:
    """The command line of one bench/rq_worker process."""
    argv = [sys.executable, "-m", "bench.rq_worker", "--redis-url", redis_url, "--queue", queue]
    return [*argv, "--burst"] if burst else argv


def wait_for_rq_worker(queue: Any, timeout: float = 30) -> None:
    """Block until an rq worker listens on `queue`."""
    from rq import Worker

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Worker.count(queue=queue) >= 1:
            return
        time.sleep(0.02)
    raise TimeoutError("the rq worker did not register")


def rq_cleanup(redis_url: str, queue_name: str, job_ids: list[str]) -> None:
    """Delete the jobs, their results and every key naming the queue."""
    with redis.Redis.from_url(redis_url) as client:
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start : start + 500]
            client.delete(*[f"rq:job:{j}" for j in chunk], *[f"rq:results:{j}" for j in chunk])
        client.srem("rq:queues", f"rq:queue:{queue_name}")
    delete_matching(redis_url, f"rq:*{queue_name}*")


def rq_latency(
    redis_url: str, queue: Any, log_path: Path, warmup: int, ops: int, job_ids: list[str]
) -> list[float]:
    """Sequential round trips through a long-running SimpleWorker, each job waited for with
    a blocking read; the seconds of the `ops` after `warmup`. Job ids go into `job_ids`."""
    from rq.results import Result

    from bench.rq_worker import echo

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = Proc(rq_argv(redis_url, queue.name, burst=False), env, log_path)
    try:
        wait_for_rq_worker(queue)
        samples: list[float] = []
        for i in range(warmup + ops):
            t0 = time.perf_counter()
            job = queue.enqueue(echo, i)
            result = job.latest_result(timeout=30)
            t1 = time.perf_counter()
            job_ids.append(job.id)
            if result is None or result.type != Result.Type.SUCCESSFUL or result.return_value != i:
                raise AssertionError(f"rq job {i}: {result!r}")
            if i >= warmup:
                samples.append(t1 - t0)
        return samples
    finally:
        proc.stop_and_report("rq worker")


def rq_burst(redis_url: str, queue: Any, ops: int, job_ids: list[str]) -> tuple[Throughput, float]:
    """Enqueue `ops` jobs (pipelined), then one burst worker drains the queue; its throughput
    timed inside the worker process, and the seconds the enqueueing took."""
    from rq import Queue

    from bench.rq_worker import echo

    t0 = time.perf_counter()
    jobs = queue.enqueue_many([Queue.prepare_data(echo, args=(i,)) for i in range(ops)])
    enqueue_s = time.perf_counter() - t0
    job_ids.extend(job.id for job in jobs)
    argv = rq_argv(redis_url, queue.name, burst=True)
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    finished = queue.finished_job_registry.count
    if len(queue) != 0 or finished != len(job_ids):
        raise AssertionError(
            f"rq: {len(queue)} jobs left, {finished} of {len(job_ids)} "
            f"finished; burst worker: {report}"
        )
    return Throughput(ops, report["end"] - report["start"]), enqueue_s


def run_rq(redis_url: str, log_dir: Path, *, warmup: int, ops: int, tput_ops: int) -> RqResult:
    """The whole baseline on a fresh queue, cleaned up afterwards."""
    from rq import Queue

    conn = redis.Redis.from_url(redis_url)
    name = f"qt-bench-rq-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, connection=conn)
    job_ids: list[str] = []
    try:
        samples = rq_latency(redis_url, queue, log_dir / "rq-latency.log", warmup, ops, job_ids)
        throughput, enqueue_s = rq_burst(redis_url, queue, tput_ops, job_ids)
        return RqResult(Latency(samples), throughput, enqueue_s)
    finally:
        conn.close()
        rq_cleanup(redis_url, name, job_ids)
