"""Waiting for results without polling: one pub/sub connection per process, one channel per
model, a local future per job."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict

import msgpack
from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from queue_tinker.errors import ResultExpiredError
from queue_tinker.queue.jobs import JobOutcome, JobQueue, outcome_from_fields
from queue_tinker.queue.keys import Keys
from queue_tinker.types import JobStatus

# A message lost while the pub/sub connection reconnects would strand its future; a slow
# sweep re-reads jobs that have waited this long. It is a safety net, not the wake-up path.
SWEEP_INTERVAL_S = 5.0


class ResultListener:
    """Resolves local futures from the per-model events channels."""

    def __init__(
        self, redis: Redis, keys: Keys, jobs: JobQueue, *,
        sweep_interval_s: float = SWEEP_INTERVAL_S,
    ) -> None:
        self.redis = redis
        self.sweep_interval_s = sweep_interval_s
        self.keys = keys
        self.jobs = jobs
        self._pubsub: PubSub = redis.pubsub()
        self._subscribed: dict[bytes, asyncio.Event] = {}
        self._waiters: defaultdict[str, list[asyncio.Future[JobOutcome]]] = defaultdict(list)
        # Jobs known to exist in Redis (submitted), with when: only these may be swept. A job
        # whose submit still waits for a connection is not in Redis yet and is not "expired".
        self._confirmed: dict[str, float] = {}
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
        can be published before it exists, so no read is needed to close a race. Call
        confirm() once the submit returned."""
        future: asyncio.Future[JobOutcome] = asyncio.get_running_loop().create_future()
        self._waiters[job_id].append(future)
        future.add_done_callback(lambda f: self._forget(job_id, f))
        return future

    def confirm(self, job_id: str) -> None:
        if job_id in self._waiters:
            self._confirmed.setdefault(job_id, time.monotonic())

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
        self.confirm(job_id)
        if outcome is not None:
            self._resolve(outcome)
        return await future

    def _forget(self, job_id: str, future: asyncio.Future[JobOutcome]) -> None:
        waiters = self._waiters.get(job_id)
        if waiters is not None and future in waiters:
            waiters.remove(future)
            if not waiters:
                del self._waiters[job_id]
                self._confirmed.pop(job_id, None)

    def _resolve(self, outcome: JobOutcome) -> None:
        for future in list(self._waiters.get(outcome.job_id, [])):
            if not future.done():
                future.set_result(outcome)

    def _fail(self, job_id: str, error: Exception) -> None:
        for future in list(self._waiters.get(job_id, [])):
            if not future.done():
                future.set_exception(error)

    async def _read(self) -> None:
        async for message in self._pubsub.listen():
            kind = message["type"]
            if kind in (b"subscribe", "subscribe"):
                event = self._subscribed.get(message["channel"])
                if event is not None:
                    event.set()
            elif kind in (b"message", "message"):
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
            await asyncio.sleep(self.sweep_interval_s)
            cutoff = time.monotonic() - self.sweep_interval_s
            stale = [job for job, since in self._confirmed.items() if since < cutoff]
            if stale:
                await self._reread(stale)

    async def _reread(self, job_ids: list[str]) -> None:
        """Resolve the given jobs from their hashes, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self.keys.job(job_id))
            replies = await pipe.execute()
        for job_id, fields in zip(job_ids, replies, strict=True):
            if not fields:
                self._fail(job_id, ResultExpiredError(
                    f"request {job_id}: no longer in Redis (its result outlived "
                    f"QT_RESULT_TTL_S={self.jobs.result_ttl_s})"))
                continue
            outcome = outcome_from_fields(job_id, fields)
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
