"""The Tinker protocol's account routes, with their self-hosted meaning
(docs/tinker-http-protocol.md, section 12): the calling key (`tinker auth login` / `logout`),
this deployment's checkpoint storage and checkpoint audit log, session search, and a
session's trace as a Perfetto (Chrome trace-event) file. A tenant sees only its own."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.errors import UserInputError
from queue_tinker.gateway.auth import TenantDep
from queue_tinker.gateway.queue_access import not_found
from queue_tinker.store import api_keys, protocol_queries
from queue_tinker.store.models import RequestRow

router = APIRouter(prefix="/api/v1")
BYTES_PER_GB = 1e9
PROJECT = ""  # this service has no projects; the SDK's session summary needs a string


def _db(request: Request) -> async_sessionmaker[AsyncSession]:
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    return sessions


# --- the calling key -------------------------------------------------------------------------
@router.get("/auth/apikey/me")
async def my_key(request: Request, tenant: TenantDep) -> dict[str, Any]:
    """The key presented (as `tinker auth login` checks it): its number, name, tenant."""
    info = await api_keys.key_info(_db(request), request.headers.get("X-API-Key", ""))
    if info is None:  # revoked since the key cache last checked it
        raise HTTPException(401, "invalid or revoked API key")
    return {
        "key_id": int(info.id.removeprefix("key-"), 16),
        "name": info.name or info.prefix,
        "note": f"tenant {tenant}" + (" (admin)" if info.admin else ""),
        "details": {"org_details": {"name": tenant}, "user_details": {"email": ""}},
    }


@router.delete("/auth/apikey/me")
async def revoke_my_key(request: Request, _: TenantDep) -> dict[str, Any]:
    """Revoke the key presented, and only it (`tinker auth logout`). A gateway that checked
    it recently keeps taking it for QT_API_KEY_CACHE_S."""
    info = await api_keys.key_info(_db(request), request.headers.get("X-API-Key", ""))
    if info is not None:
        await api_keys.revoke_key(_db(request), info.id)
    return {}


# --- usage and audit -------------------------------------------------------------------------
@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage(
    request: Request, tenant: TenantDep, project_id: str | None = None
) -> dict[str, Any]:
    """The tenant's live checkpoints in this deployment's storage (no price: self-hosted)."""
    if project_id:
        raise UserInputError(f"project_id: {project_id!r}: this service has no projects")
    count, size = await protocol_queries.checkpoint_storage_used(_db(request), tenant)
    return {
        "effective_rate_usd_per_gigabyte_month": None,
        "data": [
            {
                "project_id": None,
                "org_user_urn": tenant,
                "checkpoint_count": count,
                "size_bytes": size,
                "size_gigabytes": size / BYTES_PER_GB,
            }
        ],
    }


@router.get("/audit")
async def audit_log(
    request: Request,
    tenant: TenantDep,
    event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all",
    day: date | None = None,
) -> dict[str, Any]:
    """The tenant's checkpoint saves and deletions (of one UTC day, if given). Projects,
    teams and organizations do not exist here, so they have no events."""
    if event_type not in ("all", "checkpoints"):
        return {"entries": []}
    events = await protocol_queries.checkpoint_events(_db(request), tenant, day)
    return {
        "entries": [
            {
                "timestamp": moment.isoformat(),
                "event": event,
                "model_id": row.model_id,
                "tinker_path": row.id,
                "event_details": {
                    "tenant": tenant,
                    "model_id": row.model_id,
                    "tinker_path": row.id,
                    "size_bytes": row.size_bytes,
                },
            }
            for moment, event, row in events
        ]
    }


# --- sessions --------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SearchCursor(_Body):
    last_created_at: datetime
    last_session_id: str


class SessionSearch(_Body):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = None
    owner: dict[str, Any] = Field(default_factory=lambda: {"type": "own"})
    statuses: list[dict[str, Any]] | None = None
    limit: int = Field(50, ge=1, le=200)
    cursor: SearchCursor | None = None


def check_search(body: SessionSearch) -> None:
    """What this service keeps no record of cannot be searched: refused, naming the field."""
    if body.project_ids:
        raise UserInputError(f"project_ids: {body.project_ids!r}: this service has no projects")
    if body.owner.get("type") == "user":
        raise UserInputError(
            "owner: 'user' is not supported; a tenant searches its own "
            "sessions ('own' or 'accessible')"
        )
    for field in ("user_metadata", "display_name", "statuses"):
        if getattr(body, field):
            raise UserInputError(
                f"{field}: sessions are not searchable by {field} here; "
                "search by session_id, or list them all"
            )


@router.post("/sessions/search")
async def search_sessions(
    body: SessionSearch, request: Request, tenant: TenantDep
) -> dict[str, Any]:
    """The tenant's sessions, newest first, a page at a time."""
    check_search(body)
    await request.app.state.gateway_queue.recorded()
    after = (body.cursor.last_created_at, body.cursor.last_session_id) if body.cursor else None
    found = await protocol_queries.find_sessions(
        _db(request), tenant, session_id=body.session_id, after=after, limit=body.limit
    )
    last = found[-1] if len(found) == body.limit else None
    return {
        "sessions": [
            {
                "session_id": s.id,
                "created_at": s.created_at.isoformat(),
                "owner": s.tenant_id,
                "project_id": PROJECT,
                "checkpoints_count": s.checkpoints,
                "checkpoint_storage_bytes": s.checkpoint_bytes,
            }
            for s in found
        ],
        "next_cursor": {"last_created_at": last.created_at.isoformat(), "last_session_id": last.id}
        if last
        else None,
    }


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(session_id: str, request: Request, tenant: TenantDep) -> dict[str, Any]:
    """Ready at once: the trace is built from the record when it is downloaded."""
    await request.app.state.gateway_queue.recorded()
    if await protocol_queries.session_requests(_db(request), tenant, session_id) is None:
        raise not_found(f"session {session_id!r}")
    url = str(request.url_for("session_trace", session_id=session_id))
    return {"status": "ready", "url": url}


