"""Read queries of the dashboard: recent requests, training runs with their loss, checkpoints.

Every function takes `tenant`: a tenant id limits the answer to that tenant's rows (another
tenant's row reads exactly like a missing one); None is an admin's view of every tenant.
Rows come back as plain dicts of JSON-able values (times as epoch seconds), so the gateway
only wraps them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Float, Select, and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import InstrumentedAttribute

from queue_tinker.store.models import CheckpointRow, RequestRow, TrainingRunRow
from queue_tinker.store.queries import listed_checkpoint
from queue_tinker.types.enums import CheckpointKind, JobStatus, OpKind

LOSS_METRIC = "loss:sum"  # what the worker's losses always report (workers/training/losses.py)
MAX_CURVE_POINTS = 5_000  # the newest ones; an SVG path of more says nothing more


def epoch(moment: datetime | None) -> float | None:
    return round(moment.timestamp(), 3) if moment else None


def _scoped(
    query: Select[Any], column: InstrumentedAttribute[str], tenant: str | None
) -> Select[Any]:
    return query if tenant is None else query.where(column == tenant)


def _seconds(end: datetime | None, start: datetime | None) -> float | None:
    return round((end - start).total_seconds(), 4) if end and start else None


def request_row(row: RequestRow, *, detail: bool = False) -> dict[str, Any]:
    """A request as the dashboard shows it; the traceback and metrics only with `detail`."""
    out: dict[str, Any] = {
        "id": row.id,
        "model_id": row.model_id,
        "tenant_id": row.tenant_id,
        "seq": row.seq,
        "kind": row.kind,
        "status": row.status,
        "worker_id": row.worker_id,
        "attempts": row.attempts,
        "queued_at": epoch(row.queued_at),
        "started_at": epoch(row.started_at),
        "finished_at": epoch(row.finished_at),
        "latency_s": _seconds(row.finished_at, row.queued_at),  # what the client waited
        "run_s": _seconds(row.finished_at, row.started_at),  # what the worker spent
        "error": row.error,
        "error_category": row.error_category,
        "has_detail": bool(row.error_detail),
    }
    if detail:
        out["error_detail"] = row.error_detail
        out["metrics"] = row.metrics
    return out


async def recent_requests(
    sessions: async_sessionmaker[AsyncSession],
    tenant: str | None,
    *,
    limit: int,
    status: str | None = None,
    model_id: str | None = None,
    kind: str | None = None,
) -> list[dict[str, Any]]:
    """The newest requests (by queued_at), optionally of one status, model and kind."""
    query = _scoped(select(RequestRow), RequestRow.tenant_id, tenant)
    if status:
        query = query.where(RequestRow.status == JobStatus(status).value)
    if kind:
        query = query.where(RequestRow.kind == OpKind(kind).value)
    if model_id:
        query = query.where(RequestRow.model_id == model_id)
    query = query.order_by(RequestRow.queued_at.desc(), RequestRow.id).limit(limit)
    async with sessions() as session:
        return [request_row(row) for row in await session.scalars(query)]


async def request_detail(
    sessions: async_sessionmaker[AsyncSession], tenant: str | None, request_id: str
) -> dict[str, Any] | None:
    """One request with its traceback (error_detail) and metrics, or None."""
    query = _scoped(
        select(RequestRow).where(RequestRow.id == request_id), RequestRow.tenant_id, tenant
    )
    async with sessions() as session:
        row = await session.scalar(query)
    return request_row(row, detail=True) if row else None


def _loss_value() -> Any:
    return RequestRow.metrics[LOSS_METRIC].astext.cast(Float)


async def run_summaries(
    sessions: async_sessionmaker[AsyncSession], tenant: str | None, *, limit: int
) -> list[dict[str, Any]]:
    """The most recently active training runs with their step count (optim_steps done),
    forward_backward count, failed ops and last loss."""
    active = func.coalesce(TrainingRunRow.last_request_at, TrainingRunRow.created_at)
    runs_query = _scoped(select(TrainingRunRow), TrainingRunRow.tenant_id, tenant)
    runs_query = runs_query.order_by(active.desc(), TrainingRunRow.id).limit(limit)
    done = RequestRow.status == JobStatus.DONE.value
    counts_query = select(
        RequestRow.model_id,
        func.count().filter(and_(RequestRow.kind == OpKind.OPTIM_STEP.value, done)),
        func.count().filter(and_(RequestRow.kind == OpKind.FORWARD_BACKWARD.value, done)),
        func.count().filter(RequestRow.status == JobStatus.FAILED.value),
        func.count().filter(
            RequestRow.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value))
        ),
    ).group_by(RequestRow.model_id)
    # The newest recorded loss of each run: DISTINCT ON picks one row per model, highest seq.
    last_loss_query = (
        select(RequestRow.model_id, _loss_value())
        .where(
            RequestRow.kind == OpKind.FORWARD_BACKWARD.value,
            done,
            RequestRow.metrics.has_key(LOSS_METRIC),
        )
        .distinct(RequestRow.model_id)
        .order_by(RequestRow.model_id, RequestRow.seq.desc())
    )
    async with sessions() as session:
        runs = list(await session.scalars(runs_query))
        ids = [run.id for run in runs]
        counts = (
            {
                row[0]: row[1:]
                for row in await session.execute(counts_query.where(RequestRow.model_id.in_(ids)))
            }
            if ids
            else {}
        )
        losses: dict[str, float] = (
            dict(
                (await session.execute(last_loss_query.where(RequestRow.model_id.in_(ids))))
                .tuples()
                .all()
            )
            if ids
            else {}
        )
    out = []
    for run in runs:
        steps, fwd_bwd, failed, pending = counts.get(run.id, (0, 0, 0, 0))
        out.append(
            {
                "id": run.id,
                "tenant_id": run.tenant_id,
                "base_model": run.base_model,
                "rank": (run.lora_config or {}).get("rank"),
                "created_at": epoch(run.created_at),
                "last_request_at": epoch(run.last_request_at),
                "steps": steps,
                "forward_backward": fwd_bwd,
                "failed": failed,
                "pending": pending,
                "last_loss": losses.get(run.id),
            }
        )
    return out


async def run_visible(
    sessions: async_sessionmaker[AsyncSession], tenant: str | None, run_id: str
) -> bool:
    """Whether the run exists (and is the tenant's)."""
    query = _scoped(
        select(TrainingRunRow.id).where(TrainingRunRow.id == run_id),
        TrainingRunRow.tenant_id,
        tenant,
    )
    async with sessions() as session:
        return await session.scalar(query) is not None


async def loss_curve(
    sessions: async_sessionmaker[AsyncSession], run_id: str
) -> list[dict[str, Any]]:
    """The run's recorded losses in seq order: one point per finished forward_backward, with
    `step`, the optimizer steps done before it (the x axis of a training loop)."""
    query = (
        select(RequestRow.seq, RequestRow.kind, _loss_value())
        .where(
            RequestRow.model_id == run_id,
            RequestRow.status == JobStatus.DONE.value,
            or_(
                RequestRow.kind == OpKind.OPTIM_STEP.value,
                and_(
                    RequestRow.kind == OpKind.FORWARD_BACKWARD.value,
                    RequestRow.metrics.has_key(LOSS_METRIC),
                ),
            ),
        )
        .order_by(RequestRow.seq)
    )
    points: list[dict[str, Any]] = []
    steps = 0
    async with sessions() as session:
        for seq, kind, loss in await session.execute(query):
            if kind == OpKind.OPTIM_STEP.value:
                steps += 1
            else:
                points.append({"seq": seq, "step": steps, "loss": loss})
    return points[-MAX_CURVE_POINTS:]


async def checkpoints(
    sessions: async_sessionmaker[AsyncSession],
    tenant: str | None,
    *,
    limit: int,
    run_id: str | None = None,
) -> list[dict[str, Any]]:
    """The newest live checkpoints (of one run, if given)."""
    query = _scoped(
        select(CheckpointRow).where(listed_checkpoint()), CheckpointRow.tenant_id, tenant
    )
    if run_id:
        query = query.where(CheckpointRow.model_id == run_id)
    query = query.order_by(CheckpointRow.created_at.desc(), CheckpointRow.id).limit(limit)
    async with sessions() as session:
        rows = list(await session.scalars(query))
    return [
        {
            "tinker_path": row.id,  # a checkpoint's id is its tinker:// path
            "checkpoint_id": f"{CheckpointKind(row.kind).path_segment}/{row.name}",
            "run_id": row.model_id,
            "tenant_id": row.tenant_id,
            "name": row.name,
            "kind": row.kind,
            "size_bytes": row.size_bytes,
            "created_at": epoch(row.created_at),
            "expires_at": epoch(row.expires_at),
        }
        for row in rows
    ]


async def request_tenant(sessions: async_sessionmaker[AsyncSession], request_id: str) -> str | None:
    """The tenant of a recorded request, or None if there is no such request."""
    async with sessions() as session:
        return await session.scalar(select(RequestRow.tenant_id).where(RequestRow.id == request_id))
