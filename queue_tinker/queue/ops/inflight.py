"""Inflight sampler weights: one mutable target per training run (`kind="inflight"`).

An inflight save (`save_weights_and_get_sampling_client(kind="inflight")`) writes an ephemeral
sampler checkpoint like a snapshot save, then points the run's target at it: a Redis hash
(keys.inflight_weights) holding the save's seq and path, moved only forward (an older save
that completes later leaves it alone, lua/publish_inflight.lua). Every sampling session
opened by an inflight save follows the target: each sample is submitted with the newest path
there is, and a worker moves samples already running to newer weights between decode steps,
their KV cache kept (workers/sampling/sessions.py).

The target lives as long as the checkpoints it points at (QT_EPHEMERAL_SAMPLER_TTL_S, from
its last save); after that a session falls back to the weights it was opened on, which expire
with it.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis.asyncio import Redis

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.scripts import Scripts


class InflightWeights:
    def __init__(self, redis: Redis, keys: Keys, scripts: Scripts, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts = scripts
        self.ttl_s = ttl_s

    async def publish(self, model_id: str, seq: int, path: str) -> int:
        """Point the run's inflight weights at the save of `seq` (at `path`) unless a later
        save is there already; the seq the target is at afterwards."""
        current = await self.scripts.publish_inflight(
            keys=[self.keys.inflight_weights(model_id)], args=[seq, path, self.ttl_s]
        )
        return int(current)

    async def path(self, model_id: str) -> str | None:
        """The run's newest inflight weights, None when it has none (or they expired)."""
        raw = await redis_bytes.hget(self.redis, self.keys.inflight_weights(model_id), "path")
        return raw.decode() if raw else None

    async def paths(self, model_ids: Iterable[str]) -> dict[str, str]:
        """The newest inflight weights of each run that has some, in one round trip."""
        ids = list(model_ids)
        if not ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for model_id in ids:
                pipe.hget(self.keys.inflight_weights(model_id), "path")
            found = await pipe.execute()
        return {m: raw.decode() for m, raw in zip(ids, found, strict=True) if raw}
