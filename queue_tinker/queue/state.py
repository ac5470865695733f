"""Why a model's ops are waiting, as told to the client that waits for them."""

from __future__ import annotations

from queue_tinker.queue.registry import WorkerRegistry
from queue_tinker.types import QueueState


async def queue_state(registry: WorkerRegistry, base_model: str,
                      max_age_ms: int) -> tuple[QueueState, str | None]:
    """`paused_capacity` while no live worker serves the model's base model; else `active`."""
    if base_model not in await registry.base_models(max_age_ms):
        return QueueState.PAUSED_CAPACITY, f"no live worker serves base model {base_model}"
    return QueueState.ACTIVE, None
