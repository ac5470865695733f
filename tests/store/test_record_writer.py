"""Record events land in Postgres in any order, any number of times, with the same result."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.store.models import RequestRow, SessionRow, TenantRow, WorkerRow
from queue_tinker.store.queries import (
    count_requests_by_status,
    get_request,
    get_training_run,
    requests_for_model,
)
from queue_tinker.store.record_writer import apply_records
from queue_tinker.types.enums import JobStatus, OpKind
from queue_tinker.types.service.records import (
    ModelRecord,
    RequestRecord,
    SessionRecord,
    WorkerRecord,
)

Sessions = async_sessionmaker[AsyncSession]
T0 = 1_700_000_000.0
PER_REQUEST = ("id", "seq", "idempotency_key")  # columns that differ between requests anyway


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[Sessions]:
    engine = make_engine(database_url)
    yield session_factory(engine)
    await engine.dispose()


def _id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, tz=UTC)


def _lifecycle(request_id: str, model_id: str, seq: int = 0) -> list[RequestRecord]:
    """queued → running → done snapshots of one request, as the queue emits them."""
    base: dict[str, Any] = {
        "id": request_id,
        "model_id": model_id,
        "seq": seq,
        "kind": OpKind.PING,
        "tenant_id": "default",
        "idempotency_key": f"idem-{request_id}",
        "queued_at": T0,
    }
    running = {**base, "started_at": T0 + 1, "worker_id": "w1", "attempts": 1}
    return [
        RequestRecord(**base, status=JobStatus.QUEUED),
        RequestRecord(**running, status=JobStatus.RUNNING),
        RequestRecord(**running, status=JobStatus.DONE, finished_at=T0 + 2, metrics={"loss": 0.5}),
    ]


def _columns(row: Any) -> dict[str, Any]:
    return {c.key: getattr(row, c.key) for c in row.__table__.columns}


async def test_out_of_order_events_end_done(sessions: Sessions) -> None:
    """done, then running, then queued (separate batches) ends done with every timestamp."""
    request_id = _id("req")
    queued, running, done = _lifecycle(request_id, _id("model"))
    for record in (done, running, queued):
        await apply_records(sessions, [record])
    row = await get_request(sessions, request_id)
    assert row is not None
    assert row.status == JobStatus.DONE
    assert (row.queued_at, row.started_at, row.finished_at) == (_at(0), _at(1), _at(2))
    assert (row.worker_id, row.attempts, row.metrics) == ("w1", 1, {"loss": 0.5})
    assert row.idempotency_key == f"idem-{request_id}"


async def test_every_order_gives_the_same_row(sessions: Sessions) -> None:
    """Each permutation of a request's events, one per batch or all in one, gives one row."""
    rows: list[dict[str, Any]] = []
    for order in itertools.permutations(range(3)):
        for one_batch in (False, True):
            request_id = _id("req")
            events = _lifecycle(request_id, "perm-model", seq=len(rows))
            picked = [events[i] for i in order]
            batches = [picked] if one_batch else [[e] for e in picked]
            for batch in batches:
                await apply_records(sessions, batch)
            row = await get_request(sessions, request_id)
            rows.append({k: v for k, v in _columns(row).items() if k not in PER_REQUEST})
    assert all(row == rows[0] for row in rows)
    assert rows[0]["status"] == JobStatus.DONE


async def test_duplicates_are_idempotent(sessions: Sessions) -> None:
    """Applying the same events again, or twice within a batch, changes nothing."""
    request_id = _id("req")
    events = _lifecycle(request_id, _id("model"))
    await apply_records(sessions, events + events)
    first = _columns(await get_request(sessions, request_id))
    await apply_records(sessions, events)
    await apply_records(sessions, [events[2], events[2]])
    assert _columns(await get_request(sessions, request_id)) == first


async def test_failed_request_keeps_error(sessions: Sessions) -> None:
    """A failed request keeps its error and category when a late 'running' event arrives."""
    request_id = _id("req")
    queued, running, _ = _lifecycle(request_id, _id("model"))
    failed = running.model_copy(
        update={
            "status": JobStatus.FAILED,
            "finished_at": T0 + 3,
            "error": "seq 7: expected 3 tokens, got 2",
            "error_category": "user",
        }
    )
    await apply_records(sessions, [failed])
    await apply_records(sessions, [running, queued])
    row = await get_request(sessions, request_id)
    assert row is not None
    assert (row.status, row.finished_at) == (JobStatus.FAILED, _at(3))
    assert (row.error, row.error_category) == ("seq 7: expected 3 tokens, got 2", "user")


async def test_later_attempt_wins_within_a_status(sessions: Sessions) -> None:
    """A re-run on another worker (higher attempts) is not undone by the older attempt's event."""
    request_id = _id("req")
    _, running, _ = _lifecycle(request_id, _id("model"))
    retry = running.model_copy(update={"worker_id": "w2", "attempts": 2, "started_at": T0 + 9})
    await apply_records(sessions, [retry])
    await apply_records(sessions, [running])
    row = await get_request(sessions, request_id)
    assert row is not None
    assert (row.worker_id, row.attempts, row.started_at) == ("w2", 2, _at(9))


