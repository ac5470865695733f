"""`queue-tinker up`: the whole service on one machine, nothing to install but Python.

Starts an embedded Redis and Postgres (unless QT_REDIS_URL / QT_DATABASE_URL point elsewhere),
applies the migrations, then runs the gateway, N workers and the housekeeper (checkpoint expiry)
as child processes and supervises them in the foreground. Ctrl-C (or SIGTERM) stops the
children, then the embedded servers.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from types import FrameType

from queue_tinker.errors import EmbeddedServerError
from queue_tinker.local.embedded import EmbeddedPostgres, EmbeddedRedis
from queue_tinker.local.processes import Child, ProcessGroup
from queue_tinker.settings import Settings, settings_env, write_up_file

CHILD_STOP_TIMEOUT_S = 15.0  # a worker finishes its current op, publishes, releases its leases
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
WORKER_PREFIX = "worker-"  # the children named so are workers


class _Signals:
    """Turns SIGINT/SIGTERM/SIGCHLD into bytes on a pipe, so the supervisor can block on one fd
    (no polling) and still notice both a Ctrl-C and a child that died."""

    def __init__(self) -> None:
        self.stop_requested: int | None = None
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum in _STOP_SIGNALS and self.stop_requested is None:
            self.stop_requested = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Signals]:
        old_fd = signal.set_wakeup_fd(self._write)
        watched = (*_STOP_SIGNALS, signal.SIGCHLD)
        old = {sig: signal.signal(sig, self._on_signal) for sig in watched}
        try:
            yield self
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(old_fd)
            os.close(self._read)
            os.close(self._write)

    def wait(self) -> None:
        """Block until some watched signal arrives."""
        select.select([self._read], [], [])
        os.read(self._read, 512)


def child_env(settings: Settings) -> dict[str, str]:
    """This environment plus every effective setting as QT_*, so children see what we see."""
    return settings_env(settings, os.environ)


def start_backends(settings: Settings, stack: ExitStack) -> Settings:
    """Embedded Redis/Postgres where no URL is set, then migrations; settings with real URLs."""
    data_dir = settings.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    redis_url, database_url = settings.redis_url, settings.database_url
    if redis_url is None:
        redis_url = stack.enter_context(EmbeddedRedis(data_dir / "redis"))
    if database_url is None:
        database_url = stack.enter_context(EmbeddedPostgres(data_dir / "postgres"))
    from queue_tinker.store.migrate import upgrade

    upgrade(database_url)
    return settings.model_copy(
        update={"redis_url": redis_url, "database_url": database_url, "data_dir": data_dir}
    )


def _banner(settings: Settings, workers: int, base_model: str, device: str) -> str:
    return "\n".join(
        [
            "queue-tinker is up",
            f"  gateway   http://{settings.gateway_host}:{settings.gateway_port}",
            f"  redis     {settings.redis_url}",
            f"  postgres  {settings.database_url}",
            f"  workers   {workers} x {base_model} on {device}",
            f"  data      {settings.data_dir}",
            "Other shells on this data directory find it with nothing set (or: eval "
            '"$(queue-tinker up --env)").',
            f"Stop with Ctrl-C (or `kill {os.getpid()}`).",
        ]
    )


def crashed_child(group: ProcessGroup) -> Child | None:
    """The first child whose exit should stop the stack, if any. A worker that exits 0 was
    told to stop (drained from the dashboard, or a SIGTERM of its own): it is let go and the
    rest keep running. Any other exit (the gateway's or the housekeeper's, or a worker's with
    an error) is a crash."""
    while (dead := group.first_exited()) is not None:
        if not (dead.name.startswith(WORKER_PREFIX) and dead.proc.returncode == 0):
            return dead
        print(
            f"queue-tinker: {dead.name} (pid {dead.pid}) stopped (drained); the rest keep running",
            file=sys.stderr,
        )
        group.forget(dead)
    return None


def _supervise(group: ProcessGroup, signals: _Signals) -> int:
    """Wait until a stop signal (exit 0) or a child crashes (exit 1)."""
    while True:
        if signals.stop_requested is not None:
            print(
                f"\nqueue-tinker: {signal.Signals(signals.stop_requested).name}, stopping...",
                file=sys.stderr,
            )
            return 0
        dead = crashed_child(group)
        if dead is not None:
            print(
                f"queue-tinker: {dead.name} (pid {dead.pid}) exited unexpectedly with code "
                f"{dead.proc.returncode}; stopping everything",
                file=sys.stderr,
            )
            return 1
        signals.wait()


def run_up(settings: Settings, base_model: str, device: str, workers: int) -> int:
    """Run the embedded stack in the foreground until Ctrl-C; the exit code of `up`."""
    if workers < 0:
        print(f"queue-tinker up: --workers must be >= 0, got {workers}", file=sys.stderr)
        return 2
    signals = _Signals()
    with signals.installed(), ExitStack() as stack:
        try:
            settings = start_backends(settings, stack)
        except EmbeddedServerError as err:
            print(f"queue-tinker up: {err}", file=sys.stderr)
            return 1
        if signals.stop_requested is not None:  # Ctrl-C while the databases were starting
            return 0
        # Clients and the CLI in another shell, with nothing set, find this deployment here.
        stack.callback(write_up_file(settings).unlink, missing_ok=True)
        env = child_env(settings)
        group = ProcessGroup()
        stack.callback(stop_children, group)
        cli = [sys.executable, "-m", "queue_tinker.cli"]
        group.start("gateway", [*cli, "serve"], env)
        group.start("housekeeper", [*cli, "housekeeper"], env)
        for i in range(workers):
            argv = [*cli, "worker", "--base-model", base_model, "--device", device]
            group.start(f"{WORKER_PREFIX}{i}", argv, env)
        print(_banner(settings, workers, base_model, device), file=sys.stderr, flush=True)
        return _supervise(group, signals)


def stop_children(group: ProcessGroup) -> None:
    killed = group.stop_all(timeout=CHILD_STOP_TIMEOUT_S)
    if killed:
        print(
            f"queue-tinker: killed {', '.join(killed)} after {CHILD_STOP_TIMEOUT_S:.0f} s",
            file=sys.stderr,
        )
