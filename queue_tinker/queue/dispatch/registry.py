"""Worker registry: who is alive, what it serves, what it is doing."""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis

from queue_tinker.errors import UserInputError
from queue_tinker.queue import redis_bytes
from queue_tinker.queue.keys import Keys
from queue_tinker.types.model_names import ModelName, served_base


class WorkerRegistry:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def beat(self, worker_id: str, fields: dict[str, Any], ttl_ms: int) -> None:
        """Record a heartbeat; the hash expires if the worker stops beating."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.worker(worker_id), mapping={k: str(v) for k, v in fields.items()})
            pipe.pexpire(self.keys.worker(worker_id), ttl_ms)
            pipe.zadd(self.keys.workers(), {worker_id: time.time() * 1000})
            if "base_model" in fields:  # at every beat: back at once after a Redis restart
                pipe.sadd(self.keys.served_base_models(), str(fields["base_model"]))
            await pipe.execute()

    async def remove(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.workers(), worker_id)
            pipe.delete(self.keys.worker(worker_id), self.keys.worker_control(worker_id))
            await pipe.execute()

    async def live(self, max_age_ms: int) -> list[dict[str, str]]:
        """Workers that beat within max_age_ms, with their registry fields and beat_ms (the
        last heartbeat, ms since the epoch)."""
        since = time.time() * 1000 - max_age_ms
        beats = await redis_bytes.zrangebyscore_withscores(
            self.redis, self.keys.workers(), since, "+inf"
        )
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id, _ in beats:
                pipe.hgetall(self.keys.worker(worker_id.decode()))
            rows = await pipe.execute()
        return [
            {
                "id": wid.decode(),
                "beat_ms": str(beat_ms),
                **{k.decode(): v.decode() for k, v in row.items()},
            }
            for (wid, beat_ms), row in zip(beats, rows, strict=True)
            if row
        ]

    async def served_ever(self) -> list[str]:
        """Every base model a worker has served, sorted (live or not)."""
        served = await redis_bytes.smembers(self.redis, self.keys.served_base_models())
        return sorted(b.decode() for b in served)

    async def check_served(self, base_model: str, *, allow_unserved: bool) -> None:
        """Refuse a new run on a base model no worker has ever served, naming those served, so
        a typo fails at once instead of waiting for a worker that never comes. A deployment
        where no worker has run yet (still starting) or that starts workers on demand
        (allow_unserved, QT_QUEUE_UNSERVED_BASE_MODELS) queues it."""
        if allow_unserved:
            return
        served = await self.served_ever()
        if served and served_base(base_model) not in served:
            raise UserInputError(
                f"base_model: {base_model!r} is not served by this deployment; served base "
                f"models: {', '.join(served)} (a deployment that starts workers on demand sets "
                "QT_QUEUE_UNSERVED_BASE_MODELS=true to queue it instead)"
            )

    async def loading(self, worker_id: str, base_model: str, started_ms: float) -> None:
        """Say (again, each heartbeat) that `worker_id` is loading `base_model` since
        `started_ms`: until it registers, the ops waiting for that base model are told so."""
        beat = f"{base_model}|{started_ms:.0f}|{time.time() * 1000:.0f}"
        await self.redis.hset(self.keys.workers_loading(), worker_id, beat)

    async def loaded(self, worker_id: str) -> None:
        """`worker_id` serves, or gave up: no longer loading."""
        await self.redis.hdel(self.keys.workers_loading(), worker_id)

    async def loading_since(self, max_age_ms: int) -> dict[str, float]:
        """Base model -> when (ms since the epoch) its longest-loading worker started, over
        the loading workers that beat within max_age_ms; those that did not (died while
        loading) are dropped."""
        entries = await redis_bytes.hgetall(self.redis, self.keys.workers_loading())
        since: dict[str, float] = {}
        stale: list[bytes] = []
        oldest_beat = time.time() * 1000 - max_age_ms
        for worker_id, entry in entries.items():
            base_model, started_ms, beat_ms = entry.decode().rsplit("|", 2)
            if float(beat_ms) < oldest_beat:
                stale.append(worker_id)
                continue
            since[base_model] = min(float(started_ms), since.get(base_model, float("inf")))
        if stale:
            await self.redis.hdel(self.keys.workers_loading(), *stale)
        return since

    async def base_models(self, max_age_ms: int) -> list[str]:
        """The base models live workers serve, sorted."""
        return sorted({w["base_model"] for w in await self.live(max_age_ms) if "base_model" in w})

    async def model_names(self, max_age_ms: int) -> dict[str, int | None]:
        """What a run may be created on now, sorted, with the context each holds: each base
        model live workers serve, and its longest `Base:peft:<tokens>` name (the context its
        loaded workers hold; a shorter cap is accepted too). None: not known yet (no loaded
        worker has said)."""
        names: dict[str, int | None] = {}
        for worker in await self.live(max_age_ms):
            if "base_model" not in worker:
                continue
            base, context = worker["base_model"], int(worker.get("context_length") or 0) or None
            names[base] = names.get(base) or context
            if context is not None:
                names[ModelName(base, context).text] = context
        return dict(sorted(names.items()))
