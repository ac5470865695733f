"""Telling a waiting caller why it waits.

While a model has requests in flight, its queue state (queue/results/state.py: `active`,
`paused_rate_limit`, `paused_capacity`, with a reason) is looked up every QUEUE_STATE_POLL_S;
each change goes to the observers. The default observer logs a readable warning, at most once
per minute per model, as in "Training is paused for m-1. Reason: concurrent training clients
rate limit hit (2 training runs at once)".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.results.state import queue_states
from queue_tinker.types import QueueState

log = logging.getLogger("queue_tinker.queue_state")
T = TypeVar("T")

QUEUE_STATE_POLL_S = 1.0
WARNING_INTERVAL_S = 60.0


@dataclass(frozen=True)
class QueueStateChange:
    model_id: str
    kind: str  # "training" or "sampling"
    state: QueueState
    reason: str | None


QueueStateObserver = Callable[[QueueStateChange], None]


class QueueStateLogger:
    """The default observer: a warning when a model is paused, once per interval per model."""

    def __init__(
        self, interval_s: float = WARNING_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last_warned: dict[str, float] = {}

    def __call__(self, change: QueueStateChange) -> None:
        if change.state is QueueState.ACTIVE:
            return
        now = self.clock()
        last = self._last_warned.get(change.model_id)
        if last is not None and now - last < self.interval_s:
            return
        self._last_warned[change.model_id] = now
        what = "Sampling" if change.kind == "sampling" else "Training"
        log.warning(
            "%s is paused for %s. Reason: %s",
            what,
            change.model_id,
            change.reason or change.state.value,
        )


class QueueStateWatch:
    """Watches the models that have requests in flight; runs on the client's loop."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        registry: WorkerRegistry,
        max_age_ms: int,
        poll_s: float = QUEUE_STATE_POLL_S,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.registry = registry
        self.max_age_ms = max_age_ms
        self.poll_s = poll_s
        self.observers: list[QueueStateObserver] = [QueueStateLogger()]
        self._in_flight: Counter[str] = Counter()
        self._last: dict[str, QueueState] = {}
        self._task: asyncio.Task[None] | None = None

    def track(self, model_id: str, future: asyncio.Future[T]) -> None:
        """Watch `model_id` until `future` (one of its requests) is done."""
        self._in_flight[model_id] += 1
        future.add_done_callback(lambda _: self._untrack(model_id))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch(), name="qt-queue-state")

    def _untrack(self, model_id: str) -> None:
        self._in_flight[model_id] -= 1
        if self._in_flight[model_id] <= 0:
            del self._in_flight[model_id]
            self._last.pop(model_id, None)  # its next wait starts from "active" again

    async def _watch(self) -> None:
        while self._in_flight:
            await asyncio.sleep(self.poll_s)
            models = list(self._in_flight)
            if not models:
                return
            try:
                await self._look(models)
            except Exception as exc:  # a hiccup here must never fail the requests
                log.debug("queue state lookup failed: %r", exc)

    async def _look(self, models: list[str]) -> None:
        states = await queue_states(self.redis, self.keys, self.registry, models, self.max_age_ms)
        for model_id, (kind, state, reason) in states.items():
            if model_id not in self._in_flight:
                continue
            if self._last.get(model_id, QueueState.ACTIVE) is state:
                continue
            self._last[model_id] = state
            change = QueueStateChange(model_id=model_id, kind=kind, state=state, reason=reason)
            for observer in list(self.observers):
                try:
                    observer(change)
                except Exception:
                    log.exception("queue state observer %r failed", observer)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