@router.get("/sessions/{session_id}/trace", name="session_trace")
async def session_trace(
    session_id: str, request: Request, tenant: TenantDep, limit: int = Query(100_000, ge=1)
) -> dict[str, Any]:
    """The session's requests as Chrome trace events (open in ui.perfetto.dev): one track
    per model, a span per request from start to finish, its wait in the queue before it;
    every request whose result a client holds among them (their events still on their way
    to Postgres are written first)."""
    await request.app.state.gateway_queue.recorded()
    rows = await protocol_queries.session_requests(_db(request), tenant, session_id)
    if rows is None:
        raise not_found(f"session {session_id!r}")
    return {
        "traceEvents": [e for row in rows[:limit] for e in trace_events(row)],
        "displayTimeUnit": "ms",
    }


def trace_events(row: RequestRow) -> list[dict[str, Any]]:
    def us(moment: datetime) -> int:
        return int(moment.timestamp() * 1e6)

    args = {
        "request_id": row.id,
        "seq": row.seq,
        "status": row.status,
        **({"error": row.error} if row.error else {}),
    }
    start = row.started_at or row.finished_at
    events = []
    if start is not None:
        events.append(
            {
                "name": f"queued {row.kind}",
                "cat": "queue",
                "ph": "X",
                "ts": us(row.queued_at),
                "dur": us(start) - us(row.queued_at),
                "pid": row.model_id,
                "tid": "queue",
                "args": args,
            }
        )
    if row.started_at is not None and row.finished_at is not None:
        events.append(
            {
                "name": row.kind,
                "cat": "run",
                "ph": "X",
                "ts": us(row.started_at),
                "dur": us(row.finished_at) - us(row.started_at),
                "pid": row.model_id,
                "tid": "run",
                "args": args,
            }
        )
    return events
