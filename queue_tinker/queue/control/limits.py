"""Per-tenant limits: training runs held at once, ops running at once, tokens per second.

They live in Redis, where the scripts that enforce them read them atomically with the state
they guard (lua/claim.lua: training runs; lua/start.lua: in-flight ops and the token bucket;
lua/publish.lua charges the tokens). An op over a limit is never failed for it: it waits in
its model's queue and its model reports `paused_rate_limit` with the reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from queue_tinker.errors import UserInputError
from queue_tinker.queue import redis_bytes
from queue_tinker.queue.keys import Keys

DEFAULT_TENANT_KEY = "*"  # the limits of every tenant that has none of its own


@dataclass(frozen=True)
class Limits:
    """0 means unlimited."""

    training_runs: int = 0
    inflight_ops: int = 0
    tokens_per_s: float = 0.0


def _parse(raw: dict[bytes, bytes]) -> Limits:
    return Limits(
        training_runs=int(raw.get(b"training_runs", 0)),
        inflight_ops=int(raw.get(b"inflight_ops", 0)),
        tokens_per_s=float(raw.get(b"tokens_per_s", 0)),
    )


async def read_limits(redis: Redis, keys: Keys, tenant: str) -> Limits:
    """The tenant's own limits, else the default ones, else none (field by field, as the
    scripts read them)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.limits(tenant))
        pipe.hgetall(keys.limits(DEFAULT_TENANT_KEY))
        own, default = await pipe.execute()
    return _parse({**default, **own})


async def set_limits(
    redis: Redis,
    keys: Keys,
    tenant: str,
    *,
    training_runs: int | None = None,
    inflight_ops: int | None = None,
    tokens_per_s: float | None = None,
) -> Limits:
    """Set some of a tenant's limits (tenant `*`: the default); None leaves one unchanged."""
    given = {
        "training_runs": training_runs,
        "inflight_ops": inflight_ops,
        "tokens_per_s": tokens_per_s,
    }
    for name, value in given.items():
        if value is not None and (isinstance(value, bool) or not value >= 0):
            raise UserInputError(f"{name}: must be 0 (unlimited) or more, got {value!r}")
    for name in ("training_runs", "inflight_ops"):
        value = given[name]
        if value is not None and value != int(value):
            raise UserInputError(f"{name}: must be a whole number, got {value!r}")
    updates: dict[FieldT, EncodableT] = {
        name: str(value) for name, value in given.items() if value is not None
    }
    if updates:
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.limits(tenant), mapping=updates)
            pipe.sadd(keys.limited_tenants(), tenant)
            await pipe.execute()
    return _parse(await redis_bytes.hgetall(redis, keys.limits(tenant)))


async def clear_limits(redis: Redis, keys: Keys, tenant: str) -> None:
    """Drop a tenant's own limits (it falls back to the default)."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.limits(tenant))
        pipe.srem(keys.limited_tenants(), tenant)
        await pipe.execute()


async def list_limits(redis: Redis, keys: Keys) -> dict[str, Limits]:
    """Every tenant with limits of its own, and `*` (the default), by tenant."""
    tenants = sorted(
        {t.decode() for t in await redis_bytes.smembers(redis, keys.limited_tenants())}
        | {DEFAULT_TENANT_KEY}
    )
    async with redis.pipeline(transaction=False) as pipe:
        for tenant in tenants:
            pipe.hgetall(keys.limits(tenant))
        rows = await pipe.execute()
    return {tenant: _parse(row) for tenant, row in zip(tenants, rows, strict=True)}


def limits_dict(limits: Limits) -> dict[str, float]:
    return asdict(limits)
