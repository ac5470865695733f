"""Lua scripts, loaded once per Redis client; each file in lua/ has one purpose."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

_LUA_DIR = Path(__file__).parent / "lua"


@cache
def _source(name: str) -> str:
    prelude = (_LUA_DIR / "common.lua").read_text()
    return prelude + "\n" + (_LUA_DIR / f"{name}.lua").read_text()


@dataclass(frozen=True)
class Scripts:
    """The queue's scripts bound to one client (EVALSHA, falling back to EVAL once)."""

    enqueue: AsyncScript
    enqueue_in_order: AsyncScript
    skip_seq_gap: AsyncScript
    register_model: AsyncScript
    claim: AsyncScript
    renew: AsyncScript
    release: AsyncScript
    start: AsyncScript
    publish: AsyncScript

    @classmethod
    def load(cls, redis: Redis) -> Scripts:
        names = cls.__dataclass_fields__
        return cls(**{name: redis.register_script(_source(name)) for name in names})
