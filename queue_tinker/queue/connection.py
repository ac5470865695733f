"""Redis clients for the queue: one place that decides connection options."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis

# Blocking reads (XREAD, BZPOPMIN) each hold a connection; past this many, callers wait for one.
MAX_CONNECTIONS = 64


def connect(url: str, *, max_connections: int = MAX_CONNECTIONS) -> Redis:
    """An asyncio Redis client returning bytes (payloads are binary)."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,  # wait for a free connection rather than fail a submit
        decode_responses=False,
        health_check_interval=30,
        socket_keepalive=True,
    )
    return Redis.from_pool(pool)  # the client owns the pool: aclose() closes both
