"""Apply record events (queue_tinker/types/service/records.py) to Postgres, in batches.

Events come from a write-behind stream: out of order and possibly more than once. Every write
is an upsert that can only move a row forward, so applying any permutation of any multiset of
events gives the same rows:

- a request's status never drops to a lower `JobStatus.rank` (a 'done' row stays done);
  its result fields (worker, timings, metrics, error) come from the more advanced event,
  where (rank, attempts) orders events, and a null never erases a known value;
- heartbeats take the latest (GREATEST), creation times the earliest (LEAST).

Events for the same id within a batch are folded in Python first, because one
INSERT .. ON CONFLICT DO UPDATE may not touch the same row twice; that also leaves one
statement per table per batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Table, bindparam, case, func, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_sessionmaker
from sqlalchemy.sql.elements import ColumnElement

from queue_tinker.store.models import (
    CheckpointRow,
    RequestRow,
    SamplingSessionRow,
    SessionRow,
    TenantRow,
    TrainingRunRow,
    WorkerRow,
)
from queue_tinker.types.enums import JobStatus
from queue_tinker.types.finite_json import finite_json
from queue_tinker.types.service.records import (
    CheckpointRecord,
    ModelRecord,
    Record,
    RequestRecord,
    SamplingSessionRecord,
    SessionRecord,
    WorkerRecord,
)

Row = dict[str, Any]
Reducer = Callable[[Any, Any], Any]

_TENANTS: Table = TenantRow.__table__  # type: ignore[assignment]
_REQUESTS: Table = RequestRow.__table__  # type: ignore[assignment]
_RUNS: Table = TrainingRunRow.__table__  # type: ignore[assignment]
_SESSIONS: Table = SessionRow.__table__  # type: ignore[assignment]
_SAMPLING: Table = SamplingSessionRow.__table__  # type: ignore[assignment]
_WORKERS: Table = WorkerRow.__table__  # type: ignore[assignment]
_CHECKPOINTS: Table = CheckpointRow.__table__  # type: ignore[assignment]

# How two known values of one field combine; fields not named here take the newer value.
_SESSION_REDUCERS: Mapping[str, Reducer] = {"created_at": min, "last_heartbeat_at": max}
_MODEL_REDUCERS: Mapping[str, Reducer] = {"created_at": min}
_WORKER_REDUCERS: Mapping[str, Reducer] = {"started_at": min, "last_heartbeat_at": max}
_REQUEST_REDUCERS: Mapping[str, Reducer] = {"queued_at": min, "attempts": max}
_CHECKPOINT_REDUCERS: Mapping[str, Reducer] = {"created_at": min}


def _to_row(record: Record) -> Row:
    """The record as column values: enums as text, unix seconds as aware UTC datetimes."""
    # JSONB refuses NaN and infinity (a diverging step's metrics): their strings instead.
    row: Row = finite_json(record.model_dump(mode="json", exclude={"type"}))
    for key, value in row.items():
        if key.endswith("_at") and value is not None:
            row[key] = datetime.fromtimestamp(value, tz=UTC)
    return row


def _request_order(row: Row) -> tuple[int, int]:
    """How far along a request event is; the SQL upsert orders rows the same way."""
    return JobStatus(row["status"]).rank, row["attempts"]


def _fold(rows: Iterable[Row], reducers: Mapping[str, Reducer]) -> Row:
    """Merge events of one id, oldest first: a later non-null value wins unless reduced."""
    it = iter(rows)
    merged = dict(next(it))
    for row in it:
        for key, new in row.items():
            old = merged.get(key)
            if new is None:
                continue
            merged[key] = new if old is None else reducers.get(key, _take_new)(old, new)
    return merged


def _take_new(_old: Any, new: Any) -> Any:
    return new


def _coalesce(
    rows: Iterable[Row],
    reducers: Mapping[str, Reducer],
    order: Callable[[Row], Any] | None = None,
) -> list[Row]:
    by_id: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_id[row["id"]].append(row)
    return [
        # sorted() is stable: events of equal order keep their arrival order.
        _fold(sorted(group, key=order) if order else group, reducers)
        for group in by_id.values()
    ]


def _rank_sql(status: ColumnElement[Any]) -> ColumnElement[int]:
    return case({s.value: s.rank for s in JobStatus}, value=status)


def _upsert_requests() -> Any:
    stmt = insert(_REQUESTS)
    new, old = stmt.excluded, _REQUESTS.c
    advances = tuple_(_rank_sql(new.status), new.attempts) >= tuple_(
        _rank_sql(old.status), old.attempts
    )

    def from_advanced(name: str) -> ColumnElement[Any]:
        # The more advanced event's value, falling back to the other's when it has none.
        return case(
            (advances, func.coalesce(new[name], old[name])),
            else_=func.coalesce(old[name], new[name]),
        )

    result_fields = (
        "started_at",
        "finished_at",
        "worker_id",
        "metrics",
        "error",
        "error_category",
        "error_detail",
    )
    return stmt.on_conflict_do_update(
        index_elements=[old.id],
        set_={
            "status": case((advances, new.status), else_=old.status),
            "queued_at": func.least(old.queued_at, new.queued_at),
            "attempts": func.greatest(old.attempts, new.attempts),
            "idempotency_key": func.coalesce(old.idempotency_key, new.idempotency_key),
            **{name: from_advanced(name) for name in result_fields},
        },
    )


def _upsert_runs() -> Any:
    stmt = insert(_RUNS)
    new, old = stmt.excluded, _RUNS.c
    return stmt.on_conflict_do_update(
        index_elements=[old.id],
        set_={
            "tenant_id": new.tenant_id,
            "session_id": func.coalesce(new.session_id, old.session_id),
            "base_model": new.base_model,
            "lora_config": new.lora_config,
            "user_metadata": func.coalesce(new.user_metadata, old.user_metadata),
            "created_at": func.least(old.created_at, new.created_at),
        },
    )


def _upsert_sampling_sessions() -> Any:
    stmt = insert(_SAMPLING)
    new, old = stmt.excluded, _SAMPLING.c
    # Everything but the creation time is fixed when the session is made.
    return stmt.on_conflict_do_update(
        index_elements=[old.id],
        set_={"created_at": func.least(old.created_at, new.created_at)},
    )


def _upsert_sessions() -> Any:
    stmt = insert(_SESSIONS)
    new, old = stmt.excluded, _SESSIONS.c
    return stmt.on_conflict_do_update(
        index_elements=[old.id],
        set_={
            "tenant_id": new.tenant_id,
            "created_at": func.least(old.created_at, new.created_at),
            # GREATEST ignores NULLs in Postgres, so a heartbeat-less event changes nothing.
            "last_heartbeat_at": func.greatest(old.last_heartbeat_at, new.last_heartbeat_at),
        },
    )


def _upsert_workers() -> Any:
    stmt = insert(_WORKERS)
    new, old = stmt.excluded, _WORKERS.c
    return stmt.on_conflict_do_update(
        index_elements=[old.id],
        set_={
            "base_model": new.base_model,
            "device": new.device,
            "host": new.host,
            "pid": new.pid,
            "started_at": func.least(old.started_at, new.started_at),
            "last_heartbeat_at": func.greatest(old.last_heartbeat_at, new.last_heartbeat_at),
            "stopped_at": func.coalesce(new.stopped_at, old.stopped_at),
        },
    )


def _upsert_checkpoints() -> Any:
    stmt = insert(_CHECKPOINTS)
    new, old = stmt.excluded, _CHECKPOINTS.c
    return stmt.on_conflict_do_update(
        index_elements=[old.id],
        set_={
            "size_bytes": new.size_bytes,
            "created_at": func.least(old.created_at, new.created_at),
            "expires_at": func.coalesce(new.expires_at, old.expires_at),
            # Once the files are gone the row says so for good.
            "deleted_at": func.coalesce(old.deleted_at, new.deleted_at),
        },
    )


# Built once; SQLAlchemy caches their compiled form.
_REQUEST_UPSERT = _upsert_requests()
_RUN_UPSERT = _upsert_runs()
_SESSION_UPSERT = _upsert_sessions()
_SAMPLING_UPSERT = _upsert_sampling_sessions()
_WORKER_UPSERT = _upsert_workers()
_CHECKPOINT_UPSERT = _upsert_checkpoints()


async def _touch_runs(conn: AsyncConnection, requests: list[Row], new_models: list[str]) -> None:
    """Move training_runs.last_request_at to the latest queued_at of the batch's requests."""
    latest: dict[str, datetime] = {}
    for row in requests:
        model_id, queued_at = row["model_id"], row["queued_at"]
        if model_id not in latest or latest[model_id] < queued_at:
            latest[model_id] = queued_at
    if latest:
        # A run not recorded yet matches no row here; the backfill below catches it up.
        await conn.execute(
            update(_RUNS)
            .where(_RUNS.c.id == bindparam("b_id"))
            .values(last_request_at=func.greatest(_RUNS.c.last_request_at, bindparam("b_ts"))),
            [{"b_id": k, "b_ts": v} for k, v in latest.items()],
        )
    if new_models:
        # Models recorded after some of their requests: take what is already there. Runs once
        # per model (its ModelRecord), so the scan of its requests stays off the hot path.
        newest = (
            select(func.max(_REQUESTS.c.queued_at))
            .where(_REQUESTS.c.model_id == _RUNS.c.id)
            .scalar_subquery()
        )
        await conn.execute(
            update(_RUNS)
            .where(_RUNS.c.id.in_(new_models))
            .values(last_request_at=func.greatest(_RUNS.c.last_request_at, newest))
        )


