"""Read helpers over the durable record (CLI, gateway, tests)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.store.models import Request, TrainingRun
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
