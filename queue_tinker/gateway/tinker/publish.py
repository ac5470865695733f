"""Publishing checkpoints (docs/tinker-http-protocol.md, section 12): a published checkpoint
is readable by every tenant of the deployment: any tenant may sample from it
(create_sampling_client(model_path=...)) or start a run from it
(create_training_client_from_state*). Only its owner publishes or unpublishes it.

Three places say so, each for its reader: the checkpoint's meta file (the workers that load
it), a Redis key (the gateway, before it opens a run or sampling session on it) and the
Postgres row (listings). Publishing writes them in that order and unpublishing in the
reverse one, so the gateway never lets a tenant in that a worker would then refuse.
Sampling sessions already open on a checkpoint keep its weights after it is unpublished.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request

from queue_tinker.gateway.auth import tenant_of
from queue_tinker.gateway.queue_access import not_found
from queue_tinker.gateway.tinker.rest import checkpoint_tinker_path
from queue_tinker.store import checkpoints, protocol_queries, queries
from queue_tinker.store.models import CheckpointRow

router = APIRouter(prefix="/api/v1")
PUBLISH = "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish"


@router.post(PUBLISH)
async def publish(
    run_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tenant_of)
) -> dict[str, Any]:
    row = await _owned(request, tenant, run_id, checkpoint_id)
    await _set_meta(request, row, True)
    await request.app.state.redis.set(_key(request, row), run_id)
    await _set_row(request, tenant, row, True)
    return {}


@router.delete(PUBLISH)
async def unpublish(
    run_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tenant_of)
) -> dict[str, Any]:
    row = await _owned(request, tenant, run_id, checkpoint_id)
    await _set_row(request, tenant, row, False)
    await request.app.state.redis.delete(_key(request, row))
    await _set_meta(request, row, False)
    return {}


async def _owned(request: Request, tenant: str, run_id: str, checkpoint_id: str) -> CheckpointRow:
    path = checkpoint_tinker_path(run_id, checkpoint_id)
    sessions = request.app.state.sessions
    await request.app.state.gateway_queue.recorded()
    row = await queries.get_live_checkpoint(sessions, tenant, path)
    if row is None:
        raise not_found(f"checkpoint {checkpoint_id!r} of training run {run_id!r}")
    return row


def _key(request: Request, row: CheckpointRow) -> str:
    return str(request.app.state.gateway_queue.keys.published_checkpoint(row.id))


async def _set_meta(request: Request, row: CheckpointRow, public: bool) -> None:
    store = request.app.state.gateway_queue.store
    if not await asyncio.to_thread(checkpoints.set_meta_public, row.id, row.path, public, store):
        raise not_found(f"checkpoint {row.id!r}")


async def _set_row(request: Request, tenant: str, row: CheckpointRow, public: bool) -> None:
    if not await protocol_queries.set_checkpoint_public(
        request.app.state.sessions, tenant, row.id, public
    ):
        raise not_found(f"checkpoint {row.id!r}")
