"""A LoRA worker for a benchmark, and what it tells about its work: the worker process itself
(`lora_worker`; `lora_workers` starts several side by side), the torch thread counts it
computes with (`worker_threads`), and the Redis-clock queued / started / finished times it
writes into each job's hash (`job_times`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import redis

from bench.harness.services import Proc, child_env, wait_for_workers
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings


def use_torch_threads(threads: int) -> None:
    """`threads` torch threads in this process and in the workers it starts (they inherit
    OMP_NUM_THREADS); transformers without progress bars and warnings."""
    import torch
    from transformers.utils import logging as transformers_logging

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()


def worker_threads(settings: Settings) -> dict[str, int]:
    """torch's thread count in a process with the worker's environment: on its main thread
    and on a pool thread like its compute thread."""
    code = (
        "import torch, concurrent.futures as cf; "
        "pool = cf.ThreadPoolExecutor(1); "
        "print(torch.get_num_threads(), pool.submit(torch.get_num_threads).result())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(settings),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {"worker main": int(out[0]), "worker compute thread": int(out[1])}


@contextmanager
def lora_worker(
    settings: Settings,
    model: str,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    device: str = "cpu",
) -> Iterator[Proc]:
    """One LoRA worker serving `model` on `device`, registered (model loaded) before the body;
    `env` is added to the environment the settings give it."""
    with lora_workers([settings], model, [log_path], env, device) as procs:
        yield procs[0]


@contextmanager
def lora_workers(
    settings: Sequence[Settings],
    model: str,
    log_paths: Sequence[Path],
    env: Mapping[str, str] | None = None,
    device: str = "cpu",
) -> Iterator[list[Proc]]:
    """One LoRA worker per settings (one deployment each, when their key prefixes differ),
    all started before any is waited for, so they load their models side by side."""
    procs: list[Proc] = []
    try:
        for one, log_path in zip(settings, log_paths, strict=True):
            procs.append(
                Proc(
                    [
                        sys.executable,
                        "-m",
                        "queue_tinker.cli",
                        "worker",
                        "--base-model",
                        model,
                        "--device",
                        device,
                        "--engine",
                        "lora",
                    ],
                    {**child_env(one), **(env or {})},
                    log_path,
                )
            )
        for one in settings:
            wait_for_workers(one, 1, timeout=600)
        yield procs
    finally:
        for proc in procs:
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
