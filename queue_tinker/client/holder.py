"""The connection a client holds: enqueue with retries, and wait for outcomes.

Everything here runs on the background loop (queue_tinker/client/loop.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from queue_tinker.client.future import APIFuture
from queue_tinker.client.loop import BackgroundLoop
from queue_tinker.errors import ErrorCategory, RequestFailedError
from queue_tinker.queue.connection import connect
from queue_tinker.queue.jobs import Enqueued, JobOutcome, JobQueue
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.records import RecordLog
from queue_tinker.queue.registry import WorkerRegistry
from queue_tinker.queue.results import ResultListener
from queue_tinker.settings import Settings
from queue_tinker.types import JobStatus, OpKind, SessionRecord

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_TENANT = "default"
ENQUEUE_RETRY_S = 30.0  # keep retrying a submit this long while Redis is unreachable


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
        self.results = ResultListener(self.redis, self.keys, self.jobs)
        self.registry = WorkerRegistry(self.redis, self.keys)
        self.tenant_id = DEFAULT_TENANT
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
        """
        await self.results.watch(model_id)
        job_id = new_id()
        future = self.results.expect(job_id)
        try:
            enqueued = await self.enqueue(model_id, kind, payload, idempotency_key, job_id=job_id)
        except BaseException:
            future.cancel()
            raise
        if enqueued.job_id == job_id:
            self.results.confirm(job_id)
            return job_id, future
        future.cancel()
        earlier = asyncio.ensure_future(self.results.wait(enqueued.job_id, model_id))
        return enqueued.job_id, earlier

    async def enqueue(
        self,
        model_id: str,
        kind: OpKind,
        payload: bytes,
        idempotency_key: str | None,
        *,
        job_id: str,
    ) -> Enqueued:
        """Submit once; on a dropped connection, resubmit the same job id (runs once: the
        script finds the job the lost reply was about)."""
        deadline = time.monotonic() + ENQUEUE_RETRY_S
        delay = 0.05
        while True:
            try:
                return await self.jobs.enqueue(
                    model_id, kind, payload, job_id=job_id, idempotency_key=idempotency_key
                )
            except (RedisConnectionError, RedisTimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("submit to Redis failed (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

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
        return APIFuture(result, job_id)

    async def close(self) -> None:
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
