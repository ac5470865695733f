"""What the benchmarks measure, as plain data: latency samples, round-trip stages, throughput."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Latency:
    """Round-trip samples in seconds, summarised in milliseconds."""

    samples: list[float]

    def pct(self, q: float) -> float:
        """The q-th percentile, in milliseconds."""
        return float(np.percentile(np.asarray(self.samples), q)) * 1000

    @property
    def p50(self) -> float:
        return self.pct(50)

    @property
    def p90(self) -> float:
        return self.pct(90)

    @property
    def p99(self) -> float:
        return self.pct(99)

    @property
    def max(self) -> float:
        return max(self.samples) * 1000

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples)) * 1000

    def summary(self) -> dict[str, float]:
        """Count and percentiles, for the JSON output."""
        return {
            "n": len(self.samples),
            "p50_ms": self.p50,
            "p90_ms": self.p90,
            "p99_ms": self.p99,
            "max_ms": self.max,
            "mean_ms": self.mean,
        }


STAGE_NAMES: tuple[str, ...] = (
    "submit call returns (client holds the future)",
    "submit -> queued_at (client -> enqueue script)",
    "queued_at -> started_at (worker pick-up)",
    "started_at -> finished_at (execute, publish)",
    "finished_at -> result in the client's hand",
)


@dataclass
class Stages:
    """Per-op durations (seconds) of the stages of one round trip, from the job's timestamps."""

    names: tuple[str, ...] = STAGE_NAMES
    rows: list[tuple[float, ...]] = field(default_factory=list)

    def medians_ms(self) -> dict[str, float]:
        """Median of each stage, in milliseconds (empty when no row was recorded)."""
        return self._each_ms(np.median)

    def p99s_ms(self) -> dict[str, float]:
        """99th percentile of each stage, in milliseconds (empty when no row was recorded)."""
        return self._each_ms(lambda col: np.percentile(col, 99))

    def _each_ms(self, stat: Callable[[np.ndarray], Any]) -> dict[str, float]:
        if not self.rows:
            return {}
        columns = np.asarray(self.rows).T * 1000
        return {name: float(stat(col)) for name, col in zip(self.names, columns, strict=True)}


@dataclass
class Sample:
    """One sequential op as the client saw it (wall clock, so it lines up with Redis TIME)."""

    job_id: str
    submitted: float  # time.time() just before the call
    enqueued_s: float  # how long the submit call took
    total_s: float  # submit -> result in hand


@dataclass
class LatencyResult:
    """One latency run: the round trips, the submit calls alone, and the stage split."""

    latency: Latency
    enqueue: Latency
    stages: Stages


@dataclass
class Throughput:
    """`ops` completed in `seconds`, with whatever else the run wants to report in `extra`."""

    ops: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0
