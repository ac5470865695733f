"""What an operator can do to the queue from the dashboard: retry a failed op, cancel one
still waiting, drain a worker. `tenant=None` acts for an admin (any tenant's job); a tenant's
own call finds another tenant's job exactly as it finds a missing one."""

from __future__ import annotations

import uuid

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from queue_tinker.errors import UserInputError
from queue_tinker.queue import redis_bytes
from queue_tinker.queue.dispatch import command_worker
from queue_tinker.queue.jobs import JobQueue
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.scripts import Scripts
from queue_tinker.types import OpKind

CANCELLED = "cancelled from the dashboard before it ran"


async def retry_job(
    redis: Redis, keys: Keys, job_id: str, tenant: str | None, *, result_ttl_s: int = 3_600
) -> str:
    """Submit a failed op again, as a new request at the end of its model's queue; the new
    request id. The op's payload is kept with a failed job for as long as its record."""
    owner, status, model_id, kind, payload = await redis_bytes.hmget(
        redis, keys.job(job_id), "tenant_id", "status", "model_id", "kind", "payload"
    )
    if owner is None or (tenant is not None and owner.decode() != tenant):
        raise UserInputError(f"request_id: no request {job_id!r}")
    if status != b"failed":
        raise UserInputError(
            f"request_id: {job_id} is {status.decode() if status else '?'}; "
            "only a failed request can be retried"
        )
    if payload is None or model_id is None or kind is None:
        raise UserInputError(
            f"request_id: {job_id} can no longer be retried (what it asked "
            "for is not kept: it failed before this version, or was cancelled)"
        )
    jobs = JobQueue(redis, keys, result_ttl_s=result_ttl_s)
    enqueued = await jobs.enqueue(
        model_id.decode(), OpKind(kind.decode()), payload, job_id=uuid.uuid4().hex
    )
    return enqueued.job_id


async def cancel_job(
    redis: Redis, keys: Keys, job_id: str, tenant: str | None, *, reason: str = CANCELLED
) -> None:
    """Cancel an op still waiting in its model's queue: it fails as cancelled (its future
    resolves with `reason`) and the model's worker skips it."""
    try:
        await Scripts.load(redis).cancel(
            keys=[keys.job(job_id), keys.records()], args=[tenant or "", reason, keys.prefix]
        )
    except ResponseError as exc:
        if "UNKNOWN_JOB" in str(exc):
            raise UserInputError(f"request_id: no request {job_id!r}") from None
        if "NOT_QUEUED" in str(exc):
            status = str(exc).split("NOT_QUEUED:", 1)[1]
            raise UserInputError(
                f"request_id: {job_id} is {status}; only a request still "
                "waiting in its queue can be cancelled"
            ) from None
        raise


async def drain_worker(redis: Redis, keys: Keys, worker_id: str) -> None:
    """Ask a worker to finish its op in progress, hand its models back and exit."""
    if not await redis.exists(keys.worker(worker_id)):
        raise UserInputError(f"worker_id: no live worker {worker_id!r}")
    await command_worker(redis, keys, worker_id, "drain")
