"""Uploaded custom losses (create_custom_loss), kept in Postgres with their session: written
before the upload is answered, read when a forward_backward names one."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.store.models import CustomLossGraphRow
from queue_tinker.types.requests.custom_loss import CustomLoss


async def save(
    sessions: async_sessionmaker[AsyncSession], loss: CustomLoss, *, tenant_id: str, session_id: str
) -> CustomLoss:
    """Store the loss under its id; the one stored first under that id (a retried upload
    finds its own)."""
    async with sessions() as session, session.begin():
        await session.execute(
            insert(CustomLossGraphRow)
            .values(
                id=loss.loss_id,
                tenant_id=tenant_id,
                session_id=session_id,
                name=loss.name,
                inputs=[i.model_dump() for i in loss.inputs],
                graph=loss.graph.model_dump(mode="json"),
            )
            .on_conflict_do_nothing()
        )
        row = await session.get(CustomLossGraphRow, loss.loss_id)
    assert row is not None
    return _loss(row)


async def load(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, loss_id: str
) -> tuple[CustomLoss, str] | None:
    """(the tenant's loss with this id, its session id), or None."""
    async with sessions() as session:
        row = await session.scalar(
            select(CustomLossGraphRow).where(
                CustomLossGraphRow.id == loss_id, CustomLossGraphRow.tenant_id == tenant_id
            )
        )
    return (_loss(row), row.session_id) if row is not None else None


def _loss(row: CustomLossGraphRow) -> CustomLoss:
    return CustomLoss.model_validate(
        {"loss_id": row.id, "name": row.name, "inputs": row.inputs, "graph": row.graph}
    )
