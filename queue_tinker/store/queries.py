"""Read helpers over the durable record (CLI, gateway, tests)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.sql.elements import ColumnElement

from queue_tinker.store.models import (
    CheckpointRow,
    RequestRow,
    SamplingSessionRow,
    SessionRow,
    TrainingRunRow,
)
from queue_tinker.types.enums import JobStatus


async def get_request(sessions: async_sessionmaker[AsyncSession], id: str) -> RequestRow | None:
    """The request row with this id, or None."""
    async with sessions() as session:
        return await session.get(RequestRow, id)


async def requests_for_model(
    sessions: async_sessionmaker[AsyncSession], model_id: str
) -> list[RequestRow]:
    """Every recorded request of a model, in sequence order."""
    async with sessions() as session:
        rows = await session.scalars(
            select(RequestRow).where(RequestRow.model_id == model_id).order_by(RequestRow.seq)
        )
        return list(rows)


async def count_requests_by_status(sessions: async_sessionmaker[AsyncSession]) -> dict[str, int]:
    """Number of requests in each status; every JobStatus is present, zero when none."""
    counts = {status.value: 0 for status in JobStatus}
    async with sessions() as session:
        result = await session.execute(
            select(RequestRow.status, func.count()).group_by(RequestRow.status)
        )
        counts.update({status: count for status, count in result})
    return counts


async def get_training_run(
    sessions: async_sessionmaker[AsyncSession], id: str
) -> TrainingRunRow | None:
    """The training run (model) with this id, or None."""
    async with sessions() as session:
        return await session.get(TrainingRunRow, id)


# --- the REST view of a tenant's runs, checkpoints, sessions and samplers --------------------
# Every lookup below takes the tenant: another tenant's row reads exactly like a missing one.


def live_checkpoint() -> ColumnElement[bool]:
    """A checkpoint the user can still use: files not removed and its TTL not run out (the
    housekeeper may not have got to it yet)."""
    return and_(
        CheckpointRow.deleted_at.is_(None),
        or_(CheckpointRow.expires_at.is_(None), CheckpointRow.expires_at > func.now()),
    )


def listed_checkpoint() -> ColumnElement[bool]:
    """A live checkpoint the user saved (not the unnamed weights behind a sampling client)."""
    return and_(live_checkpoint(), CheckpointRow.ephemeral.is_(False))


async def list_training_runs(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, *, limit: int, offset: int
) -> tuple[list[TrainingRunRow], int]:
    """A page of the tenant's training runs, newest first, and how many there are in all."""
    owned = TrainingRunRow.tenant_id == tenant_id
    async with sessions() as session:
        total = await session.scalar(select(func.count()).select_from(TrainingRunRow).where(owned))
        rows = await session.scalars(
            select(TrainingRunRow)
            .where(owned)
            .order_by(TrainingRunRow.created_at.desc(), TrainingRunRow.id)
            .limit(limit)
            .offset(offset)
        )
        return list(rows), int(total or 0)


async def get_tenant_training_run(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, run_id: str
) -> TrainingRunRow | None:
    """The tenant's training run with this id, or None (also when another tenant owns it)."""
    async with sessions() as session:
        return await session.scalar(
            select(TrainingRunRow).where(
                TrainingRunRow.id == run_id, TrainingRunRow.tenant_id == tenant_id
            )
        )


async def newest_checkpoints(
    sessions: async_sessionmaker[AsyncSession], run_ids: Sequence[str]
) -> dict[tuple[str, str], CheckpointRow]:
    """(run id, kind) -> the run's newest live checkpoint of that kind, for every run given."""
    if not run_ids:
        return {}
    # The first row of each (run, kind) by recency; a window rather than DISTINCT ON, whose
    # SQLAlchemy spelling changed in 2.1 (the old one warns).
    rank = (
        func.row_number()
        .over(
            partition_by=(CheckpointRow.model_id, CheckpointRow.kind),
            order_by=(CheckpointRow.created_at.desc(), CheckpointRow.id.desc()),
        )
        .label("rank")
    )
    ranked = (
        select(CheckpointRow.id, rank)
        .where(CheckpointRow.model_id.in_(run_ids), listed_checkpoint())
        .subquery()
    )
    async with sessions() as session:
        rows = await session.scalars(
            select(CheckpointRow)
            .join(ranked, ranked.c.id == CheckpointRow.id)
            .where(ranked.c.rank == 1)
        )
        return {(row.model_id, row.kind): row for row in rows}


