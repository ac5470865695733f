"""The tests' own judgement of a script's exit: only the SDK transport's abort after the
script's end (procs.aborted_by_the_sdk_at_exit) is told apart from a failure."""

from __future__ import annotations

import signal
import subprocess

from procs import aborted_by_the_sdk_at_exit

# faulthandler's dump of an abort from a thread Python does not know (CI, 2026-11-28).
TOKIO_ABORT = """Fatal Python error: Aborted

Thread 0x00007f97189c4b80 (most recent call first):
  <no Python frame>

Extension modules: numpy._core._multiarray_umath, zstandard.backend_c (total: 2)
"""
PYTHON_ABORT = """Fatal Python error: Aborted

Current thread 0x00007f97189c4b80 (most recent call first):
  File "/work/examples/loop.py", line 12 in main
"""


def ended(code: int, stderr: str) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["script.py"], code, "Training complete!\n", stderr)


def test_only_an_abort_from_no_python_thread_is_the_sdks() -> None:
    assert aborted_by_the_sdk_at_exit(ended(-signal.SIGABRT, TOKIO_ABORT))
    assert not aborted_by_the_sdk_at_exit(ended(-signal.SIGABRT, PYTHON_ABORT))
    assert not aborted_by_the_sdk_at_exit(ended(-signal.SIGSEGV, TOKIO_ABORT))
    assert not aborted_by_the_sdk_at_exit(ended(1, TOKIO_ABORT))
    assert not aborted_by_the_sdk_at_exit(ended(-signal.SIGABRT, "killed by the test's limit"))
