"""Fleet-wide counters for /metrics and `queue-tinker status`: published ops by kind and status,
their queued-to-finished latency, and tokens processed.

The workers' publish script counts them in Redis (lua/common.lua count_published), so every
gateway reports the same totals whichever process did the work.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from queue_tinker.queue.keys import Keys
from queue_tinker.types import OpKind

# Upper bounds of the latency histogram's buckets, in seconds; also the Lua scripts' (scripts.py).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


@dataclass(frozen=True)
class OpMetrics:
    kind: str
    status: str
    count: int


@dataclass(frozen=True)
class LatencyHistogram:
    kind: str
    buckets: list[tuple[float, int]]  # (upper bound, cumulative count), the last bound +Inf
    count: int
    sum_s: float


@dataclass(frozen=True)
class MetricsSnapshot:
    ops: list[OpMetrics]
    latency: list[LatencyHistogram]
    tokens: dict[str, int]  # op kind -> tokens processed
    tenant_tokens: dict[str, int]  # tenant -> tokens processed


async def read_metrics(redis: Redis, keys: Keys) -> MetricsSnapshot:
    kinds = [kind.value for kind in OpKind]
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.metrics_ops())
        pipe.hgetall(keys.metrics_tokens())
        pipe.hgetall(keys.metrics_tenant_tokens())
        for kind in kinds:
            pipe.hgetall(keys.metrics_latency(kind))
        ops_raw, tokens_raw, tenant_raw, *latency_raw = await pipe.execute()
    ops = []
    for field, count in sorted(ops_raw.items()):
        kind, status = field.decode().split("|", 1)
        ops.append(OpMetrics(kind=kind, status=status, count=int(count)))
    latency = [_histogram(kind, raw) for kind, raw in zip(kinds, latency_raw, strict=True) if raw]
    return MetricsSnapshot(
        ops=ops,
        latency=latency,
        tokens={k.decode(): int(v) for k, v in tokens_raw.items()},
        tenant_tokens={k.decode(): int(v) for k, v in tenant_raw.items()},
    )


def _histogram(kind: str, raw: dict[bytes, bytes]) -> LatencyHistogram:
    bounds = [*LATENCY_BUCKETS_S, float("inf")]
    cumulative, buckets = 0, []
    for i, bound in enumerate(bounds, start=1):  # Lua numbers the buckets from 1
        cumulative += int(raw.get(f"b{i}".encode(), 0))
        buckets.append((bound, cumulative))
    return LatencyHistogram(
        kind=kind,
        buckets=buckets,
        count=int(raw.get(b"count", 0)),
        sum_s=float(raw.get(b"sum_s", 0.0)),
    )