async def checkpoints_of_run(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, run_id: str
) -> list[CheckpointRow]:
    """The live checkpoints of one of the tenant's runs, newest first."""
    async with sessions() as session:
        rows = await session.scalars(
            select(CheckpointRow)
            .where(
                CheckpointRow.model_id == run_id,
                CheckpointRow.tenant_id == tenant_id,
                listed_checkpoint(),
            )
            .order_by(CheckpointRow.created_at.desc(), CheckpointRow.id)
        )
        return list(rows)


async def tenant_checkpoints(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, *, limit: int, offset: int
) -> tuple[list[CheckpointRow], int]:
    """A page of the tenant's live checkpoints over all its runs, newest first, and the total."""
    where = (CheckpointRow.tenant_id == tenant_id, listed_checkpoint())
    async with sessions() as session:
        total = await session.scalar(select(func.count()).select_from(CheckpointRow).where(*where))
        rows = await session.scalars(
            select(CheckpointRow)
            .where(*where)
            .order_by(CheckpointRow.created_at.desc(), CheckpointRow.id)
            .limit(limit)
            .offset(offset)
        )
        return list(rows), int(total or 0)


async def get_live_checkpoint(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, checkpoint_id: str
) -> CheckpointRow | None:
    """The tenant's live checkpoint with this tinker:// id, or None."""
    async with sessions() as session:
        return await session.scalar(
            select(CheckpointRow).where(
                CheckpointRow.id == checkpoint_id,
                CheckpointRow.tenant_id == tenant_id,
                live_checkpoint(),
            )
        )


async def get_readable_checkpoint(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, checkpoint_id: str
) -> CheckpointRow | None:
    """A live checkpoint the tenant may read: its own, or one published (readable by every
    tenant); None otherwise, so another tenant's private one reads like a missing one."""
    async with sessions() as session:
        return await session.scalar(
            select(CheckpointRow).where(
                CheckpointRow.id == checkpoint_id,
                or_(CheckpointRow.tenant_id == tenant_id, CheckpointRow.public.is_(True)),
                live_checkpoint(),
            )
        )


async def list_session_ids(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, *, limit: int, offset: int
) -> list[str]:
    """A page of the tenant's session ids, newest first."""
    async with sessions() as session:
        rows = await session.scalars(
            select(SessionRow.id)
            .where(SessionRow.tenant_id == tenant_id)
            .order_by(SessionRow.created_at.desc(), SessionRow.id)
            .limit(limit)
            .offset(offset)
        )
        return list(rows)


async def session_members(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, session_id: str
) -> tuple[list[str], list[str]] | None:
    """(training run ids, sampler ids) of one of the tenant's sessions, oldest first; None if
    the tenant has no such session."""
    async with sessions() as session:
        found = await session.scalar(
            select(SessionRow.id).where(
                SessionRow.id == session_id, SessionRow.tenant_id == tenant_id
            )
        )
        if found is None:
            return None
        runs = await session.scalars(
            select(TrainingRunRow.id)
            .where(TrainingRunRow.session_id == session_id, TrainingRunRow.tenant_id == tenant_id)
            .order_by(TrainingRunRow.created_at, TrainingRunRow.id)
        )
        samplers = await session.scalars(
            select(SamplingSessionRow.id)
            .where(
                SamplingSessionRow.session_id == session_id,
                SamplingSessionRow.tenant_id == tenant_id,
            )
            .order_by(SamplingSessionRow.created_at, SamplingSessionRow.id)
        )
        return list(runs), list(samplers)


async def get_sampling_session(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, sampler_id: str
) -> SamplingSessionRow | None:
    """The tenant's sampling session with this id, or None."""
    async with sessions() as session:
        return await session.scalar(
            select(SamplingSessionRow).where(
                SamplingSessionRow.id == sampler_id, SamplingSessionRow.tenant_id == tenant_id
            )
        )
