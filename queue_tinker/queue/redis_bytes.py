"""The Redis reads the queue makes, typed for what they return on our clients.

Every client here speaks RESP2 with decode_responses=False (connection.connect, and the test
fixtures), so redis-py hands back bytes, lists and dicts of bytes. Its annotations cannot know
how a client was made and say `bytes | str` (and a RESP3 dict for stream reads) everywhere;
these functions narrow that once, here, so the code that reads replies needs no casts. Each is
the redis-py call of the same name, unchanged: same command, same arguments, same reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from redis.asyncio import Redis
from redis.typing import KeyT, StreamIdT

StreamEntry = tuple[bytes, dict[bytes, bytes]]  # (entry id, fields)
StreamId = bytes | str | int


async def get(redis: Redis, name: str) -> bytes | None:
    return cast("bytes | None", await redis.get(name))


async def hget(redis: Redis, name: str, key: str) -> bytes | None:
    return cast("bytes | None", await redis.hget(name, key))


async def hmget(redis: Redis, name: str, *fields: str) -> list[bytes | None]:
    return cast("list[bytes | None]", await redis.hmget(name, list(fields)))


async def hgetall(redis: Redis, name: str) -> dict[bytes, bytes]:
    return cast("dict[bytes, bytes]", await redis.hgetall(name))


async def smembers(redis: Redis, name: str) -> set[bytes]:
    return cast("set[bytes]", await redis.smembers(name))


async def zrangebyscore_withscores(
    redis: Redis, name: str, min: float | str, max: float | str
) -> list[tuple[bytes, float]]:
    """(member, score) for the members scored min..max, lowest score first."""
    reply = await redis.zrangebyscore(name, min, max, withscores=True)
    return cast("list[tuple[bytes, float]]", reply)


async def xrange(
    redis: Redis, name: str, min: StreamId = "-", max: StreamId = "+", count: int | None = None
) -> list[StreamEntry]:
    return cast("list[StreamEntry]", await redis.xrange(name, min, max, count))


async def xrevrange(
    redis: Redis, name: str, max: StreamId = "+", min: StreamId = "-", count: int | None = None
) -> list[StreamEntry]:
    return cast("list[StreamEntry]", await redis.xrevrange(name, max, min, count))


async def xread(
    redis: Redis,
    streams: Mapping[str, StreamId],
    count: int | None = None,
    block: int | None = None,
) -> list[tuple[bytes, list[StreamEntry]]]:
    """(stream, entries) for each stream with entries after its id; [] once `block` ms pass
    with none (redis-py's None, as an empty list)."""
    # A copy typed as redis-py asks: a dict is invariant in its key type, so dict[str, ...]
    # is no dict[KeyT, ...] though every str is a KeyT.
    wanted: dict[KeyT, StreamIdT] = {key: after for key, after in streams.items()}
    reply = await redis.xread(wanted, count=count, block=block)
    return cast("list[tuple[bytes, list[StreamEntry]]]", reply or [])
