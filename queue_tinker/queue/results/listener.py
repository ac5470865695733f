"""Waiting for results without polling: one pub/sub connection per process, one channel per
model, a local future per job.

When the connection drops (Redis restarted), the reader connects again with backoff and
subscribes to every channel again; what was published meanwhile is lost to pub/sub, so once
the subscription is confirmed it re-reads every waiting job from its hash. If Redis stays away
longer than `outage_limit_s`, the waiting futures fail with RedisUnavailableError instead of
hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from typing import Any

import msgpack
from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from queue_tinker.errors import RedisUnavailableError, ResultExpiredError
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobOutcome, JobQueue, outcome_from_fields
from queue_tinker.queue.outage import MAX_RETRY_DELAY_S, REDIS_DOWN, describe
from queue_tinker.types import JobStatus

log = logging.getLogger(__name__)

# A message lost while the pub/sub connection reconnects would strand its future; a slow
# sweep re-reads jobs that have waited this long. It is a safety net, not the wake-up path.
RESULT_SWEEP_INTERVAL_S = 5.0
# Waiting futures fail once Redis has been unreachable this long (the same window a submit
# retries for): a caller blocked on .result() hears of the outage instead of hanging.
OUTAGE_LIMIT_S = 30.0


class _PubSub(PubSub):
    """redis-py's PubSub reconnects from inside a failed read or send, which can race with the
    listener's own reconnect (two sockets opened for one connection). Here a failure only
    disconnects; ResultListener reconnects, under its lock, and then catches up."""

    async def _reconnect(
        self, conn: Any, error: BaseException | None = None, *args: Any, **kwargs: Any
    ) -> None:
        await conn.disconnect(error=error)


class ResultListener:
    """Resolves local futures from the per-model events channels."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        jobs: JobQueue,
        *,
        sweep_interval_s: float = RESULT_SWEEP_INTERVAL_S,
        outage_limit_s: float = OUTAGE_LIMIT_S,
    ) -> None:
        self.redis = redis
        self.sweep_interval_s = sweep_interval_s
        self.outage_limit_s = outage_limit_s
        self.keys = keys
        self.jobs = jobs
        self._pubsub: PubSub = _PubSub(redis.connection_pool)
        self._lock = asyncio.Lock()  # one connect or subscribe at a time on the connection
        self._subscribed: dict[bytes, asyncio.Event] = {}
        self._waiters: defaultdict[str, list[asyncio.Future[JobOutcome]]] = defaultdict(list)
        # Jobs known to exist in Redis (submitted), with when: only these may be swept. A job
        # whose submit still waits for a connection is not in Redis yet and is not "expired".
        self._confirmed: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._catching_up: set[asyncio.Task[None]] = set()
        self.down_since: float | None = None  # monotonic; the connection is down since then
        self._resync = False  # reconnected: re-read the waiting jobs at the first reply
        self.reconnects = 0

    async def watch(self, model_id: str, *, timeout_s: float | None = None) -> None:
        """Subscribe to the model's channel and wait until Redis has confirmed it; raises
        RedisUnavailableError if no confirmation came within `timeout_s` (Redis is away), and
        a redis-py ConnectionError if the subscribe could not be sent."""
        channel = self.keys.model_events(model_id).encode()
        while True:
            event = self._subscribed.get(channel)
            if event is None:
                event = self._subscribed[channel] = asyncio.Event()
                try:
                    async with self._lock:
                        await self._pubsub.subscribe(channel)
                except BaseException:
                    del self._subscribed[channel]
                    event.set()  # whoever waits on it tries again itself
                    raise
                self._start_tasks()
            if event.is_set() and self._subscribed.get(channel) is event:
                return  # the hot path: subscribed long ago, no timer to arm
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except TimeoutError:
                raise RedisUnavailableError(
                    f"Redis did not confirm the subscription to {model_id}'s results within "
                    f"{timeout_s:.0f} s"
                ) from None
            if self._subscribed.get(channel) is event:
                return

    def _start_tasks(self) -> None:
        if self._tasks and not any(task.done() for task in self._tasks):
            return
        for task in self._tasks:
            task.cancel()
        self._tasks = [
            asyncio.create_task(self._read(), name="qt-results-reader"),
            asyncio.create_task(self._sweep(), name="qt-results-sweep"),
        ]

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

    # --- the connection ------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            try:
                async for message in self._pubsub.listen():
                    self._on_reply(message)
                return  # no channel left to listen to; watch() starts a reader again
            except REDIS_DOWN as exc:
                await self._reconnect(exc)

    async def _reconnect(self, exc: BaseException) -> None:
        """Connect again, with backoff, until Redis answers; connecting subscribes to every
        channel again (PubSub.on_connect), and the first reply after it starts a catch-up."""
        self._resync = True
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("results: Redis connection lost (%s); reconnecting", describe(exc))
        since = self.down_since
        delay = 0.05
        while True:
            async with self._lock:
                try:
                    await self._pubsub.connect()
                    if not self._pubsub.subscribed:  # no channel: no confirmation will come
                        self._on_reply({"type": "none"})
                    return
                except REDIS_DOWN as error:
                    exc = error
            down_s = time.monotonic() - since
            if down_s >= self.outage_limit_s:
                self._fail_outage(down_s, exc)
            log.debug(
                "results: Redis still unreachable (%s); retrying in %.2fs", describe(exc), delay
            )
            await asyncio.sleep(delay)  # backoff between connection attempts
            delay = min(delay * 2, MAX_RETRY_DELAY_S)

    def _on_reply(self, message: dict[str, Any]) -> None:
        if self._resync:
            # Subscribed again (this is the first confirmation), so anything published from
            # now on arrives here; what was published while we were away is in the job hashes.
            self._resync = False
            self.reconnects += 1
            if self.down_since is not None:
                log.warning(
                    "results: reconnected to Redis after %.1fs; re-reading %d waiting requests",
                    time.monotonic() - self.down_since,
                    len(self._confirmed),
                )
            self.down_since = None
            task = asyncio.create_task(self._catch_up(), name="qt-results-catch-up")
            self._catching_up.add(task)
            task.add_done_callback(self._catching_up.discard)
        kind = message["type"]
        if kind in (b"subscribe", "subscribe"):
            event = self._subscribed.get(message["channel"])
            if event is not None:
                event.set()
        elif kind in (b"message", "message"):
            self._on_message(message["data"])

    async def _catch_up(self) -> None:
        try:
            await self._reread(list(self._confirmed))
        except REDIS_DOWN as exc:  # away again: the reader reconnects and catches up again
            log.debug("results: catch-up failed (%s)", describe(exc))

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

    # --- the safety net ------------------------------------------------------------------------
    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            if self.down_since is not None:
                continue  # the reader catches up when it is back
            cutoff = time.monotonic() - self.sweep_interval_s
            stale = [job for job, since in self._confirmed.items() if since < cutoff]
            if stale:
                try:
                    await self._reread(stale)
                except REDIS_DOWN as exc:  # the reader notices too, and reconnects
                    log.debug("results: sweep failed (%s)", describe(exc))

    def _fail_outage(self, down_s: float, exc: BaseException) -> None:
        """Redis has been away too long: fail every submitted request's future."""
        if self._confirmed:
            log.warning(
                "results: Redis unreachable for %.0f s; failing the %d requests "
                "waiting for results",
                down_s,
                len(self._confirmed),
            )
        for job_id in list(self._confirmed):
            self._fail(
                job_id,
                RedisUnavailableError(
                    f"request {job_id}: Redis unreachable for {down_s:.0f} s ({describe(exc)}); "
                    f"stopped waiting for its result. The request is kept in Redis (with "
                    f"persistence on) and runs when Redis is back; resubmit it with the same "
                    f"idempotency_key to get that result without running it twice"
                ),
            )

    async def _reread(self, job_ids: list[str]) -> None:
        """Resolve the given jobs from their hashes, in one round trip."""
        if not job_ids:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self.keys.job(job_id))
            replies = await pipe.execute()
        for job_id, fields in zip(job_ids, replies, strict=True):
            if not fields:
                if job_id in self._confirmed:  # not resolved meanwhile
                    self._fail(
                        job_id,
                        ResultExpiredError(
                            f"request {job_id}: no longer in Redis (its result outlived "
                            f"QT_RESULT_TTL_S={self.jobs.result_ttl_s}, or Redis restarted "
                            f"without persistence and lost it)"
                        ),
                    )
                continue
            outcome = outcome_from_fields(job_id, fields)
            if outcome is not None:
                self._resolve(outcome)

    async def close(self) -> None:
        tasks = [*self._tasks, *self._catching_up]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self._pubsub.aclose()