async def apply_records(
    sessions: async_sessionmaker[AsyncSession], records: Sequence[Record]
) -> None:
    """Apply a batch of record events in one transaction (one upsert per table)."""
    rows: dict[type, list[Row]] = defaultdict(list)
    for record in records:
        rows[type(record)].append(_to_row(record))
    if not rows:
        return
    session_rows = _coalesce(rows[SessionRecord], _SESSION_REDUCERS)
    model_rows = _coalesce(rows[ModelRecord], _MODEL_REDUCERS)
    sampling_rows = _coalesce(rows[SamplingSessionRecord], _MODEL_REDUCERS)
    worker_rows = _coalesce(rows[WorkerRecord], _WORKER_REDUCERS)
    request_rows = _coalesce(rows[RequestRecord], _REQUEST_REDUCERS, order=_request_order)
    checkpoint_rows = _coalesce(rows[CheckpointRecord], _CHECKPOINT_REDUCERS)
    # A tenant first seen here (a Python client acting for a QT_TENANT that has no API key
    # yet) gets its row, so its sessions and runs do not fail the foreign key.
    tenants = sorted({row["tenant_id"] for row in (*session_rows, *model_rows, *sampling_rows)})
    async with sessions() as session, session.begin():
        conn = await session.connection()
        if tenants:
            await conn.execute(
                insert(_TENANTS).on_conflict_do_nothing(), [{"id": t, "name": t} for t in tenants]
            )
        # Sessions and runs before requests: _touch_runs must see the runs of this batch.
        for stmt, batch in (
            (_SESSION_UPSERT, session_rows),
            (_RUN_UPSERT, model_rows),
            (_SAMPLING_UPSERT, sampling_rows),
            (_WORKER_UPSERT, worker_rows),
            (_REQUEST_UPSERT, request_rows),
            (_CHECKPOINT_UPSERT, checkpoint_rows),
        ):
            if batch:
                await conn.execute(stmt, batch)
        await _touch_runs(conn, request_rows, [row["id"] for row in model_rows])
