"""The worker processes a benchmark runs against: queue-only workers (`running_workers`: pings
and create_model, the queue's own cost) and LoRA workers (`lora_worker`, `lora_workers`), each
registered before the benchmark's body runs and stopped with SIGTERM after it; and the torch
thread counts a worker computes with (`worker_threads`, `use_torch_threads`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench.harness.services import REPO, child_env
from queue_tinker.queue.connection import connect_sync
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings


class Proc:
    """A child process logging to a file, stopped with SIGTERM."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            args, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM, then SIGKILL after `timeout` seconds; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop_and_report(self, what: str) -> int:
        """Stop it; print its log's tail to stderr when it exited with an error."""
        code = self.stop()
        if code != 0:
            print(f"warning: {what} exited with {code}:\n{self.log()[-2000:]}", file=sys.stderr)
        return code


def worker_argv(base_model: str, device: str, engine: str) -> list[str]:
    """The command line of one `queue-tinker worker`."""
    return [
        sys.executable,
        "-m",
        "queue_tinker.cli",
        "worker",
        "--base-model",
        base_model,
        "--device",
        device,
        "--engine",
        engine,
    ]


def worker_proc(settings: Settings, log_path: Path) -> Proc:
    """One queue-only worker (ping and create_model: the queue's own cost) seeing `settings`."""
    return Proc(worker_argv("tiny", "cpu", "queue-only"), child_env(settings), log_path)


@contextmanager
def running_workers(
    settings: Settings, count: int, log_dir: Path, tag: str
) -> Iterator[list[Proc]]:
    """`count` queue-only workers, registered before the body runs, stopped after it."""
    procs = [worker_proc(settings, log_dir / f"{tag}-worker-{i}.log") for i in range(count)]
    try:
        wait_for_workers(settings, count)
        yield procs
    finally:
        for proc in procs:
            proc.stop_and_report(f"worker {proc.pid}")


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
            argv = worker_argv(model, device, "lora")
            procs.append(Proc(argv, {**child_env(one), **(env or {})}, log_path))
        for one in settings:
            wait_for_workers(one, 1, timeout=600)
        yield procs
    finally:
        for proc in procs:
            proc.stop_and_report(f"worker {proc.pid}")


def wait_for_workers(settings: Settings, count: int, timeout: float = 60) -> None:
    """Block until `count` workers are registered under the settings' key prefix."""
    client = connect_sync(settings.redis_url or "")  # `?replicas=` too (queue_overhead)
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


# --- torch threads -----------------------------------------------------------------------------
def use_torch_threads(threads: int) -> None:
    """`threads` torch threads in this process and in the workers it starts (they inherit
    OMP_NUM_THREADS); transformers without progress bars and warnings."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    quiet_transformers()


def quiet_transformers() -> None:
    """No download progress bars, no warnings: a benchmark's output is its numbers."""
    from transformers.utils import logging as transformers_logging

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
