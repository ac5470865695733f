"""Writes held by replicas before they are acknowledged.

Redis replicates asynchronously: a primary lost with its disk loses whatever its replicas had
not received, and Sentinel promotes a replica without it. Where QT_REDIS_URL asks for replicas
(`?replicas=N`, connection.py), a write a client is told about waits for WAIT on the
connection that made it: an op is acknowledged to its client (enqueue), a run or session
exists (register), and a result wakes its future (publish: the script makes its writes, WAIT,
then the wake-up is published), only once N replicas hold them. `min-replicas-to-write` alone
would not do: it refuses writes while replicas are away, but says nothing of the write at hand.

A WAIT that falls short is waited on again through a write of the same process (replication
offsets only grow, so a replica that holds a later write holds every earlier one); past
PATIENCE_WAITS of them it raises a connection error, which the caller rides out as an outage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from queue_tinker.queue.connection import Replication
from queue_tinker.queue.keys import Keys

PATIENCE_WAITS = 10  # WAITs of timeout_ms each before a write counts as not replicated


def replication_of(redis: Any) -> Replication:
    """The replication `redis` must wait for (none for a client not made by connect())."""
    found = getattr(redis, "replication", None)
    return found if isinstance(found, Replication) else Replication()


async def run_replicated(
    redis: Redis,
    keys: Keys,
    script: AsyncScript,
    call_keys: Sequence[str],
    args: Sequence[Any],
) -> Any:
    """One call of `script`, its reply once the replicas hold its writes: EVALSHA and WAIT in
    one round trip when they keep up."""
    policy = replication_of(redis)
    if not policy.replicas:
        return await script(keys=list(call_keys), args=list(args))
    async with redis.pipeline(transaction=False) as pipe:
        pipe.evalsha(script.sha, len(call_keys), *call_keys, *args)
        pipe.wait(policy.replicas, policy.timeout_ms)
        reply, acked = await pipe.execute(raise_on_error=False)
    if isinstance(reply, NoScriptError):  # a restarted or promoted server: load it, once
        await redis.script_load(script.script)
        return await run_replicated(redis, keys, script, call_keys, args)
    if isinstance(reply, Exception):
        raise reply
    await replicated(redis, keys, acked)
    return reply


async def replicated(redis: Redis, keys: Keys, acked: object = None) -> None:
    """Return once the replicas hold every write this process made so far; `acked` is what a
    WAIT right after them answered. RedisConnectionError after PATIENCE_WAITS short WAITs."""
    policy = replication_of(redis)
    if not policy.replicas or (isinstance(acked, int) and acked >= policy.replicas):
        return
    for _ in range(PATIENCE_WAITS):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.incr(keys.replication_probe())
            pipe.wait(policy.replicas, policy.timeout_ms)
            _, held_by = await pipe.execute()
        if int(held_by) >= policy.replicas:
            return
    raise RedisConnectionError(
        f"{policy.replicas} replica(s) did not confirm a write within "
        f"{PATIENCE_WAITS * policy.timeout_ms / 1000:.0f} s (QT_REDIS_URL's replicas=)"
    )
