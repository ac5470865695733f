"""The connection a client holds: enqueue with retries, and wait for outcomes.

Everything here runs on the background loop (queue_tinker/client/loop.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from queue_tinker.client.future import APIFuture
from queue_tinker.client.loop import BackgroundLoop
from queue_tinker.client.queue_state import QueueStateWatch
from queue_tinker.errors import (
    ErrorCategory,
    RedisUnavailableError,
    RequestFailedError,
    UserInputError,
)
from queue_tinker.queue.connection import connect
from queue_tinker.queue.control.actions import cancel_job
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import RecordLog
from queue_tinker.queue.ops.inflight import InflightWeights
from queue_tinker.queue.ops.jobs import Enqueued, JobOutcome, JobQueue
from queue_tinker.queue.outage import MAX_RETRY_DELAY_S, REDIS_DOWN, describe
from queue_tinker.queue.results.listener import ResultListener
from queue_tinker.settings import Settings
from queue_tinker.types import JobStatus, OpKind, SessionRecord

log = logging.getLogger(__name__)

T = TypeVar("T")
# Keep retrying a submit this long while Redis is unreachable (a restart takes seconds); the
# futures of submitted requests wait as long for Redis to come back (ResultListener).
ENQUEUE_RETRY_S = 30.0
FUTURE_CANCEL_REASON = "cancelled by the client (future.cancel())"


def new_id() -> str:
    return uuid.uuid4().hex


class ClientHolder:
    def __init__(self, settings: Settings) -> None:
        if not settings.redis_url:
            raise ValueError(
                "QT_REDIS_URL is not set: start the service with `queue-tinker up` and export "
                "the URL it prints, or pass redis_url=..."
            )
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.redis = connect(settings.redis_url)
        self.jobs = JobQueue(self.redis, self.keys, result_ttl_s=settings.result_ttl_s)
        self.results = ResultListener(
            self.redis, self.keys, self.jobs, outage_limit_s=ENQUEUE_RETRY_S
        )
        self.registry = WorkerRegistry(self.redis, self.keys)
        self.inflight = InflightWeights(
            self.redis, self.keys, self.jobs.scripts, settings.ephemeral_sampler_ttl_s
        )
        self.queue_state = QueueStateWatch(
            self.redis, self.keys, self.registry, settings.lease_ttl_ms * 3
        )
        self.tenant_id = settings.tenant
        self.session_id = f"s-{new_id()}"

    async def open_session(self) -> None:
        await RecordLog(self.redis, self.keys).append(
            SessionRecord(id=self.session_id, tenant_id=self.tenant_id, created_at=time.time())
        )

    async def submit(
        self, model_id: str, kind: OpKind, payload: bytes, idempotency_key: str | None = None
    ) -> tuple[str, asyncio.Future[JobOutcome]]:
        """Enqueue and return (request id, a future of its outcome).

        The future exists before the op does, so the hot path needs no extra read; only a
        resubmit that matched an earlier job under its idempotency key waits the long way.
        While Redis is unreachable, it retries for ENQUEUE_RETRY_S, then raises
        RedisUnavailableError.
        """
        deadline = time.monotonic() + ENQUEUE_RETRY_S
        await self._retrying(
            lambda: self.results.watch(model_id, timeout_s=max(deadline - time.monotonic(), 0.1)),
            deadline,
            f"subscribing to the results of {model_id}",
        )
        job_id = new_id()
        future = self.results.expect(job_id)
        try:
            enqueued = await self.enqueue(
                model_id, kind, payload, idempotency_key, job_id=job_id, deadline=deadline
            )
        except BaseException:
            future.cancel()
            raise
        if enqueued.job_id == job_id:
            self.results.confirm(job_id)
            self.queue_state.track(model_id, future)
            return job_id, future
        future.cancel()
        earlier = asyncio.ensure_future(self.results.wait(enqueued.job_id, model_id))
        self.queue_state.track(model_id, earlier)
        return enqueued.job_id, earlier

    async def enqueue(
        self,
        model_id: str,
        kind: OpKind,
        payload: bytes,
        idempotency_key: str | None,
        *,
        job_id: str,
        deadline: float | None = None,
    ) -> Enqueued:
        """Submit once; on a dropped connection, resubmit the same job id (runs once: the
        script finds the job the lost reply was about)."""
        return await self._retrying(
            lambda: self.jobs.enqueue(
                model_id, kind, payload, job_id=job_id, idempotency_key=idempotency_key
            ),
            deadline or time.monotonic() + ENQUEUE_RETRY_S,
            f"submitting {kind} to {model_id}",
        )

    async def _retrying(self, call: Callable[[], Awaitable[T]], deadline: float, what: str) -> T:
        """call(), again with backoff while Redis is unreachable, until `deadline`
        (monotonic); then RedisUnavailableError."""
        delay = 0.05
        while True:
            try:
                return await call()
            except REDIS_DOWN as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RedisUnavailableError(
                        f"{what}: Redis unreachable for {ENQUEUE_RETRY_S:.0f} s "
                        f"({describe(exc)}); not submitted, unless an attempt whose reply was "
                        f"lost got through: resubmit with an idempotency_key to run it at most "
                        f"once"
                    ) from exc
                delay = min(delay, left)
                log.warning(
                    "%s: Redis unreachable (%s); retrying in %.2fs", what, describe(exc), delay
                )
                await asyncio.sleep(delay)  # backoff, not a wait for an event
                delay = min(delay * 2, MAX_RETRY_DELAY_S)

    async def submit_for_thread(
        self,
        model_id: str,
        kind: OpKind,
        payload: bytes,
        idempotency_key: str | None,
        decode: Callable[[bytes], T],
    ) -> tuple[str, concurrent.futures.Future[T]]:
        """submit(), with the decoded result delivered to a future any thread can wait on
        (set from a callback: no extra task, no extra hop through the loop)."""
        job_id, outcome = await self.submit(model_id, kind, payload, idempotency_key)
        result: concurrent.futures.Future[T] = concurrent.futures.Future()

        def settle(done: asyncio.Future[JobOutcome]) -> None:
            if done.cancelled():
                result.cancel()
                return
            try:
                result.set_result(decode_outcome(done.result(), decode))
            except Exception as exc:
                result.set_exception(exc)

        outcome.add_done_callback(settle)
        return job_id, result

    async def submit_future(
        self,
        loop: BackgroundLoop,
        model_id: str,
        kind: OpKind,
        payload: bytes,
        decode: Callable[[bytes], T],
        idempotency_key: str | None = None,
    ) -> APIFuture[T]:
        """From the caller's thread or loop: enqueue on the background loop (returns once the
        op holds its place in the model's order) and give the future of its decoded result."""
        job_id, result = await loop.call(
            self.submit_for_thread(model_id, kind, payload, idempotency_key, decode)
        )
        return APIFuture(result, job_id, (loop, lambda: self.cancel(job_id)))

    async def cancel(self, job_id: str) -> bool:
        """Cancel a request of this client's tenant (APIFuture.cancel): True if the service
        took it back, False if it had finished or is a running op that cannot stop."""
        try:
            await cancel_job(
                self.redis, self.keys, job_id, self.tenant_id, reason=FUTURE_CANCEL_REASON
            )
        except UserInputError:
            return False
        return True

    async def close(self) -> None:
        await self.queue_state.close()
        await self.results.close()
        await self.redis.aclose()


def decode_outcome(outcome: JobOutcome, decode: Callable[[bytes], T]) -> T:
    if outcome.status is JobStatus.FAILED:
        raise RequestFailedError(
            outcome.error,
            category=ErrorCategory(outcome.error_category or ErrorCategory.SERVER),
            request_id=outcome.job_id,
            detail=outcome.error_detail,
        )
    return decode(outcome.result)