async def test_thousand_events_in_one_batch(sessions: Sessions) -> None:
    """1,000 request events apply in one batch, quickly, and so do their 1,000 completions."""
    model_id = _id("model")
    lifecycles = [_lifecycle(f"{model_id}-r{i}", model_id, seq=i) for i in range(1_000)]
    started = time.perf_counter()
    await apply_records(sessions, [events[0] for events in lifecycles])
    await apply_records(sessions, [events[2] for events in lifecycles])
    elapsed = time.perf_counter() - started
    rows = await requests_for_model(sessions, model_id)
    assert [row.seq for row in rows] == list(range(1_000))
    assert {row.status for row in rows} == {JobStatus.DONE}
    assert elapsed < 5.0, f"2 batches of 1,000 events took {elapsed:.2f}s"
    counts = await count_requests_by_status(sessions)
    assert set(counts) == {s.value for s in JobStatus} and counts["done"] >= 1_000


async def test_model_upsert_and_last_request_at(sessions: Sessions) -> None:
    """A run is upserted (session id filled in later) and tracks its latest request."""
    model_id, session_id = _id("model"), _id("session")
    events = _lifecycle(_id("req"), model_id)
    # The request arrives before its model: the model row catches up when it lands.
    await apply_records(sessions, [events[0]])
    model = ModelRecord(
        id=model_id,
        tenant_id="default",
        session_id=None,
        base_model="tiny-llama",
        lora_config={"rank": 8},
        created_at=T0 - 5,
    )
    await apply_records(sessions, [model])
    run = await get_training_run(sessions, model_id)
    assert run is not None
    assert (run.session_id, run.lora_config, run.last_request_at) == (None, {"rank": 8}, _at(0))
    later = events[0].model_copy(update={"id": _id("req"), "seq": 1, "queued_at": T0 + 60})
    await apply_records(sessions, [model.model_copy(update={"session_id": session_id}), later])
    await apply_records(sessions, [events[0], model])  # stale repeats move nothing back
    run = await get_training_run(sessions, model_id)
    assert run is not None
    assert (run.session_id, run.last_request_at, run.created_at) == (session_id, _at(60), _at(-5))


async def test_a_tenant_first_seen_in_the_record_gets_its_row(sessions: Sessions) -> None:
    """A client acting for a tenant that has no API key (QT_TENANT) still gets its session and
    runs recorded: the tenant's row is made with them, not refused by the foreign key."""
    tenant, model_id, session_id = _id("tenant"), _id("model"), _id("session")
    await apply_records(
        sessions,
        [
            SessionRecord(id=session_id, tenant_id=tenant, created_at=T0),
            ModelRecord(
                id=model_id,
                tenant_id=tenant,
                session_id=session_id,
                base_model="tiny-llama",
                lora_config={"rank": 8},
                created_at=T0,
            ),
        ],
    )
    run = await get_training_run(sessions, model_id)
    assert run is not None and run.tenant_id == tenant
    async with sessions() as session:
        assert (await session.get(TenantRow, tenant)) is not None
        assert (await session.get(SessionRow, session_id)) is not None


async def test_worker_upsert(sessions: Sessions) -> None:
    """Worker heartbeats only move forward and a recorded stop is kept."""
    worker_id = _id("worker")
    beat = WorkerRecord(
        id=worker_id,
        base_model="tiny-llama",
        device="cpu",
        host="h1",
        pid=42,
        started_at=T0,
        last_heartbeat_at=T0 + 10,
    )
    stopped = beat.model_copy(update={"last_heartbeat_at": T0 + 30, "stopped_at": T0 + 31})
    await apply_records(sessions, [stopped, beat])
    await apply_records(sessions, [beat.model_copy(update={"last_heartbeat_at": T0 + 20})])
    async with sessions() as session:
        row = await session.get(WorkerRow, worker_id)
    assert row is not None
    assert (row.last_heartbeat_at, row.stopped_at, row.pid) == (_at(30), _at(31), 42)


async def test_session_upsert(sessions: Sessions) -> None:
    """Session heartbeats take the latest and creation the earliest of all events."""
    session_id = _id("session")
    first = SessionRecord(id=session_id, tenant_id="default", created_at=T0)
    beats = [first.model_copy(update={"last_heartbeat_at": T0 + s}) for s in (5, 15, 10)]
    await apply_records(sessions, [beats[1], first])
    await apply_records(sessions, [beats[2], beats[0]])
    async with sessions() as session:
        row = await session.get(SessionRow, session_id)
    assert row is not None
    assert (row.created_at, row.last_heartbeat_at) == (_at(0), _at(15))


async def test_empty_batch_and_unknown_ids(sessions: Sessions) -> None:
    """An empty batch is a no-op and the read helpers return None for unknown ids."""
    await apply_records(sessions, [])
    assert await get_request(sessions, "no-such-request") is None
    assert await get_training_run(sessions, "no-such-model") is None
    async with sessions() as session:
        assert await session.get(RequestRow, "no-such-request") is None


async def test_missing_metrics_are_sql_null(sessions: Sessions) -> None:
    """A request without metrics stores SQL NULL (not JSON 'null'), so COALESCE can fill it."""
    request_id = _id("req")
    queued, _, done = _lifecycle(request_id, _id("model"))
    await apply_records(sessions, [queued])
    async with sessions() as session:
        is_null = await session.scalar(
            select(RequestRow.metrics.is_(None)).where(RequestRow.id == request_id)
        )
    assert is_null is True
    await apply_records(sessions, [done.model_copy(update={"metrics": None})])
    await apply_records(sessions, [done, queued])
    row = await get_request(sessions, request_id)
    assert row is not None and row.metrics == {"loss": 0.5}
