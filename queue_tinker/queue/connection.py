"""Redis clients: the one place that opens them and decides their options. Every process's
connections come from here (the queue's parts take the client they are handed); riding out
an outage is outage.py's, waiting for replicas replication.py's.

QT_REDIS_URL names one Redis (`redis://host:port/db`) or a Sentinel-watched primary:

    redis+sentinel://[:password@]sentinel1:26379,sentinel2:26379,.../<service name>[/db]

where the client asks the Sentinels for the primary of `service name`, and again after a
failover (redis-py's Sentinel pool). Two query parameters, on either form, say how many
replicas must hold a write before it is acknowledged: `?replicas=1&replica_timeout_ms=1000`
(queue/replication.py; 0, the default, acknowledges on the primary's word alone).
`sentinel_password=` authenticates to the Sentinels when they have a password of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.sentinel
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from queue_tinker.queue.command_packing import packed_by_hiredis

SENTINEL_SCHEME = "redis+sentinel"
# Blocking reads (XREAD, BZPOPMIN) each hold a connection; past this many, callers wait for one.
MAX_CONNECTIONS = 64
# A connect that takes longer is to a host that is gone (without it, the OS gives up after
# about two minutes of SYN retries).
REDIS_CONNECT_TIMEOUT_S = 5.0
OPTIONS: dict[str, Any] = {
    "decode_responses": False,
    "health_check_interval": 30,
    "socket_keepalive": True,
    "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
}


# How the client speaks to the Sentinels themselves (they answer at once, or are down).
_SENTINEL_OPTIONS = {"socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S, "socket_timeout": 2.0}


@dataclass(frozen=True)
class Replication:
    """How many replicas must hold a write before it is acknowledged, and how long one WAIT
    for them lasts."""

    replicas: int = 0
    timeout_ms: int = 1_000


class RedisClient(Redis):
    """The asyncio client every part of the service is handed: redis-py's, returning bytes,
    and knowing its deployment's Replication."""

    replication: Replication = Replication()
    # The Sentinels a Sentinel-URL client asks for its primary; closed with it.
    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            await self.sentinel_manager.aclose()


@dataclass(frozen=True)
class Target:
    """What QT_REDIS_URL names: the plain URL redis-py takes, or the Sentinels to ask for the
    primary of `service`; and the replication its writes wait for."""

    url: str
    replication: Replication
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    password: str | None = None
    sentinel_password: str | None = None


def target(url: str) -> Target:
    """QT_REDIS_URL read: ValueError naming what is wrong with it."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    replication = Replication(
        replicas=int(query.pop("replicas", 0)),
        timeout_ms=int(query.pop("replica_timeout_ms", 1_000)),
    )
    if replication.replicas < 0 or replication.timeout_ms <= 0:
        raise ValueError(f"QT_REDIS_URL: replicas >= 0 and replica_timeout_ms > 0, got {url!r}")
    sentinel_password = query.pop("sentinel_password", None)
    if parts.scheme != SENTINEL_SCHEME:
        return Target(urlunsplit(parts._replace(query=urlencode(query))), replication)
    hosts = parts.netloc.rpartition("@")[2]
    path = [p for p in parts.path.split("/") if p]
    if not hosts or not path or len(path) > 2:
        raise ValueError(
            f"QT_REDIS_URL: {url!r} is no Sentinel URL; expected "
            f"{SENTINEL_SCHEME}://host:port[,host:port...]/<service name>[/db]"
        )
    sentinels = tuple(_host_port(host) for host in hosts.split(","))
    return Target(
        url,
        replication,
        sentinels=sentinels,
        service=path[0],
        db=int(path[1]) if len(path) > 1 else 0,
        password=unquote(parts.password) if parts.password else None,
        sentinel_password=sentinel_password,
    )


def _host_port(text: str) -> tuple[str, int]:
    """host:port of one Sentinel (26379, Sentinel's own port, when it names none)."""
    host, colon, port = text.rpartition(":")
    return (host, int(port)) if colon else (text, 26379)


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's pool (connections to whichever server is the primary now) that waits for a
    free connection rather than failing a call when all are taken, as the plain pool does."""


def connect(url: str, *, max_connections: int = MAX_CONNECTIONS) -> RedisClient:
    """An asyncio Redis client returning bytes (payloads are binary)."""
    found = target(url)
    if found.sentinels:
        sentinel = Sentinel(
            list(found.sentinels),
            sentinel_kwargs={"password": found.sentinel_password, **_SENTINEL_OPTIONS},
        )
        client = cast(
            RedisClient,
            sentinel.master_for(
                found.service,
                redis_class=RedisClient,
                connection_pool_class=_BlockingSentinelPool,
                connection_class=packed_by_hiredis(SentinelManagedConnection),
                max_connections=max_connections,
                timeout=None,
                db=found.db,
                password=found.password,
                **OPTIONS,
            ),
        )
        client.sentinel_manager = sentinel
    else:
        pool = BlockingConnectionPool.from_url(
            found.url, max_connections=max_connections, timeout=None, **OPTIONS
        )
        pool.connection_class = packed_by_hiredis(pool.connection_class)
        # The client owns the pool: aclose() closes both.
        client = cast(RedisClient, RedisClient.from_pool(pool))
    client.replication = found.replication
    return client


SyncRedisClient = redis.Redis  # what connect_sync returns, for callers outside queue/


def connect_sync(url: str) -> redis.Redis:
    """A synchronous client (rq speaks sync Redis: the housekeeper and its jobs' callers)."""
    found = target(url)
    if not found.sentinels:
        return redis.Redis.from_url(found.url)
    sentinel = redis.sentinel.Sentinel(
        list(found.sentinels),
        sentinel_kwargs={"password": found.sentinel_password, **_SENTINEL_OPTIONS},
    )
    return cast(
        redis.Redis, sentinel.master_for(found.service, db=found.db, password=found.password)
    )


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
