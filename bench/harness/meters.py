"""What a benchmark measures beside its own timings. From /proc: how much CPU the rest of the
machine takes (`CpuMeter`), the CPU time each part of the service uses (`SideCpu`: a worker's
threads, the client, Redis, Postgres), a process's CPU time and memory (`process_cpu_s`,
`status_kib`, this one's `peak_rss_bytes`) and the 1-minute load average (`load1`).
In-process: the median time of a call (`median_ms`), a call's time with the device's queued
work drained (`timed`), and the median times of calls taking turns (`turns`).
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _ticks(stat: Path) -> int:
    """utime + stime from a /proc stat file (a process: all its threads)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class CpuMeter:
    """CPU the rest of the machine uses: busy time of all cores (with steal) minus ours."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.hz = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _machine_ticks() -> int:
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return sum(ticks) - ticks[3] - ticks[4]

    def _our_ticks(self) -> int:
        return sum(_ticks(Path(f"/proc/{pid}/stat")) for pid in self.pids)

    def mark(self) -> tuple[float, int, int]:
        return time.perf_counter(), self._machine_ticks(), self._our_ticks()

    def foreign_since(self, mark: tuple[float, int, int]) -> float:
        """Cores' worth of CPU other processes used since `mark`."""
        now = self.mark()
        seconds = max(now[0] - mark[0], 1e-9)
        return max(0, (now[1] - mark[1]) - (now[2] - mark[2])) / self.hz / seconds


def find_pids(needle: bytes) -> list[int]:
    """Processes whose command line contains `needle`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


class SideCpu:
    """CPU time per service step of each part of the service: the worker's compute threads
    (its busiest `compute_threads` threads) and what runs beside them."""

    def __init__(self, worker: int, database: str, compute_threads: int) -> None:
        self.worker = worker
        self.compute_threads = compute_threads
        self.parts = {
            "client (benchmark process)": [os.getpid()],
            "Redis (whole server)": find_pids(b"redis-server"),
            "Postgres (the run's backends)": find_pids(database.encode()),
        }
        self.ticks: dict[str, int] = {}
        self.steps = 0
        self.hz = os.sysconf("SC_CLK_TCK")

    def snapshot(self) -> dict[str, int]:
        snap: dict[str, int] = {}
        for task in Path(f"/proc/{self.worker}/task").iterdir():
            with contextlib.suppress(OSError):
                snap[f"thread {task.name}"] = _ticks(task / "stat")
        for label, pids in self.parts.items():
            snap[label] = 0
            for pid in pids:
                with contextlib.suppress(OSError):
                    snap[label] += _ticks(Path(f"/proc/{pid}/stat"))
        return snap

    def add(self, before: dict[str, int], steps: int) -> None:
        for key, value in self.snapshot().items():
            self.ticks[key] = self.ticks.get(key, 0) + value - before.get(key, 0)
        self.steps += steps

    def per_step_ms(self) -> dict[str, float]:
        if not self.steps:
            return {}
        scale = 1000 / self.hz / self.steps
        threads = sorted(
            (v for k, v in self.ticks.items() if k.startswith("thread ")), reverse=True
        )
        return {
            "worker compute threads": sum(threads[: self.compute_threads]) * scale,
            "worker, other threads": sum(threads[self.compute_threads :]) * scale,
            **{label: self.ticks[label] * scale for label in self.parts},
        }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc, 10 ms ticks)."""
    return _ticks(Path(f"/proc/{pid}/stat")) / os.sysconf("SC_CLK_TCK")


def status_kib(pid: int, field: str) -> int | None:
    """A KiB field of /proc/<pid>/status (VmRSS, VmHWM), None once the process is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory (ru_maxrss, in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a host clock reads finished work."""
    if device.type == "cuda":
        import torch  # not at the top: the queue benchmarks run without it

        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call, the device drained before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def turns(
    calls: Mapping[str, Callable[[], object]],
    rounds: int,
    device: torch.device,
    warmup: int = 0,
    after: Callable[[], object] = lambda: None,
) -> dict[str, list[float]]:
    """Each call's seconds in `rounds` rounds after `warmup` more, the calls taking turns within
    a round (`timed`); `after` runs after each call, outside its time."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(warmup + rounds):
        for name, call in calls.items():
            seconds = timed(call, device)
            after()
            if i >= warmup:
                times[name].append(seconds)
    return times
