"""The machine a benchmark ran on, as its report prints it: CPU, cores, RAM, OS, the services'
and packages' versions, the GPU, the commit and the date.

`machine` describes a run against Redis and Postgres; `engine_machine` one that needs neither
(the engine alone, in the benchmark's process, such as on a lent GPU machine).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import redis

from bench.harness.services import REPO, postgres_version, redis_version


def machine(redis_url: str, postgres_url: str, packages: Sequence[str] = ()) -> dict[str, str]:
    """Hardware and software versions, in the order the docs print them; `packages` are
    Python packages whose `__version__` to add after Postgres."""
    ram_kb = _proc_field("/proc/meminfo", r"^MemTotal:\s*(\d+) kB")
    return {
        "CPU": _proc_field("/proc/cpuinfo", CPU_MODEL) or "unknown",
        "cores": str(os.cpu_count()),
        "RAM": f"{int(ram_kb) / 1024 / 1024:.1f} GiB" if ram_kb else "unknown",
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "Redis": redis_version(redis_url),
        "Postgres": postgres_version(postgres_url),
        **{name: str(importlib.import_module(name).__version__) for name in packages},
        "redis-py": redis.__version__,
        "commit": commit(),
        "date": now(),
    }


def engine_machine(device: str) -> dict[str, str]:
    """The device and the versions the engine's results depend on; no services."""
    import peft
    import torch
    import transformers

    info = {
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "Python": platform.python_version(),
        "date": now(),
    }
    if device.startswith("cuda"):
        info["CUDA"] = str(torch.version.cuda)
    return info


def cpu_machine() -> dict[str, str]:
    """A CPU-only run's machine line: the CPU and its cores, the engine's versions, the
    commit."""
    return {
        "CPU": cpu_model(),
        "cores": str(os.cpu_count()),
        **engine_machine("cpu"),
        "commit": commit(),
    }


def described(info: dict[str, str]) -> str:
    """`info` on one line, as every report's machine line has it."""
    return ", ".join(f"{k} {v}" for k, v in info.items())


def announce(info: dict[str, str]) -> dict[str, str]:
    """Print the machine line at the start of a run; `info`, for the report."""
    print("machine: " + described(info), flush=True)
    return info


# --- its parts ---------------------------------------------------------------------------------
CPU_MODEL = r"^model name\s*:\s*(.+)$"


def cpu_model() -> str:
    return _proc_field("/proc/cpuinfo", CPU_MODEL) or "unknown CPU"


def device_name(device: str) -> str:
    """The CUDA device's name, or "CPU"."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return "CPU"


def gpu_name() -> str:
    """Every CUDA device's name, or "none"."""
    import torch

    if not torch.cuda.is_available():
        return "none"
    return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def commit() -> str:
    """What the run measured: BENCH_COMMIT where the caller names it (a copied tree whose git
    metadata is not its own: scripts/gpu_checks on a lent machine), else the repository's
    short HEAD, marked "+changes" where tracked files differ from it; "unknown" without git."""
    named = os.environ.get("BENCH_COMMIT")
    if named:
        return named
    with contextlib.suppress(Exception):
        head = _git("rev-parse", "--short", "HEAD")
        changed = _git("status", "--porcelain", "--untracked-files=no")
        return f"{head}+changes" if changed else head
    return "unknown"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _proc_field(path: str, pattern: str) -> str | None:
    """The first group of `pattern` in a /proc file, or None."""
    with contextlib.suppress(OSError):
        match = re.search(pattern, Path(path).read_text(), re.M)
        if match:
            return match.group(1).strip()
    return None
