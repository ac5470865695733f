"""What every benchmark needs around its measurement: worker processes, a scratch Postgres
database, fresh Redis key prefixes, settings passed to children, bounded client close, and a
description of the machine.

This mirrors parts of tests/procs.py on purpose: tests must not import bench, and bench does
not import tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from queue_tinker.client import ServiceClient
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings, settings_env

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


# --- settings ----------------------------------------------------------------------------------
def child_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child process see `settings`."""
    return {**settings_env(settings, os.environ), "PYTHONUNBUFFERED": "1"}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a host clock reads finished work."""
    if device.type == "cuda":
        import torch  # not at the top: the queue benchmarks run without it

        torch.cuda.synchronize(device)


def make_settings(redis_url: str, database_url: str, prefix: str, data_dir: Path) -> Settings:
    """Settings for one part of a run."""
    # Production defaults for leases, heartbeats and linger: nothing tuned for the benchmark.
    return Settings(
        redis_url=redis_url, database_url=database_url, key_prefix=prefix, data_dir=data_dir
    )


# --- processes ---------------------------------------------------------------------------------
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

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit by itself; the exit code."""
        code = self.proc.wait(timeout)
        self._log.close()
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop_and_report(self, what: str) -> int:
        """Stop it; print its log's tail to stderr when it exited with an error."""
        code = self.stop()
        if code != 0:
            print(f"warning: {what} exited with {code}:\n{self.log()[-2000:]}", file=sys.stderr)
        return code


def worker_proc(settings: Settings, log_path: Path) -> Proc:
    """One queue-only worker (ping and create_model: the queue's own cost) seeing `settings`."""
    return Proc(
        [
            sys.executable,
            "-m",
            "queue_tinker.cli",
            "worker",
            "--base-model",
            "tiny",
            "--device",
            "cpu",
            "--engine",
            "queue-only",
        ],
        child_env(settings),
        log_path,
    )


@contextlib.contextmanager
def running_workers(
    settings: Settings, count: int, log_dir: Path, tag: str
) -> Iterator[list[Proc]]:
    """`count` workers, registered before the body runs, stopped after it."""
    procs = [worker_proc(settings, log_dir / f"{tag}-worker-{i}.log") for i in range(count)]
    try:
        wait_for_workers(settings, count)
        yield procs
    finally:
        for proc in procs:
            proc.stop_and_report(f"worker {proc.pid}")


def wait_for_workers(settings: Settings, count: int, timeout: float = 60) -> None:
    """Block until `count` workers are registered under the settings' key prefix."""
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


def close_client(service: ServiceClient, timeout: float = 15) -> None:
    """Close the client, but never hang the benchmark on it: a close that does not return in
    `timeout` seconds is reported and left behind (its thread is a daemon)."""
    closer = threading.Thread(target=service.close, name="qt-bench-close", daemon=True)
    closer.start()
    closer.join(timeout)
    if closer.is_alive():
        print(
            f"warning: ServiceClient.close() did not return within {timeout:g} s",
            file=sys.stderr,
            flush=True,
        )


# --- Redis and Postgres scratch space ----------------------------------------------------------
def delete_matching(redis_url: str, pattern: str) -> int:
    """Delete every key matching `pattern`; how many there were."""
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
    """A key prefix nothing else uses; its keys are deleted afterwards."""
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


# --- the machine -------------------------------------------------------------------------------
def machine(redis_url: str, postgres_url: str, packages: Sequence[str] = ()) -> dict[str, str]:
    """Hardware and software versions, in the order the docs print them; `packages` are
    Python packages whose `__version__` to add after Postgres."""
    cpu = _proc_field("/proc/cpuinfo", r"^model name\s*:\s*(.+)$")
    ram_kb = _proc_field("/proc/meminfo", r"^MemTotal:\s*(\d+) kB")
    ram = f"{int(ram_kb) / 1024 / 1024:.1f} GiB" if ram_kb != "unknown" else ram_kb
    client = redis.Redis.from_url(redis_url)
    try:
        redis_version = str(client.info("server")["redis_version"])
    finally:
        client.close()
    commit = "unknown"
    with contextlib.suppress(Exception):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return {
        "CPU": cpu,
        "cores": str(os.cpu_count()),
        "RAM": ram,
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "Redis": redis_version,
        "Postgres": postgres_version(postgres_url),
        **{name: str(importlib.import_module(name).__version__) for name in packages},
        "redis-py": redis.__version__,
        "commit": commit,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _proc_field(path: str, pattern: str) -> str:
    """The first group of `pattern` in a /proc file, or "unknown"."""
    with contextlib.suppress(OSError):
        match = re.search(pattern, Path(path).read_text(), re.M)
        if match:
            return match.group(1).strip()
    return "unknown"


def postgres_version(url: str) -> str:
    """`SHOW server_version`, or "unknown (<error>)"."""
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
