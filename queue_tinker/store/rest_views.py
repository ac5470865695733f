"""The REST answers built from the Postgres record (docs/tinker-http-protocol.md, 7.1): JSON
shapes the gateway sends as they are and the Python client's RestClient reads into
queue_tinker.types.service.rest. Every read is scoped to one tenant: another tenant's id reads as
missing (None)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.store import queries
from queue_tinker.store.models import CheckpointRow, TrainingRunRow
from queue_tinker.types.enums import CheckpointKind

Sessions = async_sessionmaker[AsyncSession]
_CHECKPOINT_TYPES = {
    CheckpointKind.STATE: "training",
    CheckpointKind.SAMPLER: "sampler",
    CheckpointKind.EXTERNAL: "external",
}


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    kind = CheckpointKind(row.kind)
    return {
        "checkpoint_id": f"{kind.path_segment}/{row.name}",
        "checkpoint_type": _CHECKPOINT_TYPES[kind],
        "time": _iso(row.created_at),
        "tinker_path": row.id,
        "size_bytes": row.size_bytes,
        "public": row.public,
        "expires_at": _iso(row.expires_at),
    }


def training_run_json(
    run: TrainingRunRow, newest: dict[tuple[str, str], CheckpointRow]
) -> dict[str, Any]:
    """`newest`: (run id, kind) -> newest live checkpoint (queries.newest_checkpoints)."""
    state = newest.get((run.id, CheckpointKind.STATE.value))
    sampler = newest.get((run.id, CheckpointKind.SAMPLER.value))
    return {
        "training_run_id": run.id,
        "base_model": run.base_model,
        "model_owner": run.tenant_id,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": run.lora_config.get("rank"),
        "last_request_time": _iso(run.last_request_at or run.created_at),
        "last_checkpoint": checkpoint_json(state) if state else None,
        "last_sampler_checkpoint": checkpoint_json(sampler) if sampler else None,
        "user_metadata": run.user_metadata,
    }


async def training_run(db: Sessions, tenant: str, run_id: str) -> dict[str, Any] | None:
    run = await queries.get_tenant_training_run(db, tenant, run_id)
    if run is None:
        return None
    return training_run_json(run, await queries.newest_checkpoints(db, [run.id]))


async def training_runs(db: Sessions, tenant: str, limit: int, offset: int) -> dict[str, Any]:
    """The tenant's runs, newest first."""
    runs, total = await queries.list_training_runs(db, tenant, limit=limit, offset=offset)
    newest = await queries.newest_checkpoints(db, [r.id for r in runs])
    return {
        "training_runs": [training_run_json(r, newest) for r in runs],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


async def run_checkpoints(db: Sessions, tenant: str, run_id: str) -> dict[str, Any] | None:
    if await queries.get_tenant_training_run(db, tenant, run_id) is None:
        return None
    rows = await queries.checkpoints_of_run(db, tenant, run_id)
    return {"checkpoints": [checkpoint_json(row) for row in rows], "cursor": None}


async def user_checkpoints(db: Sessions, tenant: str, limit: int, offset: int) -> dict[str, Any]:
    rows, total = await queries.tenant_checkpoints(db, tenant, limit=limit, offset=offset)
    return {
        "checkpoints": [checkpoint_json(row) for row in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


async def weights_info(db: Sessions, tenant: str, path: str, run_id: str) -> dict[str, Any] | None:
    """The LoRA config behind a live checkpoint of the tenant's."""
    row = await queries.get_live_checkpoint(db, tenant, path)
    run = await queries.get_tenant_training_run(db, tenant, run_id) if row else None
    if run is None:
        return None
    config = run.lora_config
    return {
        "base_model": run.base_model,
        "is_lora": True,
        "lora_rank": config.get("rank"),
        "train_unembed": config.get("train_unembed"),
        "train_mlp": config.get("train_mlp"),
        "train_attn": config.get("train_attn"),
    }
