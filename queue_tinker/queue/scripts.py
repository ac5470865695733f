"""Lua scripts, loaded once per Redis client; each file in lua/ has one purpose."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from queue_tinker.queue.observe.metrics import LATENCY_BUCKETS_S

_LUA_DIR = Path(__file__).parent / "lua"


@cache
def prelude() -> str:
    """What every script starts with: lua/common.lua, after the latency buckets (they have one
    definition, in Python; the scripts get them as a constant)."""
    buckets = "local LATENCY_BUCKETS_S = {" + ", ".join(map(str, LATENCY_BUCKETS_S)) + "}\n"
    return buckets + (_LUA_DIR / "common.lua").read_text()


@cache
def _source(name: str) -> str:
    return prelude() + "\n" + (_LUA_DIR / f"{name}.lua").read_text()


@dataclass(frozen=True)
class Scripts:
    """The queue's scripts bound to one client (EVALSHA, falling back to EVAL once)."""

    enqueue: AsyncScript
    enqueue_in_order: AsyncScript
    skip_seq_gap: AsyncScript
    register_model: AsyncScript
    take_offer: AsyncScript
    claim: AsyncScript
    renew: AsyncScript
    release: AsyncScript
    start: AsyncScript
    publish: AsyncScript
    cancel: AsyncScript
    stop_running: AsyncScript
    publish_inflight: AsyncScript

    @classmethod
    def load(cls, redis: Redis) -> Scripts:
        names = cls.__dataclass_fields__
        return cls(**{name: redis.register_script(_source(name)) for name in names})


ScriptCall = tuple[Sequence[str], Sequence[str | int | bytes]]  # (keys, args)


async def run_pipelined(
    redis: Redis, script: AsyncScript, calls: list[ScriptCall], wait: tuple[int, int] | None = None
) -> list[object]:
    """EVALSHA `script` once per call, in order, in one round trip; each reply or error in
    its place. A pipelined Script would ask SCRIPT EXISTS before every execute, a second round
    trip on each batch of the worker's hot path; here a script the server lacks (a restart, a
    SCRIPT FLUSH) costs one SCRIPT LOAD and a retry, in order, of the calls it refused, which
    never ran. With `wait` (replicas, timeout ms), a WAIT follows the calls on their
    connection and its reply comes last (None where refused calls ran again after it)."""
    replies = await _evalsha_each(redis, script.sha, calls, wait)
    acked = replies.pop() if wait is not None else None
    refused = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if refused:
        await redis.script_load(script.script)
        retried = await _evalsha_each(redis, script.sha, [calls[i] for i in refused], None)
        for i, reply in zip(refused, retried, strict=True):
            replies[i] = reply
        acked = None
    return replies if wait is None else [*replies, acked]


async def _evalsha_each(
    redis: Redis, sha: str, calls: list[ScriptCall], wait: tuple[int, int] | None
) -> list[object]:
    async with redis.pipeline(transaction=False) as pipe:
        for keys, args in calls:
            pipe.evalsha(sha, len(keys), *keys, *args)
        if wait is not None:
            pipe.wait(*wait)
        return list(await pipe.execute(raise_on_error=False))
