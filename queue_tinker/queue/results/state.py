"""Why a model's ops are waiting, as told to the client that waits for them."""

from __future__ import annotations

import time
from collections.abc import Mapping

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.types import QueueState


def model_state(
    meta: dict[bytes, bytes], served: list[str], loading: Mapping[str, float] | None = None
) -> tuple[QueueState, str | None]:
    """A model's state from its meta hash, the base models live workers serve and those
    workers are loading (base model -> since when, ms; WorkerRegistry.loading_since):
    `paused_capacity` while no live worker serves its base model (saying so when one is
    loading it: a cold start), `paused_rate_limit` while its tenant is over a limit (the
    scripts that refused its op left the reason), else `active`."""
    base_model = meta.get(b"base_model", b"").decode()
    if base_model not in served:
        reason = f"no live worker serves base model {base_model}"
        started_ms = (loading or {}).get(base_model)
        if started_ms is not None:
            loading_s = max(0.0, time.time() - started_ms / 1000)
            reason += f" yet: a worker has been loading it for {loading_s:.0f} s"
        return QueueState.PAUSED_CAPACITY, reason
    reason_bytes = meta.get(b"paused_reason")
    if reason_bytes:
        return QueueState.PAUSED_RATE_LIMIT, reason_bytes.decode()
    return QueueState.ACTIVE, None


async def queue_state(
    redis: RedisClient, keys: Keys, registry: WorkerRegistry, model_id: str, max_age_ms: int
) -> tuple[QueueState, str | None]:
    """The state of one model's queue now (model_state, read from Redis)."""
    meta = await redis_bytes.hgetall(redis, keys.model_meta(model_id))
    served = await registry.base_models(max_age_ms)
    return model_state(meta, served, await _loading(registry, [meta], served, max_age_ms))


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
    loading = await _loading(registry, [m for m in metas if m], served, max_age_ms)
    states = {}
    for model_id, meta in zip(models, metas, strict=True):
        if meta:
            kind = meta.get(b"kind", b"training").decode()
            states[model_id] = (kind, *model_state(meta, served, loading))
    return states


async def _loading(
    registry: WorkerRegistry, metas: list[dict[bytes, bytes]], served: list[str], max_age_ms: int
) -> dict[str, float]:
    """The loading workers' start times (WorkerRegistry.loading_since), read only when one of
    these models waits on a base model no live worker serves: the one state that names them,
    so a client's poll of served models costs no extra round trip."""
    if all(meta.get(b"base_model", b"").decode() in served for meta in metas):
        return {}
    return await registry.loading_since(max_age_ms)
