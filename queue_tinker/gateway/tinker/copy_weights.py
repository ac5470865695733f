"""copy_weights (docs/tinker-http-protocol.md, section 12): a checkpoint the caller can read
(its own, or a published one) copied into the caller's tenant, as a new checkpoint of a new
training run that holds only it (no adapter is ever made for that run, so nothing trains on
it; it loads and samples like any checkpoint).

There are no projects here: a tenant's checkpoints are its own. The destination is the
caller's tenant, named by its id (what the SDK sends as destination_project_id, from
TINKER_PROJECT_ID or ServiceClient(project_id=...)); another project, a session's run slot or
a cross-account access token are refused naming the field.

The copy is written as a worker writes a checkpoint: files (hard links, so no bytes are
duplicated and the copy outlives the source), then the run's and the checkpoint's records,
written to Postgres before the answer, so listings show it at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from pydantic import BaseModel, ConfigDict

from queue_tinker.errors import UserInputError
from queue_tinker.gateway.auth import TenantDep
from queue_tinker.gateway.queue_access import GatewayQueue, QueueDep, not_found
from queue_tinker.gateway.tinker.rest import ttl_seconds
from queue_tinker.queue.control.expiry_jobs import schedule_expiry
from queue_tinker.store import checkpoints, queries
from queue_tinker.store.models import CheckpointRow
from queue_tinker.types.enums import CheckpointKind
from queue_tinker.types.service.checkpoints import CheckpointPath, loadable
from queue_tinker.types.service.records import CheckpointRecord

router = APIRouter(prefix="/api/v1")


class CopyWeightsRequest(BaseModel):
    """The SDK's CopyWeightsRequest (its weights_access_token travels as a header)."""

    model_config = ConfigDict(extra="ignore")

    source_path: str
    destination_project_id: str | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    ttl_seconds: int | None = None


@router.post("/copy_weights")
async def copy_weights(
    body: CopyWeightsRequest,
    request: Request,
    gq: QueueDep,
    tenant: TenantDep,
    access_token: Annotated[str | None, Header(alias="X-Tinker-Weights-Access-Token")] = None,
    idempotency_key: Annotated[str | None, Header(alias="X-Idempotency-Key")] = None,
) -> dict[str, Any]:
    """Copy `source_path` into the caller's tenant; {"tinker_path": the copy's path}. The SDK
    sends one idempotency key across its retries: a retry makes the same copy again."""
    _check_destination(body, tenant, access_token)
    ttl = ttl_seconds({"ttl_seconds": body.ttl_seconds})
    source = loadable(CheckpointPath.parse(body.source_path, "source_path"), "source_path")
    sessions = request.app.state.sessions
    await gq.recorded()
    row = await queries.get_readable_checkpoint(sessions, tenant, str(source))
    if row is None:
        raise not_found(
            f"source_path: checkpoint {str(source)!r} (unknown, expired, deleted, or another "
            "tenant's and not published)"
        )
    run = await queries.get_training_run(sessions, source.run_id)
    if run is None:  # a checkpoint row is written after its run's: not expected
        raise not_found(f"source_path: the training run of {str(source)!r}")
    copy = CheckpointPath(_copy_run_id(tenant, idempotency_key), source.kind, source.name)
    expires_at = time.time() + ttl if ttl is not None else None
    size = await _copy_files(gq, row, copy, tenant, expires_at)
    await gq.jobs.register_model(
        copy.run_id,
        base_model=run.base_model,
        tenant_id=tenant,
        session_id=None,
        lora_config=run.lora_config,
        user_metadata={"copied_from": str(source)},
    )
    await _record(gq, row, copy, tenant, size, expires_at)
    return {"tinker_path": str(copy)}


def _check_destination(body: CopyWeightsRequest, tenant: str, access_token: str | None) -> None:
    """What a self-hosted deployment does not offer, refused before anything is read."""
    if access_token is not None:
        raise UserInputError(
            "X-Tinker-Weights-Access-Token: cross-account access tokens are not offered here; "
            "ask the checkpoint's owner to publish it, then copy it with your own key"
        )
    if body.session_id is not None or body.model_seq_id is not None:
        raise UserInputError(
            "session_id, model_seq_id: a copy into a session's run slot is not offered here; "
            f"pass destination_project_id {tenant!r} (your tenant) instead"
        )
    if body.destination_project_id not in (None, tenant):
        raise UserInputError(
            f"destination_project_id: {body.destination_project_id!r} is not yours; this "
            f"service has no projects, a copy goes to your tenant {tenant!r}: pass that (the "
            f"SDK: copy_weights(path, {tenant!r}), or TINKER_PROJECT_ID={tenant})"
        )


def _copy_run_id(tenant: str, idempotency_key: str | None) -> str:
    """The run holding the copy: derived from the idempotency key, so a retried request writes
    the same copy instead of a second one."""
    if idempotency_key is None:
        return f"copy-{uuid.uuid4().hex}"
    return "copy-" + hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()[:32]


async def _copy_files(
    gq: GatewayQueue,
    row: CheckpointRow,
    copy: CheckpointPath,
    tenant: str,
    expires_at: float | None,
) -> int:
    try:
        return await asyncio.to_thread(
            checkpoints.copy_checkpoint_files,
            row.path,
            copy.storage_key,
            gq.store,
            model_id=copy.run_id,
            tenant_id=tenant,
            id=str(copy),
            public=False,
            created_at=time.time(),
            expires_at=expires_at,
        )
    except FileNotFoundError:  # removed since its row was read
        raise not_found(f"source_path: checkpoint {row.id!r}") from None


async def _record(
    gq: GatewayQueue,
    row: CheckpointRow,
    copy: CheckpointPath,
    tenant: str,
    size: int,
    expires_at: float | None,
) -> None:
    """The copy's row (and its run's, which register_model logged), in Postgres before the
    answer; its expiry scheduled as a worker's save schedules one."""
    location = gq.store.location(copy.storage_key)
    await gq.records.append(
        CheckpointRecord(
            id=str(copy),
            model_id=copy.run_id,
            tenant_id=tenant,
            name=copy.name,
            kind=CheckpointKind(row.kind),  # the column is text, checked against the enum
            path=location,
            size_bytes=size,
            created_at=time.time(),
            expires_at=expires_at,
        )
    )
    await gq.recorded()
    if expires_at is not None:
        settings = gq.settings
        await schedule_expiry(
            settings.redis_url or "", settings.key_prefix, str(copy), location, expires_at
        )
