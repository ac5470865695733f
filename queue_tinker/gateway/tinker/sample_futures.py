"""The sampling client's protocol beyond asample (docs/tinker-http-protocol.md, section 12):
retrieve_futures (flag sample_use_retrieve_futures: one long poll per sampling client for all
its samples in flight, instead of one per sample), join_sampling_session (flag
sample_join_sampling_session: a clone of a SamplingClient gets a client id of its own, so its
seq_ids never collide with another's), cancel_future and client/dynamic_config (which turns
the SDK's cancel on)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from queue_tinker.errors import UserInputError
from queue_tinker.gateway.auth import TenantDep
from queue_tinker.gateway.queue_access import GatewayQueue, QueueDep, not_found
from queue_tinker.gateway.tinker.futures import poll_budget
from queue_tinker.queue.control.actions import cancel_job
from queue_tinker.queue.results.sample_futures import CLIENT_BLOCK, SampleFutures
from queue_tinker.types import JobStatus

# A poll re-reads its client's pending samples at least this often: a sample submitted
# through another gateway process cannot wake it (one submitted here wakes it at once).
RECHECK_S = 1.0
# The queued op fails with "<SDK_CANCEL_REASON> before it ran", a running sample "... while it ran".
SDK_CANCEL_REASON = "cancelled by the client (cancel_future)"
CANCELLABLE = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
DYNAMIC_CONFIG = {
    "refresh_interval_sec": 300,
    "sample_cancel_enabled": True,
    "sample_cancel_max_batch_size": 64,
}

router = APIRouter(prefix="/api/v1")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FuturesTarget(_Request):
    type: str = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: int = Field(0, ge=0)


class RetrieveFuturesRequest(_Request):
    target: FuturesTarget
    prev_cursor: int = Field(0, ge=0)
    timeout: float | None = Field(None, ge=0)
    # Payloads are kept for QT_RESULT_TTL_S whatever the client reports; accepted and unused.
    retrieved_request_ids: list[str] = Field(default_factory=list)


class SamplingSessionRequest(_Request):
    sampling_session_id: str


class CancelFutureRequest(_Request):
    request_id: str


class Wakeups:
    """One event per sampling client with a poll open in this process; asample sets it."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, int], asyncio.Event] = {}

    def open(self, sampler_id: str, client: int) -> asyncio.Event:
        return self._events.setdefault((sampler_id, client), asyncio.Event())

    def close(self, sampler_id: str, client: int, event: asyncio.Event) -> None:
        if self._events.get((sampler_id, client)) is event:
            del self._events[(sampler_id, client)]

    def ring(self, sampler_id: str, client: int) -> None:
        event = self._events.get((sampler_id, client))
        if event is not None:
            event.set()


def sample_futures(gq: GatewayQueue) -> SampleFutures:
    return SampleFutures(gq.redis, gq.keys, ttl_s=gq.settings.result_ttl_s)


async def sample_wakeups(request: Request) -> Wakeups:
    """FastAPI dependency: the app's Wakeups (made on first use)."""
    state = request.app.state
    if not hasattr(state, "sample_wakeups"):
        state.sample_wakeups = Wakeups()
    found: Wakeups = state.sample_wakeups
    return found


