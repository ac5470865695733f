"""Server-side custom losses (flag custom_loss_server_side; docs/tinker-http-protocol.md,
section 12): create_custom_loss checks an uploaded loss against the allow-list
(types/requests/custom_loss.py), refusing it naming the node, and stores it with its session; a
forward_backward with loss_fn "custom" names it by loss_id, and its op carries the loss to the
worker, which runs it inside the pass (workers/training/custom_loss_graph.py)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from queue_tinker.errors import UserInputError
from queue_tinker.gateway.auth import TenantDep
from queue_tinker.gateway.queue_access import GatewayQueue, QueueDep, new_request_id
from queue_tinker.store import custom_losses
from queue_tinker.types import JobStatus, codec
from queue_tinker.types.requests.custom_loss import CustomLoss, check_loss
from queue_tinker.types.validation import validated

# The kind of a job the gateway answers itself: its result is the JSON to send back.
GATEWAY_ANSWERED = "gateway"
MAX_CACHED = 10_000

router = APIRouter(prefix="/api/v1")


class CreateCustomLossRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: str
    custom_loss_seq_id: int
    name: str
    inputs: list[dict[str, Any]]
    graph: dict[str, Any]


@router.post("/create_custom_loss")
async def create_custom_loss(
    body: CreateCustomLossRequest, request: Request, gq: QueueDep, tenant: TenantDep
) -> dict[str, Any]:
    """Check the loss, store it, and answer a future that is already done: {"loss_id"}."""
    session_id = await gq.session_of(body.session_id, tenant)
    loss = validated(
        CustomLoss,
        "",
        {
            "loss_id": f"{session_id}:loss:{body.custom_loss_seq_id}",
            "name": body.name,
            "inputs": body.inputs,
            "graph": body.graph,
        },
    )
    check_loss(loss)
    stored = await custom_losses.save(
        request.app.state.sessions, loss, tenant_id=tenant, session_id=session_id
    )
    if stored != loss:
        raise UserInputError(
            f"custom_loss_seq_id: {body.custom_loss_seq_id} of session "
            f"{session_id} already names another loss"
        )
    request_id = new_request_id()
    await answered_job(
        gq,
        request_id,
        tenant,
        loss.loss_id,
        {"loss_id": loss.loss_id, "type": "create_custom_loss"},
    )
    return {"request_id": request_id}


async def answered_job(
    gq: GatewayQueue, request_id: str, tenant: str, model_id: str, answer: dict[str, Any]
) -> None:
    """A finished job whose answer the gateway gives itself (retrieve_future reads it)."""
    now = f"{time.time():.6f}"
    key = gq.keys.job(request_id)
    async with gq.redis.pipeline(transaction=True) as pipe:
        pipe.hset(
            key,
            mapping={
                "id": request_id,
                "tenant_id": tenant,
                "model_id": model_id,
                "kind": GATEWAY_ANSWERED,
                "status": JobStatus.DONE.value,
                "queued_at": now,
                "finished_at": now,
                "result": codec.encode(answer),
            },
        )
        pipe.expire(key, gq.settings.result_ttl_s)
        await pipe.execute()


async def custom_loss_for(
    request: Request, tenant: str, model_id: str, loss_id: str | None
) -> CustomLoss | None:
    """The uploaded loss a forward_backward names, if it is the tenant's and of the model's
    session; UserInputError naming loss_id otherwise."""
    if loss_id is None:
        return None
    cache = _cache(request)
    found = cache.get((tenant, loss_id)) or await custom_losses.load(
        request.app.state.sessions, tenant, loss_id
    )
    session_id = model_id.split(":train:")[0]
    if found is None or found[1] != session_id:
        raise UserInputError(
            f"loss_fn_config.loss_id: no custom loss {loss_id!r} in session "
            f"{session_id} (create it with create_custom_loss)"
        )
    if len(cache) >= MAX_CACHED:
        cache.clear()
    cache[(tenant, loss_id)] = found  # a stored loss never changes: no Postgres read per step
    return found[0]


def _cache(request: Request) -> dict[tuple[str, str], tuple[CustomLoss, str]]:
    """(tenant, loss_id) -> (loss, session id), kept by the app."""
    state = request.app.state
    if not hasattr(state, "custom_losses"):
        state.custom_losses = {}
    found: dict[tuple[str, str], tuple[CustomLoss, str]] = state.custom_losses
    return found
