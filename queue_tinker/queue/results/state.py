"""Why a model's ops are waiting, as told to the client that waits for them."""

from __future__ import annotations

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.types import QueueState


def model_state(meta: dict[bytes, bytes], served: list[str]) -> tuple[QueueState, str | None]:
    """A model's state from its meta hash and the base models live workers serve:
    `paused_capacity` while no live worker serves its base model, `paused_rate_limit` while
    its tenant is over a limit (the scripts that refused its op left the reason), else
    `active`."""
    base_model = meta.get(b"base_model", b"").decode()
    if base_model not in served:
        return QueueState.PAUSED_CAPACITY, f"no live worker serves base model {base_model}"
    reason = meta.get(b"paused_reason")
    if reason:
        return QueueState.PAUSED_RATE_LIMIT, reason.decode()
    return QueueState.ACTIVE, None


async def queue_state(
    redis: RedisClient, keys: Keys, registry: WorkerRegistry, model_id: str, max_age_ms: int
) -> tuple[QueueState, str | None]:
    """The state of one model's queue now (model_state, read from Redis)."""
    meta = await redis_bytes.hgetall(redis, keys.model_meta(model_id))
    return model_state(meta, await registry.base_models(max_age_ms))


async def queue_states(
    redis: RedisClient, keys: Keys, registry: WorkerRegistry, models: list[str], max_age_ms: int
) -> dict[str, tuple[str, QueueState, str | None]]:
    """The states of several models' queues now, in one round trip for their metas: model ->
    (its kind, training or sampling; its state; the reason). A model Redis no longer holds is
    left out."""
    async with redis.pipeline(transaction=False) as pipe:
        for model_id in models:
            pipe.hgetall(keys.model_meta(model_id))
        metas: list[dict[bytes, bytes]] = await pipe.execute()
    served = await registry.base_models(max_age_ms)
    states = {}
    for model_id, meta in zip(models, metas, strict=True):
        if meta:
            kind = meta.get(b"kind", b"training").decode()
            states[model_id] = (kind, *model_state(meta, served))
    return states
