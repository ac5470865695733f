"""The writes to the checkpoints table and the housekeeping's reads of it: marking a
checkpoint deleted, setting its expiry, finding the ones past their TTL. Rows are otherwise
the recorder's to write (record_writer.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum

from sqlalchemy import Row, Table, func, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_sessionmaker

from queue_tinker.store.models import CheckpointRow
from queue_tinker.store.queries import live_checkpoint

CHECKPOINTS: Table = CheckpointRow.__table__  # type: ignore[assignment]


class RowMark(StrEnum):
    """What marking a checkpoint's row deleted found."""

    DELETED = "deleted"  # deleted_at is set (now or before)
    KEPT = "kept"  # not due by the row's own expires_at: left as it is
    MISSING = "missing"  # no row (the recorder has not written it yet)


async def mark_checkpoint_deleted(
    conn: AsyncConnection, checkpoint_id: str, *, only_if_due: bool
) -> RowMark:
    """Set deleted_at once. `only_if_due`: the files were not seen expiring (already absent),
    so trust the row's own expires_at instead."""
    table = CHECKPOINTS
    conditions = [table.c.id == checkpoint_id, table.c.deleted_at.is_(None)]
    if only_if_due:
        conditions.append(table.c.expires_at <= func.now())
    marked = await conn.execute(
        update(table).where(*conditions).values(deleted_at=func.now()).returning(table.c.id)
    )
    if marked.first() is not None:
        return RowMark.DELETED
    found = await conn.execute(select(table.c.deleted_at).where(table.c.id == checkpoint_id))
    row = found.first()
    if row is None:
        return RowMark.MISSING
    return RowMark.DELETED if row.deleted_at is not None else RowMark.KEPT


async def due_checkpoints(
    conn: AsyncConnection, after: tuple[datetime, str] | None, batch: int
) -> Sequence[Row[str, str, datetime | None]]:
    """Up to `batch` live checkpoints past their expires_at (id, path, expires_at), in
    (expires_at, id) order after `after`."""
    table = CHECKPOINTS
    query = (
        select(table.c.id, table.c.path, table.c.expires_at)
        .where(table.c.expires_at < func.now(), table.c.deleted_at.is_(None))
        .order_by(table.c.expires_at, table.c.id)
        .limit(batch)
    )
    if after is not None:  # keyset paging: rows kept by their meta do not hide later ones
        query = query.where(tuple_(table.c.expires_at, table.c.id) > tuple_(*after))
    return (await conn.execute(query)).all()


async def set_checkpoint_expiry(
    sessions: async_sessionmaker[AsyncSession],
    tenant_id: str,
    checkpoint_id: str,
    expires_at: datetime | None,
) -> bool:
    """Set (or with None clear) a live checkpoint's expires_at; False if there is none."""
    async with sessions() as session, session.begin():
        updated = await session.execute(
            update(CheckpointRow)
            .where(
                CheckpointRow.id == checkpoint_id,
                CheckpointRow.tenant_id == tenant_id,
                live_checkpoint(),
            )
            .values(expires_at=expires_at)
            .returning(CheckpointRow.id)
        )
        return updated.first() is not None
