"""The recorder: moves record events from Redis into Postgres, in batches, behind the hot path.

If Postgres is down, entries stay unacknowledged in the stream and are retried with backoff;
the record catches up when the database returns. Any process may run a recorder (workers and
the gateway do); the consumer group shares the work between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import async_sessionmaker

from queue_tinker.config.services import ServicesConfig
from queue_tinker.queue.connection import connect
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import Entry, RecordLog
from queue_tinker.queue.outage import describe, is_redis_error
from queue_tinker.store.db import make_engine, refused, session_factory
from queue_tinker.store.record_writer import apply_records
from queue_tinker.types import (
    Record,
)

log = logging.getLogger(__name__)

BATCH = 500
# Write at most this often: a Postgres batch costs about 2 ms of Python and a few round trips
# whatever its size (30 request events: 2.5 ms of CPU, 150: 5.9 ms), so under load events
# gather into large batches instead of one write per op. The record lags Redis by about this
# much, unless a reader of Postgres asks for a write now (RecordLog.wait_recorded rings the
# flush bell: REST reads wait for what their client was told exists). At 0.2 s a worker's own
# recorder cost the tiny model's training step 6% beside it (bench notes).
WRITE_INTERVAL_S = 1.0
STALE_MS = 30_000  # a recorder silent this long is presumed dead; its entries are taken over
# A consumer silent this long with nothing pending is a recorder that is gone: forgotten.
GONE_MS = 600_000
FORGET_EVERY_S = 60.0
# How often a busy recorder looks for such entries (an idle one every IDLE_TAKE_OVER_S). A
# recorder always has new events under steady load, so without this a dead one's entries
# would wait for the first quiet second, which a busy deployment may never have.
TAKE_OVER_EVERY_S = 5.0
IDLE_TAKE_OVER_S = 1.0
# How long one read waits for new events. It is also how long a stop waits for the read in
# progress (a process's shutdown waits for its recorder's flush): a blocking read is not
# cancelled, since a CancelledError inside a Redis or database call can be absorbed by the
# driver. An idle recorder reads five times a second.
RECORD_READ_BLOCK_MS = 200
MAX_BACKOFF_S = 5.0
SHUTDOWN_FLUSH_S = 5.0


@dataclass
class _Outage:
    """The run loop's failures: since when it has been failing (None: it is not), on which
    side, and how long it waits before its next try."""

    since: float | None = None
    side: str = "Postgres"
    backoff: float = 0.0

    def failed(self, exc: Exception, now: float) -> float:
        """Note a failed round and say so; the seconds to wait before the next."""
        if self.since is None:
            self.since = now
        self.backoff = min(MAX_BACKOFF_S, max(0.25, self.backoff * 2))
        # Either side may be away: say which, so an operator looks at the right one.
        self.side = "Redis" if is_redis_error(exc) else "Postgres"
        action = "read" if self.side == "Redis" else "write"
        log.warning(
            "recorder: %s %s failed (%s); retrying in %.2fs",
            self.side,
            action,
            describe(exc),
            self.backoff,
        )
        return self.backoff


class Recorder:
    def __init__(self, log_: RecordLog, sessions: async_sessionmaker, consumer: str) -> None:
        self.log = log_
        self.sessions = sessions
        self.consumer = consumer
        self._stopping = asyncio.Event()
        # When the next take-over and forget are due, on the loop's clock (set by run()).
        self._take_over_at = 0.0
        self._idle_take_over_at = 0.0
        self._forget_at = 0.0
        self.batches_written = 0  # Postgres transactions of records this recorder made

    def stop(self) -> None:
        """Finish the batch in hand and return from run() (within one read block)."""
        self._stopping.set()

    async def run(self) -> None:
        # Stopped by a flag, not by cancellation: a CancelledError raised inside a database
        # call can be absorbed by the driver, which would leave this loop running forever.
        grouped = False  # the consumer group is made inside the loop: Redis may be away too
        flush_cursor: bytes | None = None  # the newest flush request seen
        outage = _Outage()
        loop = asyncio.get_running_loop()
        self._take_over_at = loop.time() + TAKE_OVER_EVERY_S
        self._forget_at = loop.time() + FORGET_EVERY_S
        while not self._stopping.is_set():
            try:
                if not grouped:
                    await self.log.ensure_group()
                    grouped = True
                if flush_cursor is None:
                    flush_cursor = await self.log.flush_cursor()
                wrote = await self._round(loop)
                await self._succeeded(outage, wrote, loop)
                if wrote and wrote < BATCH:
                    flush_cursor = await self._pause(WRITE_INTERVAL_S, flush_cursor, loop)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._wait_unless_stopped(outage.failed(exc, loop.time()))

    async def _round(self, loop: asyncio.AbstractEventLoop) -> int:
        """One batch, then a dead recorder's entries when this one is idle or the take-over
        is due, and gone consumers forgotten when that is due. How many entries were written."""
        wrote = await self.step(block_ms=RECORD_READ_BLOCK_MS)
        now = loop.time()
        if now >= self._take_over_at or (not wrote and now >= self._idle_take_over_at):
            self._take_over_at = now + TAKE_OVER_EVERY_S
            self._idle_take_over_at = now + IDLE_TAKE_OVER_S
            wrote += await self._take_over_stale()
        if loop.time() >= self._forget_at:  # listing the group costs: once a minute
            self._forget_at = loop.time() + FORGET_EVERY_S
            await self.log.forget_gone(self.consumer, min_idle_ms=GONE_MS)
        return wrote

    async def _succeeded(
        self, outage: _Outage, wrote: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        """After a round that went through: no more backoff, and an outage over once a write
        went through (not a no-op)."""
        outage.backoff = 0.0
        if outage.since is None or not wrote:
            return
        log.info(
            "recorder: %s is back after %.0fs; %d events still to write",
            outage.side,
            loop.time() - outage.since,
            await self.log.backlog(),
        )
        outage.since = None

    async def _pause(
        self, seconds: float, flush_cursor: bytes, loop: asyncio.AbstractEventLoop
    ) -> bytes:
        """Wait before the next batch, unless a reader asks for a write now (the flush bell)
        or the recorder stops; the flush bell's cursor after it."""
        end = loop.time() + seconds
        while not self._stopping.is_set():
            left_ms = int((end - loop.time()) * 1000)
            if left_ms <= 0:
                break
            asked = await self.log.flush_asked(flush_cursor, min(left_ms, RECORD_READ_BLOCK_MS))
            if asked is not None:
                return asked
        return flush_cursor

    async def _wait_unless_stopped(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def step(self, *, block_ms: int | None) -> int:
        """Write one batch: this consumer's unacknowledged entries first, then new ones."""
        entries = await self.log.read(self.consumer, count=BATCH, block_ms=None, pending=True)
        if not entries:
            entries = await self.log.read(self.consumer, count=BATCH, block_ms=block_ms)
        await self._write(entries)
        return len(entries)

    async def drain(self) -> None:
        """Write everything currently in the stream (used on shutdown and by tests)."""
        while await self.step(block_ms=None):
            pass

    async def _take_over_stale(self) -> int:
        entries = await self.log.claim_stale(self.consumer, min_idle_ms=STALE_MS, count=BATCH)
        await self._write(entries)
        return len(entries)

    async def _write(self, entries: list[Entry]) -> None:
        if not entries:
            return
        records = [record for _, record in entries if record is not None]
        if records:
            self.batches_written += 1
            try:
                await apply_records(self.sessions, records)
            except DBAPIError as exc:
                # One record that can never apply must not block the stream: write the batch
                # one by one and set the refused ones aside. Outages (connection errors) are
                # raised on; run() retries them whole.
                if not refused(exc):
                    raise
                await self._write_one_by_one(records)
        await self.log.ack([entry_id for entry_id, _ in entries])

    async def _write_one_by_one(self, records: list[Record]) -> None:
        for record in records:
            try:
                await apply_records(self.sessions, [record])
            except DBAPIError as exc:
                if not refused(exc):
                    raise
                reason = str(exc.orig or exc).splitlines()[0][:500]
                log.error(
                    "recorder: Postgres refused %s %s (%s); kept on the dead-letter stream",
                    record.type,
                    record.id,
                    reason,
                )
                await self.log.bury(record, reason)


class RecorderThread:
    """A Recorder on its own thread, event loop and connections.

    Each Postgres batch costs milliseconds of Python (parsing, SQLAlchemy); on the worker's
    loop that time delays op pick-up and publishes. Profiled on the queue benchmark, the
    recorder took over a quarter of the worker's CPU there, and switching it off cut the
    trivial op's p99 round trip from 3.3 to 1.5 ms.
    """

    def __init__(self, config: ServicesConfig, consumer: str) -> None:
        if not config.redis_url or not config.database_url:
            raise ValueError("a recorder needs QT_REDIS_URL and QT_DATABASE_URL")
        self._urls = (config.redis_url, config.database_url)
        self._keys = Keys(config.key_prefix)
        self.consumer = consumer
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recorder: Recorder | None = None
        self._thread = threading.Thread(
            target=self._main, name=f"qt-recorder-{consumer}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(timeout=30)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop reading, write what is in the stream (bounded), close connections."""
        loop, recorder = self._loop, self._recorder
        if loop is not None and recorder is not None and loop.is_running():
            loop.call_soon_threadsafe(recorder.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("recorder %s did not stop within %.0fs", self.consumer, timeout)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        redis_url, database_url = self._urls
        redis = connect(redis_url)
        db = make_engine(database_url)
        recorder = Recorder(RecordLog(redis, self._keys), session_factory(db), self.consumer)
        self._loop, self._recorder = asyncio.get_running_loop(), recorder
        self._ready.set()
        try:
            await recorder.run()
            # Leave the record complete where Postgres answers; the rest stays in the stream
            # for the next recorder.
            await asyncio.wait_for(recorder.drain(), SHUTDOWN_FLUSH_S)
        except Exception as exc:
            log.warning("recorder %s: record not flushed on shutdown (%s)", self.consumer, exc)
        finally:
            await redis.aclose()
            await db.dispose()
