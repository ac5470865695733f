"""Lua scripts, loaded once per Redis client; each file in lua/ has one purpose."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from queue_tinker.queue.metrics import LATENCY_BUCKETS_S

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