async def note_sample(
    gq: GatewayQueue, wakeups: Wakeups, sampler_id: str, seq_id: int, request_id: str
) -> None:
    """asample's part: the sample is pending for its client, whose open poll wakes."""
    await sample_futures(gq).add(sampler_id, seq_id, request_id)
    wakeups.ring(sampler_id, seq_id // CLIENT_BLOCK)


@router.post("/retrieve_futures")
async def retrieve_futures(
    body: RetrieveFuturesRequest,
    request: Request,
    gq: QueueDep,
    tenant: TenantDep,
    wakeups: Annotated[Wakeups, Depends(sample_wakeups)],
) -> dict[str, Any]:
    """The client's samples finished since `prev_cursor`; held open until one finishes or
    the poll's time is up (at once with timeout 0)."""
    target = body.target
    if target.type != "sampling_session":
        raise UserInputError(
            f"target.type: {target.type!r} is not supported; only 'sampling_session'"
        )
    sampler, client = target.sampling_session_id, target.cloned_sampler_id
    await gq.model_of(sampler, tenant, kind="sampling")
    budget = poll_budget(request, gq.settings)
    if body.timeout is not None:
        budget = min(budget, body.timeout)
    deadline = time.monotonic() + budget
    event = wakeups.open(sampler, client)
    try:
        while True:
            completions = await _poll_once(gq, sampler, client, body.prev_cursor, event, deadline)
            if completions is not None:
                break
    finally:
        wakeups.close(sampler, client, event)
    cursor = max([body.prev_cursor, *(c["cursor"] for c in completions)])
    return {
        "completions": [{"state": c["state"], "request_id": c["request_id"]} for c in completions],
        "cursor": cursor,
    }


async def _poll_once(
    gq: GatewayQueue,
    sampler: str,
    client: int,
    prev_cursor: int,
    event: asyncio.Event,
    deadline: float,
) -> list[dict[str, Any]] | None:
    """One look: the completions after prev_cursor, or [] when the time is up; None after a
    wait that something ended early (look again)."""
    futures = sample_futures(gq)
    event.clear()  # before reading the pending set: a sample added after it rings again
    await gq.results.watch(sampler)
    pending = await futures.pending(sampler, client)
    # Expect before reading the statuses: a result published in between is not missed.
    waiters = [gq.results.expect(request_id) for request_id in pending]
    for request_id in pending:
        gq.results.confirm(request_id)
    try:
        await futures.complete(sampler, client, await futures.finished(pending))
        found = await futures.after(sampler, client, prev_cursor)
        left = deadline - time.monotonic()
        if found or left <= 0:
            return [
                {"state": c.state, "request_id": c.request_id, "cursor": c.cursor} for c in found
            ]
        await _first_of(waiters, event, min(left, RECHECK_S))
        return None
    finally:
        for waiter in waiters:
            waiter.cancel()


async def _first_of(
    waiters: Iterable[asyncio.Future[Any]], event: asyncio.Event, timeout: float
) -> None:
    ring = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([*waiters, ring], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ring.cancel()


@router.post("/join_sampling_session")
async def join_sampling_session(
    body: SamplingSessionRequest, gq: QueueDep, tenant: TenantDep
) -> dict[str, Any]:
    """A client id for a new client (a clone) of the session: 1, 2, ... (the original is 0)."""
    await gq.model_of(body.sampling_session_id, tenant, kind="sampling")
    counter = await sample_futures(gq).join(body.sampling_session_id)
    return {"type": "join_sampling_session", "client_counter": counter}


@router.post("/cancel_future")
async def cancel_future(
    body: CancelFutureRequest, gq: QueueDep, tenant: TenantDep
) -> dict[str, Any]:
    """A request still waiting in its queue is removed, a running sample stops at its worker's
    next decode step; either way its future fails as cancelled. One that is finished, or
    running and not a sample, is left as it is: the answer is the same (the SDK sends this
    for every abandoned sample and expects no more than a 200)."""
    job, _ = await gq.jobs.job(body.request_id)
    if not job or job.get("tenant_id") != tenant:
        raise not_found(f"request_id {body.request_id!r}")
    if job.get("status") in CANCELLABLE:
        with contextlib.suppress(UserInputError):  # finished meanwhile, or not a sample
            await cancel_job(gq.redis, gq.keys, body.request_id, tenant, reason=SDK_CANCEL_REASON)
    return {}


@router.post("/client/dynamic_config")
async def client_dynamic_config(_: TenantDep) -> dict[str, Any]:
    return DYNAMIC_CONFIG
