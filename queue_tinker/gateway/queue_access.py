"""The gateway's side of the queue: one JobQueue and one ResultListener for every caller, plus
the checks that keep each tenant to its own sessions and models."""

from __future__ import annotations

import logging
import uuid
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request

from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import RECORD_WAIT_S, RecordLog
from queue_tinker.queue.ops.inflight import InflightWeights
from queue_tinker.queue.ops.jobs import HeldLimits, JobQueue
from queue_tinker.queue.ops.sessions import ProtocolState
from queue_tinker.queue.results.listener import ResultListener
from queue_tinker.settings import Settings
from queue_tinker.storage.configured import open_store
from queue_tinker.types import OpKind
from queue_tinker.types.requests.request_limits import RequestLimits

log = logging.getLogger(__name__)


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def not_found(what: str) -> HTTPException:
    """Unknown and another tenant's look the same: the caller learns nothing of the other."""
    return HTTPException(404, f"{what}: not found")


class GatewayQueue:
    def __init__(self, redis: RedisClient, keys: Keys, settings: Settings) -> None:
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
        self.protocol = ProtocolState(redis, keys, settings.result_ttl_s)
        self.records = RecordLog(redis, keys)

    async def close(self) -> None:
        await self.results.close()

    async def recorded(self) -> None:
        """Wait until the record events appended so far are in Postgres (the recorders write
        them, asked to at once): a read of Postgres then finds what a client was just told
        exists, a checkpoint saved just now among them. Past RECORD_WAIT_S (no recorder
        running, Postgres away) the read goes ahead, and says so in the log."""
        if not await self.records.wait_recorded(RECORD_WAIT_S):
            log.warning(
                "the record is behind: events older than this read are not yet in Postgres "
                "after %.0f s (is Postgres up?)",
                RECORD_WAIT_S,
            )

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
        await self.protocol.set_reply(job_id, reply)

    async def reply(self, job_id: str) -> dict[str, Any]:
        return await self.protocol.reply(job_id)

    # --- ownership -------------------------------------------------------------------------
    async def open_session(self, session_id: str, tenant: str) -> None:
        await self.protocol.open_session(session_id, tenant)

    async def session_of(self, session_id: str, tenant: str) -> str:
        """The session id, if it is the tenant's (404 otherwise); renews its TTL."""
        if await self.protocol.session_tenant(session_id) != tenant:
            raise not_found(f"session_id {session_id!r}")
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


# The route parameter that is the app's GatewayQueue: one definition for every route.
QueueDep = Annotated[GatewayQueue, Depends(gateway_queue)]
