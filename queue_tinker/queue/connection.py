"""Redis clients: the one place that opens them and decides their options. Every process's
connections come from here (the queue's parts take the client they are handed); riding out
an outage is outage.py's."""

from __future__ import annotations

import redis
from redis.asyncio import BlockingConnectionPool, Redis

from queue_tinker.queue.command_packing import packed_by_hiredis

# The asyncio client every part of the service is handed (annotations name it, not redis-py).
RedisClient = Redis

# Blocking reads (XREAD, BZPOPMIN) each hold a connection; past this many, callers wait for one.
MAX_CONNECTIONS = 64
# A connect that takes longer is to a host that is gone (without it, the OS gives up after
# about two minutes of SYN retries).
REDIS_CONNECT_TIMEOUT_S = 5.0


def connect(url: str, *, max_connections: int = MAX_CONNECTIONS) -> RedisClient:
    """An asyncio Redis client returning bytes (payloads are binary)."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,  # wait for a free connection rather than fail a submit
        decode_responses=False,
        health_check_interval=30,
        socket_keepalive=True,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
    )
    pool.connection_class = packed_by_hiredis(pool.connection_class)
    return Redis.from_pool(pool)  # the client owns the pool: aclose() closes both


def connect_sync(url: str) -> redis.Redis:
    """A synchronous client (rq speaks sync Redis: the housekeeper and its jobs' callers)."""
    return redis.Redis.from_url(url)


def server_pid(host: str, port: int) -> int | None:
    """The pid of the Redis server answering on host:port, None if none answers (yet): how the
    embedded launcher knows the server it started is up."""
    client = redis.Redis(host=host, port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        client.ping()
        return int(client.info("server")["process_id"])
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
        return None
    finally:
        client.close()
