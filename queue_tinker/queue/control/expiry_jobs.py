"""The housekeeper's rq jobs as Redis holds them: queue and job names, and scheduling a
checkpoint's expiry (services/housekeeper.py runs the jobs).

Apart from the housekeeper so that whoever schedules an expiry (a worker that wrote a
checkpoint, the gateway or client changing a TTL) needs only Redis and rq, not the jobs' code:
the job is named by its import path, as rq stores it anyway.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
from datetime import UTC, datetime
from typing import Any

import redis
from rq import Queue, Retry
from rq.job import Job
from rq.results import Result

from queue_tinker.errors import HousekeeperUnavailableError
from queue_tinker.queue.connection import connect_sync
from queue_tinker.queue.keys import Keys
from queue_tinker.types.service.records import CheckpointRecord, Record

# rq imports these in the housekeeper process when the job runs.
EXPIRE_JOB = "queue_tinker.services.housekeeper.expire_checkpoint"
# A Python client's writes to a checkpoint (it never writes Postgres itself): run at once,
# their result awaited (run_now).
DELETE_JOB = "queue_tinker.services.housekeeper.delete_checkpoint_now"
TTL_JOB = "queue_tinker.services.housekeeper.change_checkpoint_ttl"
NOW_JOB_OPTIONS: dict[str, Any] = {"job_timeout": 600, "result_ttl": 600, "failure_ttl": 3_600}
# Failures (Postgres down, storage not mounted) are retried by rq itself; the sweep is the
# backstop after that.
ON_ERROR = Retry(max=3, interval=[10, 60, 300])
JOB_OPTIONS: dict[str, Any] = {
    "job_timeout": 600,
    "result_ttl": 3_600,  # an hour of outcomes to inspect with `rq info` / dashboards
    "failure_ttl": 7 * 86_400,
}
UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")  # rq job ids allow only [A-Za-z0-9_-]


def housekeeping_queue(prefix: str) -> str:
    """The rq queue of this deployment's housekeeping jobs."""
    return Keys(prefix).housekeeping_queue()


def id_token(queue_name: str) -> str:
    return UNSAFE_ID_CHARS.sub("_", queue_name)


def expiry_job_id(queue_name: str, checkpoint_id: str, suffix: str = "") -> str:
    """Deterministic per (deployment, checkpoint): scheduling twice replaces, never doubles.
    Starts with the queue name so every rq key of a deployment can be found by it."""
    digest = hashlib.sha256(checkpoint_id.encode()).hexdigest()[:32]
    return f"{id_token(queue_name)}--expire-{digest}{suffix}"


def sweep_job_id(queue_name: str) -> str:
    return f"{id_token(queue_name)}--sweep"


# --- scheduling ----------------------------------------------------------------------------


def schedule_checkpoint_expiry(
    redis: redis.Redis, prefix: str, checkpoint_id: str, directory: str, expires_at: float
) -> None:
    """Have the housekeeper expire `checkpoint_id` (files in `directory`) at `expires_at`
    (unix seconds). Scheduling the same checkpoint again moves its one job to the new time."""
    queue = Queue(housekeeping_queue(prefix), connection=redis)
    job_id = expiry_job_id(queue.name, checkpoint_id)
    schedule_job(
        queue, job_id, expires_at, {"checkpoint_id": checkpoint_id, "directory": directory}
    )


def schedule_job(queue: Queue, job_id: str, at: float, kwargs: dict[str, Any]) -> None:
    """Run the expiry job with `kwargs` at `at` (unix seconds), under `job_id`."""
    # rq's scheduled registry keeps whole seconds and fires a job once floor(now) reaches its
    # score: rounding up keeps it from firing up to a second before the checkpoint expires.
    when = datetime.fromtimestamp(math.ceil(at), tz=UTC)
    with queue.connection.pipeline() as pipe:
        # A finished run under the same id leaves its hash with a result TTL, which HSET keeps:
        # drop it, or the new schedule could vanish before it fires.
        pipe.delete(Job.key_for(job_id))
        queue.enqueue_at(
            when,
            EXPIRE_JOB,
            kwargs=kwargs,
            job_id=job_id,
            pipeline=pipe,
            retry=ON_ERROR,
            **JOB_OPTIONS,
        )
        pipe.execute()


async def schedule_expiry(
    redis_url: str, prefix: str, checkpoint_id: str, directory: str, expires_at: float
) -> None:
    """schedule_checkpoint_expiry from async code (a TTL set through the gateway or the REST
    client): rq speaks sync Redis, and a TTL change is rare enough for a connection of its own."""

    def schedule() -> None:
        with connect_sync(redis_url) as client:
            schedule_checkpoint_expiry(client, prefix, checkpoint_id, directory, expires_at)

    await asyncio.to_thread(schedule)


async def run_now(
    redis_url: str, prefix: str, job: str, kwargs: dict[str, Any], timeout_s: float
) -> Any:
    """Have the housekeeper run `job` with `kwargs` now (ahead of its queue) and wait for what
    it returns: the caller's one round of work for it, off the event loop (rq speaks sync
    Redis). HousekeeperUnavailableError if none ran it within `timeout_s` (the job is taken
    back, so it never runs late); the job's own error, as a RuntimeError naming it, if it
    failed."""

    def run() -> Any:
        with connect_sync(redis_url) as client:
            queue = Queue(housekeeping_queue(prefix), connection=client)
            queued = queue.enqueue(job, kwargs=kwargs, at_front=True, **NOW_JOB_OPTIONS)
            result = queued.latest_result(timeout=max(1, math.ceil(timeout_s)))
            if result is None:
                queued.cancel()
                raise HousekeeperUnavailableError(
                    f"no housekeeper ran {job.rsplit('.', 1)[-1]} within {timeout_s:.0f} s: "
                    "start one for this deployment (`queue-tinker housekeeper`; `queue-tinker "
                    "up` and docker-compose.yml run one)"
                )
            if result.type is Result.Type.SUCCESSFUL:
                return result.return_value
            last = (result.exc_string or "").strip().splitlines()
            raise RuntimeError(f"housekeeper job {job} failed: {last[-1] if last else '?'}")

    return await asyncio.to_thread(run)


class ExpiryScheduler:
    """Hands each new checkpoint with a TTL to the housekeeper, which deletes it then: a
    worker calls it with the records each publish made (rq speaks sync Redis: a connection
    of its own, used off the event loop)."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self._redis = connect_sync(redis_url)
        self._prefix = prefix

    async def __call__(self, records: list[Record]) -> None:
        await asyncio.to_thread(self._schedule, records)

    def _schedule(self, records: list[Record]) -> None:
        for record in records:
            if isinstance(record, CheckpointRecord) and record.expires_at is not None:
                schedule_checkpoint_expiry(
                    self._redis, self._prefix, record.id, record.path, record.expires_at
                )

    def close(self) -> None:
        self._redis.close()
