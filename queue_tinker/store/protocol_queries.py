"""Reads behind the Tinker protocol's account and session-search routes: a tenant's checkpoint
storage, its checkpoint audit events, its sessions with their checkpoints, and one session's
requests (its trace). Every query takes the tenant, like queries.py's REST view."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import and_, func, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.store.models import (
    CheckpointRow,
    RequestRow,
    SamplingSessionRow,
    SessionRow,
    TrainingRunRow,
)
from queue_tinker.store.queries import live_checkpoint

MAX_AUDIT_ENTRIES = 10_000


@dataclass(frozen=True)
class SessionSummary:
    id: str
    tenant_id: str
    created_at: datetime
    checkpoints: int
    checkpoint_bytes: int


async def checkpoint_storage_used(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str
) -> tuple[int, int]:
    """(count, bytes) of the tenant's live checkpoints."""
    async with sessions() as session:
        row = (
            await session.execute(
                select(func.count(), func.coalesce(func.sum(CheckpointRow.size_bytes), 0)).where(
                    CheckpointRow.tenant_id == tenant_id, live_checkpoint()
                )
            )
        ).one()
    return int(row[0]), int(row[1])


async def checkpoint_events(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, day: date | None
) -> list[tuple[datetime, str, CheckpointRow]]:
    """(when, 'checkpoint_create' | 'checkpoint_delete', checkpoint) of the tenant, oldest
    first; with `day`, only that UTC day's."""
    where = [CheckpointRow.tenant_id == tenant_id]
    start = datetime.combine(day or date.min, time(), tzinfo=UTC)
    end = start + timedelta(days=1) if day is not None else datetime.max.replace(tzinfo=UTC)
    if day is not None:
        where.append(
            or_(
                CheckpointRow.created_at.between(start, end),
                CheckpointRow.deleted_at.between(start, end),
            )
        )
    async with sessions() as session:
        rows = list(
            await session.scalars(
                select(CheckpointRow)
                .where(*where)
                .order_by(CheckpointRow.created_at, CheckpointRow.id)
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


async def find_sessions(
    sessions: async_sessionmaker[AsyncSession],
    tenant_id: str,
    *,
    session_id: str | None,
    after: tuple[datetime, str] | None,
    limit: int,
) -> list[SessionSummary]:
    """A page of the tenant's sessions, newest first (then by id, descending), each with its
    runs' live checkpoints; `after` is the (created_at, id) of the previous page's last."""
    where = [SessionRow.tenant_id == tenant_id]
    if session_id is not None:
        where.append(SessionRow.id == session_id)
    if after is not None:
        where.append(tuple_(SessionRow.created_at, SessionRow.id) < tuple_(*after))
    stored = (
        select(
            TrainingRunRow.session_id.label("session_id"),
            func.count(CheckpointRow.id).label("count"),
            func.coalesce(func.sum(CheckpointRow.size_bytes), 0).label("bytes"),
        )
        .join(CheckpointRow, and_(CheckpointRow.model_id == TrainingRunRow.id, live_checkpoint()))
        .where(TrainingRunRow.tenant_id == tenant_id)
        .group_by(TrainingRunRow.session_id)
        .subquery()
    )
    async with sessions() as session:
        rows = (
            await session.execute(
                select(SessionRow, stored.c.count, stored.c.bytes)
                .outerjoin(stored, stored.c.session_id == SessionRow.id)
                .where(*where)
                .order_by(SessionRow.created_at.desc(), SessionRow.id.desc())
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
) -> list[RequestRow] | None:
    """Every recorded request of the session's runs and samplers, by time queued; None if the
    tenant has no such session."""
    async with sessions() as session:
        found = await session.scalar(
            select(SessionRow.id).where(
                SessionRow.id == session_id, SessionRow.tenant_id == tenant_id
            )
        )
        if found is None:
            return None
        models = (
            select(TrainingRunRow.id)
            .where(TrainingRunRow.session_id == session_id)
            .union(select(SamplingSessionRow.id).where(SamplingSessionRow.session_id == session_id))
        )
        rows = await session.scalars(
            select(RequestRow)
            .where(RequestRow.tenant_id == tenant_id, RequestRow.model_id.in_(models))
            .order_by(RequestRow.queued_at, RequestRow.id)
        )
        return list(rows)


async def set_checkpoint_public(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, checkpoint_id: str, public: bool
) -> bool:
    """Publish (or not) one of the tenant's live checkpoints; False if there is none."""
    async with sessions() as session, session.begin():
        updated = await session.execute(
            update(CheckpointRow)
            .where(
                CheckpointRow.id == checkpoint_id,
                CheckpointRow.tenant_id == tenant_id,
                live_checkpoint(),
            )
            .values(public=public)
            .returning(CheckpointRow.id)
        )
        return updated.first() is not None
