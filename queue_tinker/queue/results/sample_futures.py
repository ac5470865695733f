"""Batched polling of a sampling session's results (the Tinker protocol's retrieve_futures) and
its client ids (join_sampling_session).

A sampling client (the original is client 0, each clone gets its own id) polls once for all
its samples in flight instead of holding one long poll per sample. Each sample is noted in its
client's pending set when submitted; a poll moves the finished ones into the client's
completions, numbered by a per-client cursor, and answers those after the cursor the client
last saw. A completion stays until a poll carries a cursor past it, so an answer lost in
transit is sent again.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.keys import Keys
from queue_tinker.types import JobStatus

# The SDK keeps a client's sample seq_ids in one block of this size: seq_id // CLIENT_BLOCK is
# the client id (tinker.types.SamplingSessionFuturesTarget).
CLIENT_BLOCK = 1_000_000_000
DONE_STATES = {JobStatus.DONE.value: "finished", JobStatus.FAILED.value: "failed"}


@dataclass(frozen=True)
class Completion:
    request_id: str
    state: str  # "finished" or "failed", as the SDK's FutureCompletion names them
    cursor: int


class SampleFutures:
    def __init__(self, redis: Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s

    async def join(self, sampler_id: str) -> int:
        """A new client id of the session, never given before (1, 2, ...)."""
        key = self.keys.sampler_clients(sampler_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, self.ttl_s)
            client, _ = await pipe.execute()
        return int(client)

    async def add(self, sampler_id: str, seq_id: int, request_id: str) -> None:
        """Note a submitted sample as pending for its client."""
        key = self.keys.sample_pending(sampler_id, seq_id // CLIENT_BLOCK)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(key, request_id)
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def pending(self, sampler_id: str, client: int) -> list[str]:
        members = await redis_bytes.smembers(
            self.redis, self.keys.sample_pending(sampler_id, client)
        )
        return sorted(m.decode() for m in members)

    async def finished(self, request_ids: list[str]) -> dict[str, str]:
        """request id -> "finished" / "failed", for those of `request_ids` that are done."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hget(self.keys.job(request_id), "status")
            statuses = await pipe.execute()
        done = {}
        for request_id, status in zip(request_ids, statuses, strict=True):
            state = DONE_STATES.get(status.decode()) if status else "failed"  # expired: gone
            if state is not None:
                done[request_id] = state
        return done

    async def complete(self, sampler_id: str, client: int, done: dict[str, str]) -> None:
        """Move finished samples from the client's pending set into its completions, each with
        the next cursor number (NX: a completion noted twice keeps its first number)."""
        if not done:
            return
        cursor_key = self.keys.sample_cursor(sampler_id, client)
        last = int(await self.redis.incrby(cursor_key, len(done)))
        completions = self.keys.sample_completions(sampler_id, client)
        pending = self.keys.sample_pending(sampler_id, client)
        members = {
            f"{state}:{request_id}": last - len(done) + 1 + i
            for i, (request_id, state) in enumerate(sorted(done.items()))
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(completions, members, nx=True)
            pipe.srem(pending, *done)
            for key in (completions, pending, cursor_key):
                pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def after(self, sampler_id: str, client: int, cursor: int) -> list[Completion]:
        """The client's completions after `cursor`; those at or before it are dropped (the
        client has seen them)."""
        key = self.keys.sample_completions(sampler_id, client)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(key, "-inf", cursor)
            pipe.zrangebyscore(key, f"({cursor}", "+inf", withscores=True)
            _, rows = await pipe.execute()
        completions = []
        for member, score in rows:
            state, _, request_id = member.decode().partition(":")
            completions.append(Completion(request_id=request_id, state=state, cursor=int(score)))
        return completions
