"""Waiting for results without polling: one pub/sub connection per process, one channel per
model, a local future per job."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

import msgpack
from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from queue_tinker.queue.jobs import JobOutcome, JobQueue
from queue_tinker.queue.keys import Keys
from queue_tinker.types import JobStatus

log = logging.getLogger(__name__)

# A message lost while the pub/sub connection reconnects would strand its future; a slow
# sweep re-reads the outstanding jobs. It is a safety net, not the wake-up path.
SWEEP_INTERVAL_S = 5.0


class ResultListener:
    """Resolves local futures from the per-model events channels."""

    def __init__(self, redis: Redis, keys: Keys, jobs: JobQueue) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self._pubsub: PubSub = redis.pubsub()
        self._subscribed: dict[bytes, asyncio.Event] = {}
        self._waiters: defaultdict[str, list[asyncio.Future[JobOutcome]]] = defaultdict(list)
        self._tasks: list[asyncio.Task[None]] = []

    async def watch(self, model_id: str) -> None:
        """Subscribe to the model's channel and wait until Redis has confirmed it."""
        channel = self.keys.model_events(model_id).encode()
        event = self._subscribed.get(channel)
        if event is None:
            event = self._subscribed[channel] = asyncio.Event()
            await self._pubsub.subscribe(channel)
            if not self._tasks:
                self._tasks = [
                    asyncio.create_task(self._read(), name="qt-results-reader"),
                    asyncio.create_task(self._sweep(), name="qt-results-sweep"),
                ]
        await event.wait()

    def expect(self, job_id: str) -> asyncio.Future[JobOutcome]:
        """A future for a job not yet submitted (the caller has watched its model): no result
        can be published before it exists, so no read is needed to close a race."""
        future: asyncio.Future[JobOutcome] = asyncio.get_running_loop().create_future()
        self._waiters[job_id].append(future)
        future.add_done_callback(lambda f: self._forget(job_id, f))
        return future

    async def wait(self, job_id: str, model_id: str) -> JobOutcome:
        """The outcome of any job (submitted anywhere), as soon as it is published."""
        await self.watch(model_id)
        future = self.expect(job_id)
        # Subscribed before this read, so a result published from here on is not missed, and
        # one published earlier is in the job hash.
        try:
            outcome = await self.jobs.outcome(job_id)
        except Exception:
            future.cancel()
            raise
        if outcome is not None:
            self._resolve(outcome)
        return await future

    def _forget(self, job_id: str, future: asyncio.Future[JobOutcome]) -> None:
        waiters = self._waiters.get(job_id)
        if waiters is not None and future in waiters:
            waiters.remove(future)
            if not waiters:
                del self._waiters[job_id]

    def _resolve(self, outcome: JobOutcome) -> None:
        for future in self._waiters.pop(outcome.job_id, []):
            if not future.done():
                future.set_result(outcome)

    async def _read(self) -> None:
        async for message in self._pubsub.listen():
            kind = message["type"]
            if kind == b"subscribe" or kind == "subscribe":
                event = self._subscribed.get(message["channel"])
                if event is not None:
                    event.set()
            elif kind == b"message" or kind == "message":
                self._on_message(message["data"])

    def _on_message(self, data: bytes) -> None:
        job_id, status, result, error, category, detail = msgpack.unpackb(data, raw=True)
        job = job_id.decode()
        if job not in self._waiters:
            return
        self._resolve(
            JobOutcome(
                job_id=job,
                status=JobStatus(status.decode()),
                result=result,
                error=error.decode(),
                error_category=category.decode(),
                error_detail=detail.decode(),
            )
        )

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            for job_id in list(self._waiters):
                try:
                    outcome = await self.jobs.outcome(job_id)
                except Exception as exc:  # the waiter learns it from its own read
                    for future in self._waiters.pop(job_id, []):
                        if not future.done():
                            future.set_exception(exc)
                    continue
                if outcome is not None:
                    self._resolve(outcome)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self._pubsub.aclose()
