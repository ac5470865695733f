"""Read helpers over the durable record (CLI, gateway, tests)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.sql.elements import ColumnElement

from queue_tinker.store.models import Checkpoint, Request, SamplingSession, Session, TrainingRun
from queue_tinker.types.enums import JobStatus


async def get_request(sessions: async_sessionmaker[AsyncSession], id: str) -> Request | None:
    """The request row with this id, or None."""
    async with sessions() as session:
        return await session.get(Request, id)


async def requests_for_model(
    sessions: async_sessionmaker[AsyncSession], model_id: str
) -> list[Request]:
    """Every recorded request of a model, in sequence order."""
    async with sessions() as session:
        rows = await session.scalars(
            select(Request).where(Request.model_id == model_id).order_by(Request.seq)
        )
        return list(rows)


async def count_requests_by_status(sessions: async_sessionmaker[AsyncSession]) -> dict[str, int]:
    """Number of requests in each status; every JobStatus is present, zero when none."""
    counts = {status.value: 0 for status in JobStatus}
    async with sessions() as session:
        result = await session.execute(
            select(Request.status, func.count()).group_by(Request.status)
        )
        counts.update({status: count for status, count in result})
    return counts


async def get_training_run(
    sessions: async_sessionmaker[AsyncSession], id: str
) -> TrainingRun | None:
    """The training run (model) with this id, or None."""
    async with sessions() as session:
        return await session.get(TrainingRun, id)


# --- the REST view of a tenant's runs, checkpoints, sessions and samplers --------------------
# Every lookup below takes the tenant: another tenant's row reads exactly like a missing one.


def live_checkpoint() -> ColumnElement[bool]:
    """A checkpoint the user can still use: files not removed and its TTL not run out (the
    housekeeper may not have got to it yet)."""
    return and_(
        Checkpoint.deleted_at.is_(None),
        or_(Checkpoint.expires_at.is_(None), Checkpoint.expires_at > func.now()),
    )


def listed_checkpoint() -> ColumnElement[bool]:
    """A live checkpoint the user saved (not the unnamed weights behind a sampling client)."""
    return and_(live_checkpoint(), Checkpoint.ephemeral.is_(False))


async def list_training_runs(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, *, limit: int, offset: int
) -> tuple[list[TrainingRun], int]:
    """A page of the tenant's training runs, newest first, and how many there are in all."""
    owned = TrainingRun.tenant_id == tenant_id
    async with sessions() as session:
        total = await session.scalar(select(func.count()).select_from(TrainingRun).where(owned))
        rows = await session.scalars(
            select(TrainingRun)
            .where(owned)
            .order_by(TrainingRun.created_at.desc(), TrainingRun.id)
            .limit(limit)
            .offset(offset)
        )
        return list(rows), int(total or 0)


async def get_tenant_training_run(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, run_id: str
) -> TrainingRun | None:
    """The tenant's training run with this id, or None (also when another tenant owns it)."""
    async with sessions() as session:
        return await session.scalar(
            select(TrainingRun).where(TrainingRun.id == run_id, TrainingRun.tenant_id == tenant_id)
        )


async def newest_checkpoints(
    sessions: async_sessionmaker[AsyncSession], run_ids: Sequence[str]
) -> dict[tuple[str, str], Checkpoint]:
    """(run id, kind) -> the run's newest live checkpoint of that kind, for every run given."""
    if not run_ids:
        return {}
    # The first row of each (run, kind) by recency; a window rather than DISTINCT ON, whose
    # SQLAlchemy spelling changed in 2.1 (the old one warns).
    rank = (
        func.row_number()
        .over(
            partition_by=(Checkpoint.model_id, Checkpoint.kind),
            order_by=(Checkpoint.created_at.desc(), Checkpoint.id.desc()),
        )
        .label("rank")
    )
    ranked = (
        select(Checkpoint.id, rank)
        .where(Checkpoint.model_id.in_(run_ids), listed_checkpoint())
        .subquery()
    )
    async with sessions() as session:
        rows = await session.scalars(
            select(Checkpoint).join(ranked, ranked.c.id == Checkpoint.id).where(ranked.c.rank == 1)
        )
        return {(row.model_id, row.kind): row for row in rows}


async def run_checkpoints(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, run_id: str
) -> list[Checkpoint]:
    """The live checkpoints of one of the tenant's runs, newest first."""
    async with sessions() as session:
        rows = await session.scalars(
            select(Checkpoint)
            .where(
                Checkpoint.model_id == run_id,
                Checkpoint.tenant_id == tenant_id,
                listed_checkpoint(),
            )
            .order_by(Checkpoint.created_at.desc(), Checkpoint.id)
        )
        return list(rows)


async def tenant_checkpoints(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, *, limit: int, offset: int
) -> tuple[list[Checkpoint], int]:
    """A page of the tenant's live checkpoints over all its runs, newest first, and the total."""
    where = (Checkpoint.tenant_id == tenant_id, listed_checkpoint())
    async with sessions() as session:
        total = await session.scalar(select(func.count()).select_from(Checkpoint).where(*where))
        rows = await session.scalars(
            select(Checkpoint)
            .where(*where)
            .order_by(Checkpoint.created_at.desc(), Checkpoint.id)
            .limit(limit)
            .offset(offset)
        )
        return list(rows), int(total or 0)


async def get_live_checkpoint(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, checkpoint_id: str
) -> Checkpoint | None:
    """The tenant's live checkpoint with this tinker:// id, or None."""
    async with sessions() as session:
        return await session.scalar(
            select(Checkpoint).where(
                Checkpoint.id == checkpoint_id, Checkpoint.tenant_id == tenant_id, live_checkpoint()
            )
        )


async def get_readable_checkpoint(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, checkpoint_id: str
) -> Checkpoint | None:
    """A live checkpoint the tenant may read: its own, or one published (readable by every
    tenant); None otherwise, so another tenant's private one reads like a missing one."""
    async with sessions() as session:
        return await session.scalar(
            select(Checkpoint).where(
                Checkpoint.id == checkpoint_id,
                or_(Checkpoint.tenant_id == tenant_id, Checkpoint.public.is_(True)),
                live_checkpoint(),
            )
        )


async def list_session_ids(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, *, limit: int, offset: int
) -> list[str]:
    """A page of the tenant's session ids, newest first."""
    async with sessions() as session:
        rows = await session.scalars(
            select(Session.id)
            .where(Session.tenant_id == tenant_id)
            .order_by(Session.created_at.desc(), Session.id)
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
            select(Session.id).where(Session.id == session_id, Session.tenant_id == tenant_id)
        )
        if found is None:
            return None
        runs = await session.scalars(
            select(TrainingRun.id)
            .where(TrainingRun.session_id == session_id, TrainingRun.tenant_id == tenant_id)
            .order_by(TrainingRun.created_at, TrainingRun.id)
        )
        samplers = await session.scalars(
            select(SamplingSession.id)
            .where(SamplingSession.session_id == session_id, SamplingSession.tenant_id == tenant_id)
            .order_by(SamplingSession.created_at, SamplingSession.id)
        )
        return list(runs), list(samplers)


async def get_sampling_session(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, sampler_id: str
) -> SamplingSession | None:
    """The tenant's sampling session with this id, or None."""
    async with sessions() as session:
        return await session.scalar(
            select(SamplingSession).where(
                SamplingSession.id == sampler_id, SamplingSession.tenant_id == tenant_id
            )
        )
