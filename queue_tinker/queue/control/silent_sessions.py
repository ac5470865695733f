"""Samples of a client that went away: when a gateway session that sent session_heartbeats (the
SDK sends one every 10 s) falls silent past the timeout, its client is taken for gone (killed,
crashed, its machine lost) and the samples it left are cancelled: queued ones fail at once,
running ones stop at their worker's next decode step. An RL driver that dies with a thousand
samples queued then does not hold the workers its base model shares with other tenants.

Only samples: training ops are the run's state, and a client that comes back finds them done.
A session that finished (`sessions/{id}/finish`) is forgotten, as is one never heard from (a
client that sends no heartbeats is not judged by them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from queue_tinker.errors import UserInputError
from queue_tinker.queue import redis_bytes
from queue_tinker.queue.control.actions import cancel_job
from queue_tinker.queue.keys import Keys
from queue_tinker.types import OpKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Silenced:
    """A session taken for gone, and the requests of its samplers that were cancelled."""

    session_id: str
    cancelled: dict[str, str]  # request id -> the status it had: "queued" or "running"


async def heard_from(redis: Redis, keys: Keys, session_id: str) -> None:
    """The session's client is alive now."""
    await redis.zadd(keys.session_heartbeats(), {session_id: int(time.time() * 1000)})


async def forget(redis: Redis, keys: Keys, session_id: str) -> None:
    """The session ended on purpose: its silence means nothing."""
    await redis.zrem(keys.session_heartbeats(), session_id)


async def note_sampler(
    redis: Redis, keys: Keys, session_id: str, sampler_id: str, ttl_s: int
) -> None:
    """A sampling session the session opened (its samples go if the client does)."""
    key = keys.session_samplers(session_id)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.sadd(key, sampler_id)
        pipe.expire(key, ttl_s)
        await pipe.execute()


async def silence_lapsed(redis: Redis, keys: Keys, timeout_s: float) -> list[Silenced]:
    """Cancel the unfinished samples of every session silent for `timeout_s`. Each session is
    claimed by removing it from the heartbeat set, so of several gateways one acts on it."""
    deadline_ms = int((time.time() - timeout_s) * 1000)
    lapsed = await redis_bytes.zrangebyscore_withscores(
        redis, keys.session_heartbeats(), "-inf", deadline_ms
    )
    silenced = []
    for raw, heard_ms in lapsed:
        session_id = raw.decode()
        if not await redis.zrem(keys.session_heartbeats(), session_id):
            continue  # another gateway took it, or it was heard from meanwhile
        reason = (
            f"the client of session {session_id} went silent (no session_heartbeat for "
            f"{timeout_s:g} s): cancelled"
        )
        try:
            cancelled = await _cancel_samples(redis, keys, session_id, reason)
        except Exception:  # handed back, so the next look finishes the job
            await redis.zadd(keys.session_heartbeats(), {session_id: heard_ms}, nx=True)
            raise
        log.warning(
            "session %s: no heartbeat for %g s; its client is taken for gone: %d queued and "
            "%d running samples cancelled",
            session_id,
            timeout_s,
            sum(status == "queued" for status in cancelled.values()),
            sum(status == "running" for status in cancelled.values()),
        )
        silenced.append(Silenced(session_id, cancelled))
    return silenced


async def _cancel_samples(redis: Redis, keys: Keys, session_id: str, reason: str) -> dict[str, str]:
    """Cancel every sample after its sampler's done_seq (queued or running)."""
    cancelled: dict[str, str] = {}
    for raw in sorted(await redis_bytes.smembers(redis, keys.session_samplers(session_id))):
        sampler_id = raw.decode()
        done = int(await redis_bytes.hget(redis, keys.model_meta(sampler_id), "done_seq") or 0)
        entries = await redis_bytes.xrange(redis, keys.model_ops(sampler_id), f"{done + 1}-0", "+")
        for _, fields in entries:
            if fields.get(b"kind") != OpKind.SAMPLE.value.encode():
                continue
            job_id = fields[b"job"].decode()
            with contextlib.suppress(UserInputError):  # finished meanwhile
                cancelled[job_id] = await cancel_job(redis, keys, job_id, None, reason=reason)
    return cancelled


async def watch(redis: Redis, keys: Keys, timeout_s: float) -> None:
    """Look for silent sessions every quarter of the timeout (at most every 10 s), for ever
    (the gateway runs this beside its routes; a failed look is logged and tried again)."""
    every_s = min(10.0, max(0.5, timeout_s / 4))
    while True:
        await asyncio.sleep(every_s)
        try:
            await silence_lapsed(redis, keys, timeout_s)
        except Exception as exc:  # Redis away, say: the next look catches up
            log.warning("looking for silent sessions failed (%s); trying again", exc)
