"""The recorder moves record events from Redis into Postgres, and nothing can jam it."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine

from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import RecordLog
from queue_tinker.services.recorder import WRITE_INTERVAL_S, Recorder
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.store.queries import get_training_run, requests_for_model
from queue_tinker.types import JobStatus, ModelRecord, OpKind, RequestRecord, SessionRecord


@pytest.fixture
def redis(aredis: Redis) -> Redis:
    return aredis


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(database_url)
    yield engine
    await engine.dispose()


def model(model_id: str, tenant: str = "default") -> ModelRecord:
    return ModelRecord(
        id=model_id,
        tenant_id=tenant,
        session_id=None,
        base_model="tiny",
        lora_config={"rank": 4},
        created_at=time.time(),
    )


async def test_records_reach_postgres_and_leave_the_stream(
    redis: Redis, db: AsyncEngine, key_prefix: str
) -> None:
    """Appended events are written, acknowledged and removed from the stream."""
    log = RecordLog(redis, Keys(key_prefix))
    await log.ensure_group()
    await log.append(SessionRecord(id="s1", tenant_id="default", created_at=time.time()))
    await log.append(model("run-1"))
    recorder = Recorder(log, session_factory(db), consumer="c1")
    await recorder.drain()
    run = await get_training_run(session_factory(db), "run-1")
    assert run is not None and run.base_model == "tiny"
    assert await log.backlog() == 0


@pytest.mark.dead_letters
async def test_a_refused_record_is_set_aside_not_retried_forever(
    redis: Redis, db: AsyncEngine, key_prefix: str
) -> None:
    """A record Postgres refuses (a NUL character, which no text column takes) goes to the
    dead-letter stream; the others in its batch are written."""
    keys = Keys(key_prefix)
    log = RecordLog(redis, keys)
    await log.ensure_group()
    await log.append(model("good-1"))
    await log.append(model("bad").model_copy(update={"base_model": "tiny\x00"}))
    await log.append(model("good-2"))
    await Recorder(log, session_factory(db), consumer="c1").drain()
    sessions = session_factory(db)
    assert await get_training_run(sessions, "good-1") is not None
    assert await get_training_run(sessions, "good-2") is not None
    assert await get_training_run(sessions, "bad") is None
    dead = await redis.xrange(keys.dead_records())
    assert [fields[b"id"] for _, fields in dead] == [b"bad"]
    assert b"0x00" in dead[0][1][b"reason"]
    assert await log.backlog() == 0


async def test_entries_of_a_dead_recorder_are_taken_over(
    redis: Redis, db: AsyncEngine, key_prefix: str
) -> None:
    """Entries one consumer read but never acknowledged are claimed by another."""
    log = RecordLog(redis, Keys(key_prefix))
    await log.ensure_group()
    await log.append(model("orphaned"))
    assert len(await log.read("crashed", count=10, block_ms=None)) == 1  # read, never acked
    taken = await log.claim_stale("survivor", min_idle_ms=0, count=10)
    assert [record.id for _, record in taken if record is not None] == ["orphaned"]
    # Once its entries are taken, the dead consumer is forgotten; one with entries pending,
    # and the caller itself, are kept.
    await log.append(model("held"))
    assert len(await log.read("busy", count=10, block_ms=None)) == 1
    assert await log.forget_gone("survivor", min_idle_ms=0) == ["crashed"]
    names = {c["name"] for c in await redis.xinfo_consumers(log.stream, "recorder")}
    assert names == {b"busy", b"survivor"}
    # A recent one is kept too: idle time is what tells a gone recorder from a quiet one.
    assert await log.forget_gone("survivor", min_idle_ms=60_000) == []


async def test_under_steady_load_events_gather_into_one_write_a_second(
    redis: Redis, db: AsyncEngine, key_prefix: str
) -> None:
    """Events arriving every 20 ms for 2.5 s reach Postgres in at most one transaction per
    WRITE_INTERVAL_S (plus the first, at once), not one per event or per read: each write
    costs the process it runs in milliseconds of Python and round trips whatever its size."""
    log = RecordLog(redis, Keys(key_prefix))
    await log.ensure_group()
    await log.append(model("steady"))
    recorder = Recorder(log, session_factory(db), consumer="c1")
    running = asyncio.create_task(recorder.run())
    began = time.monotonic()
    sent = 0
    while time.monotonic() - began < 2.5:
        await log.append(request("steady", sent))
        sent += 1
        await asyncio.sleep(0.02)
    elapsed = time.monotonic() - began
    during = recorder.batches_written
    recorder.stop()
    await running
    await recorder.drain()
    rows = await requests_for_model(session_factory(db), "steady")
    assert len(rows) == sent
    assert 2 <= during <= math.ceil(elapsed / WRITE_INTERVAL_S) + 1, (during, elapsed)


def request(model_id: str, seq: int) -> RequestRecord:
    return RequestRecord(
        id=f"{model_id}-{seq}",
        model_id=model_id,
        seq=seq,
        kind=OpKind.FORWARD_BACKWARD,
        status=JobStatus.DONE,
        tenant_id="default",
        queued_at=time.time(),
    )


async def test_a_read_waits_for_the_recorder_which_writes_at_once_when_asked(
    redis: Redis, db: AsyncEngine, key_prefix: str
) -> None:
    """Read-your-writes without the reader writing: wait_recorded returns once a running
    recorder has written every event appended before the call. The recorder is in its write
    interval (it just wrote a batch); the reader's flush bell makes it write at once, well
    within that second; the run is then in Postgres."""
    log = RecordLog(redis, Keys(key_prefix))
    await log.ensure_group()
    assert await log.wait_recorded(1.0)  # nothing waiting: at once
    recorder = Recorder(log, session_factory(db), consumer="c1")
    running = asyncio.create_task(recorder.run())
    try:
        await log.append(model("first"))
        assert await log.wait_recorded(5.0)  # the recorder's first batch: now in its interval
        await log.append(model("read-after-write"))
        began = time.monotonic()
        assert await log.wait_recorded(5.0)
        waited = time.monotonic() - began
        assert waited < WRITE_INTERVAL_S / 2, f"waited {waited:.2f} s: the flush bell went unheard"
        assert await get_training_run(session_factory(db), "read-after-write") is not None
    finally:
        recorder.stop()
        await running


async def test_with_no_recorder_a_read_stops_waiting_after_its_timeout(
    redis: Redis, key_prefix: str
) -> None:
    """No recorder runs: wait_recorded says so (False) once its timeout has passed, and the
    event is still in the stream for the next recorder."""
    log = RecordLog(redis, Keys(key_prefix))
    await log.ensure_group()
    await log.append(model("nobody-writes-me"))
    began = time.monotonic()
    assert not await log.wait_recorded(0.5)
    assert 0.5 <= time.monotonic() - began < 2.0
    assert await log.backlog() == 1
