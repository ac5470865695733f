"""Reads behind the Tinker protocol's account and session-search routes: a tenant's checkpoint
storage, its checkpoint audit events, its sessions with their checkpoints, and one session's
requests (its trace). Every query takes the tenant, like queries.py's REST view."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import and_, func, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.store.models import Checkpoint, Request, SamplingSession, Session, TrainingRun
from queue_tinker.store.queries import live_checkpoint

MAX_AUDIT_ENTRIES = 10_000


@dataclass(frozen=True)
class SessionSummary:
    id: str
    tenant_id: str
    created_at: datetime
    checkpoints: int
    checkpoint_bytes: int


async def checkpoint_storage(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str
) -> tuple[int, int]:
    """(count, bytes) of the tenant's live checkpoints."""
    async with sessions() as session:
        row = (
            await session.execute(
                select(func.count(), func.coalesce(func.sum(Checkpoint.size_bytes), 0)).where(
                    Checkpoint.tenant_id == tenant_id, live_checkpoint()
                )
            )
        ).one()
    return int(row[0]), int(row[1])


async def checkpoint_events(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, day: date | None
) -> list[tuple[datetime, str, Checkpoint]]:
    """(when, 'checkpoint_create' | 'checkpoint_delete', checkpoint) of the tenant, oldest
    first; with `day`, only that UTC day's."""
    where = [Checkpoint.tenant_id == tenant_id]
    start = datetime.combine(day or date.min, time(), tzinfo=UTC)
    end = start + timedelta(days=1) if day is not None else datetime.max.replace(tzinfo=UTC)
    if day is not None:
        where.append(
            or_(
                Checkpoint.created_at.between(start, end), Checkpoint.deleted_at.between(start, end)
            )
        )
    async with sessions() as session:
        rows = list(
            await session.scalars(
                select(Checkpoint)
                .where(*where)
                .order_by(Checkpoint.created_at, Checkpoint.id)
                .limit(MAX_AUDIT_ENTRIES)
            )
        )
    events = []
    for row in rows:
        for moment, event in (
            (row.created_at, "checkpoint_create"),
            (row.deleted_at, "checkpoint_delete"),
        ):
            if moment is not None and start <= moment < end:
                events.append((moment, event, row))
    return sorted(events, key=lambda e: (e[0], e[2].id))


async def search_sessions(
    sessions: async_sessionmaker[AsyncSession],
    tenant_id: str,
    *,
    session_id: str | None,
    after: tuple[datetime, str] | None,
    limit: int,
) -> list[SessionSummary]:
    """A page of the tenant's sessions, newest first (then by id, descending), each with its
    runs' live checkpoints; `after` is the (created_at, id) of the previous page's last."""
    where = [Session.tenant_id == tenant_id]
    if session_id is not None:
        where.append(Session.id == session_id)
    if after is not None:
        where.append(tuple_(Session.created_at, Session.id) < tuple_(*after))
    stored = (
        select(
            TrainingRun.session_id.label("session_id"),
            func.count(Checkpoint.id).label("count"),
            func.coalesce(func.sum(Checkpoint.size_bytes), 0).label("bytes"),
        )
        .join(Checkpoint, and_(Checkpoint.model_id == TrainingRun.id, live_checkpoint()))
        .where(TrainingRun.tenant_id == tenant_id)
        .group_by(TrainingRun.session_id)
        .subquery()
    )
    async with sessions() as session:
        rows = (
            await session.execute(
                select(Session, stored.c.count, stored.c.bytes)
                .outerjoin(stored, stored.c.session_id == Session.id)
                .where(*where)
                .order_by(Session.created_at.desc(), Session.id.desc())
                .limit(limit)
            )
        ).all()
    return [
        SessionSummary(
            id=s.id,
            tenant_id=s.tenant_id,
            created_at=s.created_at,
            checkpoints=int(count or 0),
            checkpoint_bytes=int(size or 0),
        )
        for s, count, size in rows
    ]


async def session_requests(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, session_id: str
) -> list[Request] | None:
    """Every recorded request of the session's runs and samplers, by time queued; None if the
    tenant has no such session."""
    async with sessions() as session:
        found = await session.scalar(
            select(Session.id).where(Session.id == session_id, Session.tenant_id == tenant_id)
        )
        if found is None:
            return None
        models = (
            select(TrainingRun.id)
            .where(TrainingRun.session_id == session_id)
            .union(select(SamplingSession.id).where(SamplingSession.session_id == session_id))
        )
        rows = await session.scalars(
            select(Request)
            .where(Request.tenant_id == tenant_id, Request.model_id.in_(models))
            .order_by(Request.queued_at, Request.id)
        )
        return list(rows)


async def set_checkpoint_public(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, checkpoint_id: str, public: bool
) -> bool:
    """Publish (or not) one of the tenant's live checkpoints; False if there is none."""
    async with sessions() as session, session.begin():
        updated = await session.execute(
            update(Checkpoint)
            .where(
                Checkpoint.id == checkpoint_id, Checkpoint.tenant_id == tenant_id, live_checkpoint()
            )
            .values(public=public)
            .returning(Checkpoint.id)
        )
        return updated.first() is not None
