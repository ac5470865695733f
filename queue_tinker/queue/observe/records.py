"""The records stream: state changes on their way to Postgres, written behind the hot path.

Producers are the Lua scripts (requests, models) and processes (sessions, workers); the
recorder consumes it as a consumer group, so an entry is acknowledged only after Postgres
committed it, and a crashed recorder's entries are claimed by another.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.keys import Keys
from queue_tinker.types import RECORD_ADAPTER, Record

log = logging.getLogger(__name__)

GROUP = "recorder"
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
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.stream = keys.records()
        self.dead_stream = keys.dead_records()

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
        if entry_ids:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xack(self.stream, GROUP, *entry_ids)
                pipe.xdel(self.stream, *entry_ids)
                await pipe.execute()

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
