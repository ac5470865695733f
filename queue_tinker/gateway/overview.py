"""What is queued and who works on it, read from Redis (the gateway and `status` share it)."""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis

from queue_tinker.queue.keys import Keys
from queue_tinker.queue.registry import WorkerRegistry
from queue_tinker.settings import Settings


async def queue_overview(redis: Redis, keys: Keys, settings: Settings) -> dict[str, Any]:
    workers = await WorkerRegistry(redis, keys).live(settings.lease_ttl_ms * 3)
    base_models = sorted({w["base_model"] for w in workers})
    pending_by_base = {}
    for base in base_models:
        pending_by_base[base] = [m.decode() for m in await redis.smembers(keys.pending(base))]
    now = time.time()
    queues = []
    for base, model_ids in pending_by_base.items():
        for model_id in sorted(model_ids):
            meta = await redis.hgetall(keys.model_meta(model_id))
            last = int(meta.get(b"last_seq", 0))
            done = int(meta.get(b"done_seq", 0))
            lease = await redis.get(keys.model_lease(model_id))
            oldest = await redis.xrange(keys.model_ops(model_id), f"{done + 1}-0", "+", count=1)
            oldest_job = oldest[0][1][b"job"].decode() if oldest else None
            queued_at = await redis.hget(keys.job(oldest_job), "queued_at") if oldest_job else None
            queues.append({
                "model_id": model_id,
                "base_model": base,
                "depth": last - done,
                "owner": lease.decode().split("|")[0] if lease else None,
                "oldest_wait_s": round(now - float(queued_at), 3) if queued_at else None,
            })
    return {"workers": workers, "queues": queues}
