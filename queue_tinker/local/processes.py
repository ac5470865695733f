"""Child processes we own: started in their own session, stopped with SIGTERM then SIGKILL.

Every long-running child of `queue-tinker up` (redis-server, gateway, workers) is started here so
that Ctrl-C in the terminal reaches only the supervisor, which then stops the children in order.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A preexec hook asking Linux to SIGTERM the child when we die, so a `kill -9` of the
    supervisor leaves no orphans. PDEATHSIG fires when the *thread* that forked exits, so it is
    only safe from the main thread, which lives as long as the process."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    if not sys.platform.startswith("linux") or not on_main_thread:
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: nothing to import in the child
    prctl = libc.prctl

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return hook


def spawn(
    argv: Sequence[str | Path],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdout: IO[bytes] | int | None = None,
    stderr: IO[bytes] | int | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` in a new session (no terminal signals) that dies with its parent."""
    return subprocess.Popen(
        [str(a) for a in argv],
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=die_with_parent(),  # runs only prctl in the child: fork-safe
    )


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> bool:
    """SIGTERM, wait up to `timeout` s, then SIGKILL. True if it stopped without SIGKILL."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


@dataclass
class Child:
    """One named child process."""

    name: str
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class ProcessGroup:
    """Children started together and stopped together (SIGTERM to all, one shared deadline)."""

    children: list[Child] = field(default_factory=list)

    def start(
        self, name: str, argv: Sequence[str | Path], env: Mapping[str, str] | None = None
    ) -> Child:
        child = Child(name, spawn(argv, env=env))
        self.children.append(child)
        return child

    def first_exited(self) -> Child | None:
        """The first child that has exited, if any (reaps it)."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def forget(self, child: Child) -> None:
        """Stop supervising a child that has exited."""
        self.children.remove(child)

    def stop_all(self, timeout: float = 10.0) -> list[str]:
        """Stop every child; return the names of those that needed SIGKILL."""
        running = [c for c in self.children if c.proc.poll() is None]
        for child in running:
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        killed = []
        for child in running:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
                killed.append(child.name)
        return killed

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()


def pid_alive(pid: int) -> bool:
    """True if `pid` is a live process (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
