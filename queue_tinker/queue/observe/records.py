"""The records stream: state changes on their way to Postgres, written behind the hot path.

Producers are the Lua scripts (requests, models) and processes (sessions, workers); the
recorder consumes it as a consumer group, so an entry is acknowledged only after Postgres
committed it, and a crashed recorder's entries are claimed by another.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.keys import Keys
from queue_tinker.types import RECORD_ADAPTER, Record

log = logging.getLogger(__name__)

GROUP = "recorder"
BELL_LENGTH = 16  # the flush and written bells keep only their newest entries
WAIT_SLICE_MS = 1_000  # a waiting reader looks again at least this often
# How long a read of Postgres waits for the recorders to write what was appended before it
# (wait_recorded); past it, the read goes ahead and says so.
RECORD_WAIT_S = 5.0
_JSON_FIELDS = ("metrics", "lora_config", "user_metadata")

Entry = tuple[bytes, Record | None]  # None: malformed, acknowledged and skipped


def parse_record(fields: dict[bytes, bytes]) -> Record:
    """A flat stream entry (all strings) as its typed record; '' means absent."""
    data: dict[str, object] = {}
    for raw_key, raw_value in fields.items():
        key, value = raw_key.decode(), raw_value.decode()
        if value == "":
            continue
        data[key] = json.loads(value) if key in _JSON_FIELDS else value
    return RECORD_ADAPTER.validate_python(data)


def flatten_record(record: Record) -> dict[FieldT, EncodableT]:
    """A record as a flat stream entry: str names, str values (typed as XADD takes them)."""
    flat: dict[FieldT, EncodableT] = {}
    for key, value in record.model_dump(mode="json").items():
        if value is None:
            continue
        flat[key] = json.dumps(value) if key in _JSON_FIELDS else str(value)
    return flat


class RecordLog:
    def __init__(self, redis: RedisClient, keys: Keys) -> None:
        self.redis = redis
        self.stream = keys.records()
        self.dead_stream = keys.dead_records()
        self.flush_bell = keys.records_flush()
        self.written_bell = keys.records_written()

    async def append(self, record: Record) -> None:
        await self.redis.xadd(self.stream, flatten_record(record))

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(
        self, consumer: str, *, count: int, block_ms: int | None, pending: bool = False
    ) -> list[Entry]:
        """New entries for this consumer, or (pending=True) the ones it read but never acked."""
        reply = await self._in_group(
            lambda: self.redis.xreadgroup(
                GROUP, consumer, {self.stream: "0" if pending else ">"}, count=count, block=block_ms
            )
        )
        return self._parse(reply[0][1] if reply else [])

    async def claim_stale(self, consumer: str, *, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over entries another (dead) recorder read but never acknowledged."""
        reply = await self._in_group(
            lambda: self.redis.xautoclaim(
                self.stream, GROUP, consumer, min_idle_time=min_idle_ms, start_id="0-0", count=count
            )
        )
        return self._parse(reply[1])

    async def forget_gone(self, consumer: str, *, min_idle_ms: int) -> list[str]:
        """Drop the group's consumers (other than `consumer`) idle this long with nothing
        pending: recorders of processes that are gone. Each worker is a consumer of its own
        name, so without this the group's consumer list grows with every worker ever started."""
        gone = [
            c["name"]
            for c in await self.redis.xinfo_consumers(self.stream, GROUP)
            if c["pending"] == 0 and c["idle"] >= min_idle_ms and _text(c["name"]) != consumer
        ]
        for name in gone:
            await self.redis.xgroup_delconsumer(self.stream, GROUP, name)
        return [_text(name) for name in gone]

    async def _in_group(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """A consumer-group command; the group is made again if Redis lost it (restarted
        without persistence, or the stream was deleted), which would otherwise fail every
        read with NOGROUP for good."""
        try:
            return await call()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning(
                "records: consumer group %r missing (Redis lost its data?); creating it again",
                GROUP,
            )
            await self.ensure_group()
            return await call()

    async def ack(self, entry_ids: list[bytes]) -> None:
        """The entries are in Postgres: acknowledged, deleted (so the stream holds only what
        is still to write), and the written bell rung for readers waiting on them."""
        if entry_ids:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xack(self.stream, GROUP, *entry_ids)
                pipe.xdel(self.stream, *entry_ids)
                pipe.xadd(self.written_bell, {"n": len(entry_ids)}, maxlen=BELL_LENGTH)
                await pipe.execute()

    async def wait_recorded(self, timeout_s: float) -> bool:
        """Read-your-writes for a reader of Postgres: wait until every event appended before
        this call is written there. Written entries leave the stream, so this waits until it
        holds none up to its newest one now, asking the recorders to write at once (the
        flush bell) and waking when one has written a batch (the written bell). True once
        written; False if the recorders did not get there within `timeout_s` (none is running,
        or Postgres is away). One round trip when the record is caught up."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrevrange(self.stream, count=1)
            pipe.xrevrange(self.written_bell, count=1)
            newest, rung = await pipe.execute()
        if not newest:
            return True
        upto, cursor = newest[0][0], rung[0][0] if rung else b"0-0"
        await self.redis.xadd(self.flush_bell, {"upto": upto}, maxlen=BELL_LENGTH)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while await redis_bytes.xrange(self.redis, self.stream, max=upto, count=1):
            left_ms = int((deadline - loop.time()) * 1000)
            if left_ms <= 0:
                return False
            rang = await redis_bytes.xread(
                self.redis, {self.written_bell: cursor}, block=min(left_ms, WAIT_SLICE_MS)
            )
            if rang:
                cursor = rang[0][1][-1][0]
        return True

    async def flush_cursor(self) -> bytes:
        """Where a recorder starts watching the flush bell: its newest entry now."""
        rung = await redis_bytes.xrevrange(self.redis, self.flush_bell, count=1)
        return rung[0][0] if rung else b"0-0"

    async def flush_asked(self, cursor: bytes, block_ms: int) -> bytes | None:
        """The flush bell's newest entry after `cursor` (a reader asked for a write now),
        waiting up to `block_ms` for one; None if none came."""
        rang = await redis_bytes.xread(self.redis, {self.flush_bell: cursor}, block=block_ms)
        return rang[0][1][-1][0] if rang else None

    async def bury(self, record: Record, reason: str) -> None:
        """Keep a record Postgres refused on the dead-letter stream, with the reason."""
        await self.redis.xadd(self.dead_stream, {**flatten_record(record), "reason": reason})

    async def waiting(self, count: int) -> list[Entry]:
        """The oldest `count` entries not yet written to Postgres, read or not by a recorder
        (an entry leaves the stream when its write is acknowledged)."""
        return self._parse(await redis_bytes.xrange(self.redis, self.stream, count=count))

    async def dead(self, tenant: str | None, *, scan: int = 200, show: int = 20) -> dict[str, Any]:
        """The dead-letter stream as the dashboard shows it: how many records Postgres refused
        and the newest `show` (of the newest `scan`, for one tenant's view), each with the
        record's type, id, tenant and the reason."""
        rows = []
        entries = await redis_bytes.xrevrange(self.redis, self.dead_stream, count=scan)
        for entry_id, fields in entries:
            row = {_text(k): _text(v) for k, v in (fields or {}).items()}
            if tenant is None or row.get("tenant_id") == tenant:
                rows.append(
                    {
                        "entry": _text(entry_id or b""),
                        "type": row.get("type", "?"),
                        "id": row.get("id", "?"),
                        "tenant_id": row.get("tenant_id"),
                        "reason": row.get("reason", ""),
                    }
                )
        total = int(await self.redis.xlen(self.dead_stream)) if tenant is None else len(rows)
        return {"count": total, "recent": rows[:show]}

    async def backlog(self) -> int:
        """Entries not yet written to Postgres."""
        return int(await self.redis.xlen(self.stream))

    def _parse(self, raw: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Entry]:
        entries: list[Entry] = []
        for entry_id, fields in raw:
            if not fields:  # deleted while pending
                continue
            try:
                entries.append((entry_id, parse_record(fields)))
            except (ValidationError, ValueError) as exc:
                # A malformed entry must not block the stream forever: log it, skip it.
                log.error("dropping malformed record %s: %s", entry_id, exc)
                entries.append((entry_id, None))
        return entries


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
