"""What is queued, who works on it and where tenants stand against their limits, read from
Redis: the dashboard, /metrics and `queue-tinker status` all show this one picture."""

from __future__ import annotations

import json
import time
from typing import Any

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.control.limits import DEFAULT_TENANT_KEY, limits_dict, read_limits
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.results.state import model_state
from queue_tinker.settings import Settings


async def queue_overview(
    redis: RedisClient,
    keys: Keys,
    settings: Settings,
    tenant: str | None = None,
    *,
    tenants: bool = True,
) -> dict[str, Any]:
    """Workers, the queues of models with ops not yet published, and (`tenants`) tenants' limit
    state; `tenant` narrows queues and tenants to one tenant (None: everyone's)."""
    registry = WorkerRegistry(redis, keys)
    live = await registry.live(settings.lease_ttl_ms * 3)
    served = sorted({w["base_model"] for w in live if "base_model" in w})
    queues = await _queues(redis, keys, served, tenant)
    overview: dict[str, Any] = {"workers": [_worker(w) for w in live], "queues": queues}
    if not tenants:
        return overview
    if tenant is not None:
        names = [tenant]
    else:  # everyone with queued work, or with limits of their own
        names = sorted(
            {q["tenant_id"] for q in queues}
            | (
                {t.decode() for t in await redis_bytes.smembers(redis, keys.limited_tenants())}
                - {DEFAULT_TENANT_KEY}
            )
        )
    overview["tenants"] = [await _tenant(redis, keys, t, queues) for t in names]
    return overview


def _worker(fields: dict[str, str]) -> dict[str, Any]:
    beat_ms = float(fields.get("beat_ms", 0))
    return {
        "id": fields["id"],
        "base_model": fields.get("base_model", ""),
        "device": fields.get("device", ""),
        "host": fields.get("host", ""),
        "pid": int(fields.get("pid", 0)),
        "heartbeat_age_s": round(max(0.0, time.time() - beat_ms / 1000), 3) if beat_ms else None,
        "owned": int(fields.get("owned", 0)),
        "ops_done": int(fields.get("ops_done", 0)),
        "current_op": fields.get("current_op", ""),
        "stopping": fields.get("stopping") == "1",
        "memory_bytes": int(fields.get("memory_bytes", 0)),
        "device_memory_bytes": int(fields.get("device_memory_bytes", 0)),
        "resident": json.loads(fields.get("resident") or "[]"),
    }


async def _queues(
    redis: RedisClient, keys: Keys, served: list[str], tenant: str | None
) -> list[dict[str, Any]]:
    # Every base model in use, served or not: an unserved one is the paused_capacity case the
    # overview must show.
    bases = {b.decode() for b in await redis_bytes.smembers(redis, keys.base_models())}
    bases |= set(served)
    now = time.time()
    queues = []
    for base in sorted(bases):
        pending = await redis_bytes.smembers(redis, keys.pending(base))
        for model_id in sorted(m.decode() for m in pending):
            async with redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(keys.model_meta(model_id))
                pipe.get(keys.model_lease(model_id))
                meta, lease = await pipe.execute()
            owner_tenant = meta.get(b"tenant_id", b"").decode()
            if tenant is not None and owner_tenant != tenant:
                continue
            last, done = int(meta.get(b"last_seq", 0)), int(meta.get(b"done_seq", 0))
            oldest = await redis_bytes.xrange(
                redis, keys.model_ops(model_id), f"{done + 1}-0", "+", count=1
            )
            queued_at = (
                await redis_bytes.hget(redis, keys.job(oldest[0][1][b"job"].decode()), "queued_at")
                if oldest
                else None
            )
            state, reason = model_state(meta, served)
            queues.append(
                {
                    "model_id": model_id,
                    "tenant_id": owner_tenant,
                    "kind": meta.get(b"kind", b"training").decode(),
                    "base_model": base,
                    "depth": last - done,
                    "owner": lease.decode().split("|")[0] if lease else None,
                    "oldest_wait_s": round(now - float(queued_at), 3) if queued_at else None,
                    "state": state.value,
                    "reason": reason,
                }
            )
    return queues


async def _tenant(
    redis: RedisClient, keys: Keys, tenant: str, queues: list[dict[str, Any]]
) -> dict[str, Any]:
    limits = await read_limits(redis, keys, tenant)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.smembers(keys.tenant_leased(tenant))
        pipe.scard(keys.tenant_running(tenant))
        pipe.hgetall(keys.tenant_bucket(tenant))
        leased, running, bucket = await pipe.execute()
    async with redis.pipeline(transaction=False) as pipe:
        for model_id in leased:
            pipe.hget(keys.model_meta(model_id.decode()), "kind")
            pipe.exists(keys.model_lease(model_id.decode()))
        flags = await pipe.execute()
    runs = sum(
        1
        for kind, held in zip(flags[::2], flags[1::2], strict=True)
        if held and kind == b"training"
    )
    level = None
    if limits.tokens_per_s and bucket:
        elapsed = time.time() * 1000 - float(bucket[b"at_ms"])
        level = round(
            min(
                limits.tokens_per_s, float(bucket[b"level"]) + limits.tokens_per_s * elapsed / 1000
            ),
            1,
        )
    return {
        "tenant_id": tenant,
        "limits": limits_dict(limits),
        "training_runs": runs,
        "inflight_ops": int(running),
        "tokens_level": level,
        "paused_models": [
            q["model_id"]
            for q in queues
            if q["tenant_id"] == tenant and q["state"] == "paused_rate_limit"
        ],
    }


async def hide_other_tenants(
    redis: RedisClient, keys: Keys, workers: list[dict[str, Any]], tenant: str
) -> None:
    """Leave out of each worker's entry the models and the op of tenants other than `tenant`
    (a model's tenant is in its meta hash, a job's in its job hash)."""
    async with redis.pipeline(transaction=False) as pipe:
        for worker in workers:
            for model_id in worker.get("resident", []):
                pipe.hget(keys.model_meta(model_id), "tenant_id")
            _, _, job_id = str(worker.get("current_op", "")).partition(":")
            if job_id:
                pipe.hget(keys.job(job_id), "tenant_id")
        answers = iter(await pipe.execute())
    mine = tenant.encode()
    for worker in workers:
        resident = list(worker.get("resident", []))
        owned = [model_id for model_id in resident if next(answers) == mine]
        worker["resident"] = owned
        worker["resident_hidden"] = len(resident) - len(owned)
        kind, _, job_id = str(worker.get("current_op", "")).partition(":")
        hidden = bool(job_id) and next(answers) != mine
        worker["current_op"] = f"{kind}:" if hidden else worker.get("current_op", "")
        worker["current_op_hidden"] = hidden
