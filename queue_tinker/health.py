"""The health file (QT_HEALTH_FILE): a long-running process's sign that it serves, read by
`queue-tinker probe`.

A worker touches it each time its heartbeat reaches Redis (it is registered and talks to the
queue), the housekeeper each time it reaches Redis. A probe compares the file's age with a
bound, so an orchestrator's exec probe tells a serving process from one that is stopped,
wedged or cut off from Redis without speaking Redis itself. The file's modification time is
the whole message: touching it is one system call, and nothing reads its contents.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Heartbeats a probe lets pass before the process counts as not serving: one late beat (a
# slow Redis reply, a GC pause) is no failure, three are.
BEATS_PER_BOUND = 3
# Below this a bound would fail a healthy process on scheduling noise alone.
MIN_BOUND_S = 5.0


def default_max_age_s(heartbeat_ms: int) -> float:
    """The probe's bound when none is given: BEATS_PER_BOUND heartbeats, MIN_BOUND_S at least
    (6 s at the default QT_HEARTBEAT_MS of 2000)."""
    return max(MIN_BOUND_S, BEATS_PER_BOUND * heartbeat_ms / 1000)


class HealthFile:
    """The file a process touches while it serves; `path` None (QT_HEALTH_FILE unset): off."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._failing = False

    def clear(self) -> None:
        """At start-up: a file left by this container's previous run (an emptyDir outlives a
        restart) says nothing about this one, and would pass the probe while it loads."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def touch(self) -> None:
        """Say the process serves now. A file that cannot be written is logged once (the probe
        then fails, which is how it is noticed) and never stops the process."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        except OSError as exc:
            if not self._failing:
                log.warning("cannot touch the health file %s (QT_HEALTH_FILE): %s", self.path, exc)
            self._failing = True
            return
        if self._failing:
            log.info("the health file %s is touched again", self.path)
        self._failing = False


@dataclass(frozen=True)
class Verdict:
    """What a probe found: whether the process serves, and a line saying why."""

    healthy: bool
    reason: str


def judge(path: Path, max_age_s: float, now: float | None = None) -> Verdict:
    """Healthy when `path` was touched at most `max_age_s` seconds ago."""
    try:
        touched = path.stat().st_mtime
    except FileNotFoundError:
        return Verdict(
            False, f"{path} is missing: the process has not reached Redis since it started"
        )
    age = (time.time() if now is None else now) - touched
    if age > max_age_s:
        return Verdict(
            False,
            f"{path} was last touched {age:.1f} s ago > {max_age_s:g} s: the process has not "
            "reached Redis since (stopped, wedged, or cut off)",
        )
    return Verdict(True, f"{path} touched {max(age, 0.0):.1f} s ago (bound {max_age_s:g} s)")
