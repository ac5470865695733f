"""The load on each base model, summed from one overview: what /metrics' demand series and the
fleet's history report, computed in one place so the two cannot disagree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.keys import Keys


@dataclass
class BaseModelLoad:
    """One base model's work and workers at the moment of the overview."""

    depth: int = 0  # unfinished ops (queued or running), over its models
    models: int = 0  # models with unfinished ops, whatever their state
    unowned: int = 0  # of those, models no live worker holds the lease of
    oldest_wait_s: float = 0.0  # age of the oldest unfinished op; 0 when none waits
    workers: int = 0  # live workers serving it


async def known_base_models(redis: RedisClient, keys: Keys) -> set[str]:
    """Every base model a model was registered on or a worker has served: an idle one then
    reports zeros instead of vanishing, and a scaler reads 0 rather than nothing."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.smembers(keys.base_models())
        pipe.smembers(keys.served_base_models())
        registered, served = await pipe.execute()
    return {b.decode() for b in registered | served}


def fleet_load(overview: dict[str, Any], known: set[str]) -> dict[str, BaseModelLoad]:
    """Per base model (every known one and every one in the overview), its load from
    `queue_overview(..., tenant=None)`: every tenant's queues and the live workers."""
    workers, queues = overview["workers"], overview["queues"]
    bases = known | {w["base_model"] for w in workers} | {q["base_model"] for q in queues}
    load = {base: BaseModelLoad() for base in bases}
    for worker in workers:
        load[worker["base_model"]].workers += 1
    live = {w["id"] for w in workers}
    for queue in queues:
        if queue["depth"] <= 0:  # pending but settled a moment ago: no demand left
            continue
        entry = load[queue["base_model"]]
        entry.depth += queue["depth"]
        entry.models += 1
        # A lease can outlive its worker by up to a lease lifetime: only a live owner counts.
        entry.unowned += 0 if queue["owner"] in live else 1
        if queue["oldest_wait_s"] is not None:
            entry.oldest_wait_s = max(entry.oldest_wait_s, queue["oldest_wait_s"])
    return load
