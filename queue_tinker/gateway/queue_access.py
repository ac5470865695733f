"""The gateway's side of the queue: one JobQueue and one ResultListener for every caller, plus
the checks that keep each tenant to its own sessions and models."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import HTTPException, Request
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import RecordLog
from queue_tinker.queue.ops.inflight import InflightWeights
from queue_tinker.queue.ops.jobs import HeldLimits, JobQueue
from queue_tinker.queue.results.listener import ResultListener
from queue_tinker.services.recorder import catch_up
from queue_tinker.settings import Settings
from queue_tinker.storage.configured import open_store
from queue_tinker.types import OpKind
from queue_tinker.types.requests.request_limits import RequestLimits

SESSION_TTL_S = 7 * 86_400  # renewed by every heartbeat


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def not_found(what: str) -> HTTPException:
    """Unknown and another tenant's look the same: the caller learns nothing of the other."""
    return HTTPException(404, f"{what}: not found")


class GatewayQueue:
    def __init__(self, redis: Redis, keys: Keys, settings: Settings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.store = open_store(settings)  # checkpoint storage: copies, downloads, TTLs
        self.limits = RequestLimits.of(settings)  # QT_MAX_*: what one request may hold
        self.jobs = JobQueue(
            redis, keys, result_ttl_s=settings.result_ttl_s, held=HeldLimits.of(settings)
        )
        self.results = ResultListener(redis, keys, self.jobs)
        self.registry = WorkerRegistry(redis, keys)
        self.inflight = InflightWeights(
            redis, keys, self.jobs.scripts, settings.ephemeral_sampler_ttl_s
        )

    async def close(self) -> None:
        await self.results.close()

    async def catch_up_record(
        self, sessions: async_sessionmaker[AsyncSession], *, requests: bool = False
    ) -> None:
        """Write the runs, checkpoints and sessions (with `requests`, the requests' events)
        still on their way to Postgres first (recorder.catch_up): a read of Postgres then
        finds what a client was just told exists, a checkpoint saved just now among them."""
        await catch_up(RecordLog(self.redis, self.keys), sessions, requests=requests)

    # --- submitting ----------------------------------------------------------------------
    async def submit(
        self, model_id: str, kind: OpKind, payload: bytes, idempotency_key: str | None
    ) -> str:
        """Enqueue at the end of the model's log; the request id (the first one's, on a
        repeat under the same idempotency key)."""
        enqueued = await self.jobs.enqueue(
            model_id, kind, payload, job_id=new_request_id(), idempotency_key=idempotency_key
        )
        return enqueued.job_id

    async def submit_in_order(
        self, model_id: str, seq_id: int, kind: OpKind, payload: bytes
    ) -> str:
        """Enqueue in the order of the client's seq_id; a repeated seq_id gets the first id."""
        ordered = await self.jobs.enqueue_in_order(
            model_id, seq_id, kind, payload, job_id=new_request_id()
        )
        return ordered.job_id

    async def refuse_in_order(self, model_id: str, seq_id: int) -> None:
        """A request refused at the door still takes its turn: later ones must not wait for it."""
        await self.jobs.enqueue_in_order(model_id, seq_id, None, b"", job_id="")

    async def set_reply(self, job_id: str, reply: dict[str, Any]) -> None:
        """How to answer for the job once it is done, beyond what its kind says."""
        await self.redis.set(
            self.keys.job_reply(job_id), json.dumps(reply), ex=self.settings.result_ttl_s
        )

    async def reply(self, job_id: str) -> dict[str, Any]:
        raw = await self.redis.get(self.keys.job_reply(job_id))
        return json.loads(raw) if raw else {}

    # --- ownership -------------------------------------------------------------------------
    async def open_session(self, session_id: str, tenant: str) -> None:
        await self.redis.set(self.keys.session(session_id), tenant, ex=SESSION_TTL_S)

    async def session_of(self, session_id: str, tenant: str) -> str:
        """The session id, if it is the tenant's (404 otherwise); renews its TTL."""
        key = self.keys.session(session_id)
        if (await redis_bytes.get(self.redis, key) or b"").decode() != tenant:
            raise not_found(f"session_id {session_id!r}")
        await self.redis.expire(key, SESSION_TTL_S)
        return session_id

    async def model_of(self, model_id: str, tenant: str, kind: str = "training") -> dict[str, Any]:
        """The model's meta, if it is the tenant's and of this kind (404 otherwise)."""
        info = await self.jobs.tenant_model(model_id, tenant, kind)
        if info is None:
            what = "sampling_session_id" if kind == "sampling" else "model_id"
            raise not_found(f"{what} {model_id!r}")
        return info


async def gateway_queue(request: Request) -> GatewayQueue:
    """FastAPI dependency: the app's GatewayQueue (async: FastAPI runs a plain `def`
    dependency in its thread pool, a thread hand-off on every request)."""
    return request.app.state.gateway_queue
