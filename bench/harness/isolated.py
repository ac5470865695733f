"""One case of an in-process benchmark in a process of its own, so that the process's peak
memory (ru_maxrss) is the case's alone: the benchmark runs itself with its case's arguments,
and the case prints its result as the last line of its output, in JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def run_isolated(module: str, args: Sequence[str]) -> dict[str, Any] | None:
    """`python -m <module> <args>` in a fresh process: the result it printed, or None when it
    failed (out of memory; the tail of its stderr is printed)."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def print_result(result: DataclassInstance) -> None:
    """The case's side: its result, for run_isolated to read."""
    print(json.dumps(asdict(result)))
