"""Ops arriving in the owned models' backlogs: the reader rings when it queued some, the
execute loop waits for them when there is nothing to run, and gathers a burst before a batch
starts."""

from __future__ import annotations

import asyncio
import contextlib
import time

from queue_tinker.workers.runtime.scheduling import Scheduler

# Requests sent together reach the worker one enqueue round trip apart. Before a batch starts,
# wait while they keep arriving (each gap under GATHER_QUIET_S, GATHER_MAX_S in all), so they
# share one generation loop (or training pass) instead of the first one running alone and the
# rest after it. Training clients woken by one batch's results send their next steps as such a
# burst.
GATHER_QUIET_S = 0.005
GATHER_MAX_S = 0.05


class Arrivals:
    def __init__(self, schedule: Scheduler, stopping: asyncio.Event) -> None:
        self.schedule = schedule
        self.stopping = stopping
        self._rung = asyncio.Event()

    def ring(self) -> None:
        """Ops arrived (or the worker is stopping): whoever waits looks again."""
        self._rung.set()

    async def wait(self, timeout_s: float) -> None:
        """Until ops arrive, or `timeout_s` passes."""
        self._rung.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._rung.wait(), timeout=timeout_s)

    async def gather(self) -> None:
        """Give ops that are on their way a few milliseconds to join the batch; no longer than
        until every owned model's share of it is complete (a lone training run's step has
        arrived whole: nothing else could join)."""
        deadline = time.monotonic() + GATHER_MAX_S
        while not self.stopping.is_set() and time.monotonic() < deadline:
            if self.schedule.batch_complete(time.monotonic()):
                return
            self._rung.clear()
            try:
                await asyncio.wait_for(self._rung.wait(), GATHER_QUIET_S)
            except TimeoutError:
                return  # nothing new within the quiet gap: the burst is over
