"""A LoRA worker for a benchmark, and what it tells about its work: the worker process itself
(`lora_worker`), the torch thread counts it computes with (`worker_threads`), and the Redis-clock
queued / started / finished times it writes into each job's hash (`job_times`).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from bench.harness import Proc, child_env, wait_for_workers
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings


def worker_threads(settings: Settings) -> dict[str, int]:
    """torch's thread count in a process with the worker's environment: on its main thread
    and on a pool thread like its compute thread."""
    code = ("import torch, concurrent.futures as cf; "
            "pool = cf.ThreadPoolExecutor(1); "
            "print(torch.get_num_threads(), pool.submit(torch.get_num_threads).result())")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(settings),
                         capture_output=True, text=True, check=True).stdout.split()
    return {"worker main": int(out[0]), "worker compute thread": int(out[1])}


@contextmanager
def lora_worker(settings: Settings, model: str, log_path: Path) -> Iterator[Proc]:
    """One LoRA worker serving `model` on the CPU, registered (model loaded) before the body."""
    proc = Proc([sys.executable, "-m", "queue_tinker.cli", "worker", "--base-model", model,
                 "--device", "cpu", "--engine", "lora"], child_env(settings), log_path)
    try:
        wait_for_workers(settings, 1, timeout=600)
        yield proc
    finally:
        proc.stop_and_report(f"worker {proc.pid}")


def job_times(redis_url: str, keys: Keys, job_ids: list[str]) -> list[tuple[float, ...] | None]:
    """(queued_at, started_at, finished_at) of each job, from its hash (Redis clock)."""
    client = redis.Redis.from_url(redis_url)
    try:
        pipe = client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), ["queued_at", "started_at", "finished_at"])
        replies = pipe.execute()
    finally:
        client.close()
    return [None if None in r else tuple(float(v) for v in r) for r in replies]
