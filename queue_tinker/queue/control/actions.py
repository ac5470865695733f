"""What an operator can do to the queue from the dashboard: retry a failed op, cancel one
still waiting (or a sample while it runs), drain a worker. `tenant=None` acts for an admin
(any tenant's job); a tenant's own call finds another tenant's job exactly as it finds a
missing one. The gateway's cancel_future cancels through here too."""

from __future__ import annotations

import uuid

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from queue_tinker.errors import UserInputError
from queue_tinker.queue import redis_bytes
from queue_tinker.queue.dispatch.dispatcher import CONTROL_STREAM_LEN, command_worker
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.queue.scripts import Scripts
from queue_tinker.types import OpKind

DASHBOARD_CANCEL_REASON = "cancelled from the dashboard"
# The ops a worker can stop half-way: a sample leaves the decode loop between two steps.
# Anything else runs to its end once started (a training op is one kernel, and its effect on
# the model's state must stay in the log's order).
STOPPABLE = (OpKind.SAMPLE,)
# A job read as running on one worker may be re-run by another (its first owner died) before
# the stop reaches the first: read it again, a few times at most.
STOP_TRIES = 3


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
    redis: Redis,
    keys: Keys,
    job_id: str,
    tenant: str | None,
    *,
    reason: str = DASHBOARD_CANCEL_REASON,
) -> str:
    """Cancel an op: one still waiting in its model's queue fails as cancelled at once (its
    future resolves with `reason` and the model's worker skips it); a running sample is
    stopped by its worker at the next decode step and fails with `reason` then. Returns the
    status the op had: "queued" or "running"."""
    try:
        await Scripts.load(redis).cancel(
            keys=[keys.job(job_id), keys.records()],
            args=[tenant or "", f"{reason} before it ran", keys.prefix],
        )
        return "queued"
    except ResponseError as exc:
        if "UNKNOWN_JOB" in str(exc):
            raise UserInputError(f"request_id: no request {job_id!r}") from None
        if "NOT_QUEUED:running" not in str(exc):
            if "NOT_QUEUED" in str(exc):
                status = str(exc).split("NOT_QUEUED:", 1)[1]
                raise _not_cancellable(job_id, status) from None
            raise
    await stop_running_job(redis, keys, job_id, tenant, reason=f"{reason} while it ran")
    return "running"


async def stop_running_job(
    redis: Redis, keys: Keys, job_id: str, tenant: str | None, *, reason: str
) -> None:
    """Ask the worker running a sample to drop it at its next decode step; the op then fails
    with `reason` (the worker publishes it, so the model's order and fencing hold)."""
    scripts = Scripts.load(redis)
    for _ in range(STOP_TRIES):
        worker = await redis_bytes.hget(redis, keys.job(job_id), "worker_id")
        worker_id = worker.decode() if worker else ""
        try:
            await scripts.stop_running(
                keys=[keys.job(job_id), keys.worker_control(worker_id)],
                args=[tenant or "", reason, worker_id, CONTROL_STREAM_LEN, *STOPPABLE],
            )
            return
        except ResponseError as exc:
            error = str(exc)
            if "UNKNOWN_JOB" in error:
                raise UserInputError(f"request_id: no request {job_id!r}") from None
            if "NOT_RUNNING" in error:
                raise _not_cancellable(job_id, error.split("NOT_RUNNING:", 1)[1]) from None
            if "NOT_STOPPABLE" in error:
                kind = error.split("NOT_STOPPABLE:", 1)[1]
                raise UserInputError(
                    f"request_id: {job_id} is a running {kind} op; only a sample can be "
                    "stopped while it runs (other ops can be cancelled while they wait)"
                ) from None
            if "MOVED" not in error:
                raise
    raise UserInputError(f"request_id: {job_id} kept moving between workers; try again")


def _not_cancellable(job_id: str, status: str) -> UserInputError:
    return UserInputError(
        f"request_id: {job_id} is {status}; only a request waiting in its queue, or a "
        "running sample, can be cancelled"
    )


async def drain_worker(redis: Redis, keys: Keys, worker_id: str) -> None:
    """Ask a worker to finish its op in progress, hand its models back and exit."""
    if not await redis.exists(keys.worker(worker_id)):
        raise UserInputError(f"worker_id: no live worker {worker_id!r}")
    await command_worker(redis, keys, worker_id, "drain")
