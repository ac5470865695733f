"""The fleet's recent history, kept in Redis for the dashboard's charts: every
QT_HISTORY_INTERVAL_S, per base model its queue depth, oldest wait and live workers, and the
fleet's tokens per second, for QT_HISTORY_RETENTION_S.

Every gateway replica runs the sampler; the first to take an interval's slot (SET NX on a key
named after the interval's number, counted in Redis' own clock so replicas' clocks need not
agree) samples it, so there is one sample per interval however many replicas run, and every
replica shows the same history. A series is a stream whose entry ids are the samples' times
(`<ms>-0`): Redis refuses an id at or below the last one, so a sample can never be written
twice or out of order, and each write trims the stream to the retention by that id (MINID).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from redis.typing import EncodableT, FieldT

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.fleet import fleet_load, known_base_models
from queue_tinker.queue.observe.metrics import read_metrics
from queue_tinker.queue.observe.overview import queue_overview
from queue_tinker.settings import Settings

# Wake this long after an interval begins: the slot's number is then that interval's on every
# replica, whatever the few milliseconds between their TIME calls.
WAKE_AFTER_MS = 20
# Each series' fields as stored, and how a value is read back.
BASE_FIELDS: dict[str, Callable[[bytes], float]] = {
    "depth": int,
    "oldest_wait_s": float,
    "workers": int,
}
FLEET_FIELDS: dict[str, Callable[[bytes], float]] = {"tokens_per_s": float}

log = logging.getLogger(__name__)


async def redis_now_ms(redis: RedisClient) -> int:
    """Redis' clock, the one every replica shares, in ms since the epoch."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def interval_ms(settings: Settings) -> int:
    return max(1, round(settings.history_interval_s * 1000))


async def take_sample(redis: RedisClient, keys: Keys, settings: Settings, at_ms: int) -> bool:
    """Sample the interval holding `at_ms` if no one has: True when this call wrote it."""
    every_ms = interval_ms(settings)
    bucket = at_ms // every_ms
    # The slot outlives its interval so a replica waking late still finds it taken.
    won = await redis.set(keys.history_slot(bucket), "1", nx=True, px=2 * every_ms)
    if not won:
        return False
    await write_sample(redis, keys, settings, bucket * every_ms)
    return True


async def write_sample(redis: RedisClient, keys: Keys, settings: Settings, sample_ms: int) -> None:
    """Append the fleet as it is now to every series, as the sample of time `sample_ms`."""
    overview = await queue_overview(redis, keys, settings, tenants=False)
    load = fleet_load(overview, await known_base_models(redis, keys))
    tokens = sum((await read_metrics(redis, keys)).tokens.values())
    previous = await redis_bytes.xrevrange(redis, keys.history_fleet(), count=1)
    rate = _tokens_per_s(previous, tokens, sample_ms)
    retention_ms = round(settings.history_retention_s * 1000)
    oldest_kept = f"{sample_ms - retention_ms}-0"
    entry_id = f"{sample_ms}-0"
    streams: dict[str, dict[FieldT, EncodableT]] = {
        keys.history_fleet(): {"tokens": tokens, "tokens_per_s": _text(rate)}
    }
    for base, entry in load.items():
        streams[keys.history_base(base)] = {
            "depth": entry.depth,
            "oldest_wait_s": round(entry.oldest_wait_s, 3),
            "workers": entry.workers,
        }
    async with redis.pipeline(transaction=True) as pipe:  # readers see whole samples only
        for key, fields in streams.items():
            pipe.xadd(key, fields, id=entry_id, minid=oldest_kept, approximate=False)
            # Gone with the last gateway that sampled: a stream outlives its newest entry by
            # the retention, no longer.
            pipe.pexpire(key, retention_ms + interval_ms(settings))
        await pipe.execute()


def _tokens_per_s(
    previous: list[redis_bytes.StreamEntry], tokens: int, sample_ms: int
) -> float | None:
    """Tokens per second since the sample before (qt_tokens' totals' difference over the time
    between them); None with no sample before, or a total that went down (Redis lost it)."""
    if not previous:
        return None
    entry_id, fields = previous[0]
    before_ms = int(entry_id.split(b"-")[0])
    before = int(fields.get(b"tokens", 0))
    if sample_ms <= before_ms or tokens < before:
        return None
    return round((tokens - before) * 1000 / (sample_ms - before_ms), 3)


def _text(value: float | None) -> str:
    return "" if value is None else repr(value)


async def sample_forever(
    redis: RedisClient, keys: Keys, settings: Settings, stopping: asyncio.Event
) -> None:
    """Take the samples this replica gets to first, at the start of every interval, until
    `stopping` is set (the gateway runs this beside its routes; a failed sample is logged,
    the next one taken). Stopped by the event, not only cancelled: redis-py can swallow a
    cancellation that lands mid-command, and the loop would go on for ever."""
    every_ms = interval_ms(settings)
    while not stopping.is_set():
        try:
            now_ms = await redis_now_ms(redis)
            await _sleep(stopping, (every_ms - now_ms % every_ms + WAKE_AFTER_MS) / 1000)
            if not stopping.is_set():
                await take_sample(redis, keys, settings, await redis_now_ms(redis))
        except Exception as exc:  # Redis away, say: the next interval tries again
            log.warning("sampling the fleet's history failed (%s); trying again", exc)
            await _sleep(stopping, every_ms / 1000)


async def _sleep(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if `stopping` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


async def read_history(redis: RedisClient, keys: Keys, settings: Settings) -> dict[str, Any]:
    """Every series over the retention, as columns: times (s since the epoch) and values, the
    fleet's tokens per second (None where unknown) and each base model's with any sample."""
    now_ms = await redis_now_ms(redis)
    since = f"{now_ms - round(settings.history_retention_s * 1000)}-0"
    bases = sorted(await known_base_models(redis, keys))
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xrange(keys.history_fleet(), since, "+")
        for base in bases:
            pipe.xrange(keys.history_base(base), since, "+")
        fleet, *per_base = await pipe.execute()
    base_models = []
    for base, entries in zip(bases, per_base, strict=True):
        if entries:
            columns = _columns(entries, BASE_FIELDS)
            base_models.append({"base_model": base, **columns})
    return {
        "interval_s": settings.history_interval_s,
        "retention_s": settings.history_retention_s,
        "now": now_ms / 1000,
        "fleet": _columns(fleet, FLEET_FIELDS),
        "base_models": base_models,
    }


def _columns(
    entries: list[redis_bytes.StreamEntry], fields: dict[str, Callable[[bytes], float]]
) -> dict[str, list[float | None]]:
    """Entries as columns: `t` (s since the epoch) and each field (None where left empty)."""
    columns: dict[str, list[float | None]] = {
        "t": [int(entry_id.split(b"-")[0]) / 1000 for entry_id, _ in entries]
    }
    for name, read in fields.items():
        raw = [values.get(name.encode(), b"") for _, values in entries]
        columns[name] = [read(value) if value else None for value in raw]
    return columns
