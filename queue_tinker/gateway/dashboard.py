"""The dashboard: one static page (GET /dashboard) and the JSON it polls, behind the API key.

The page itself needs no key (it asks for one and sends it as X-API-Key on every call); every
JSON route does. What a key sees:

- an admin key (`queue-tinker keys create --admin`): every tenant, and it may drain workers;
- any other key: its own tenant's queues, rate limits, runs, requests and checkpoints, and the
  whole worker list (capacity is shared, so how busy the fleet is is everyone's business), but
  on each worker only its own resident models and current op: another tenant's model ids are
  left out (`resident_hidden` counts them) and another tenant's current op shows its kind
  only (`current_op` is "<kind>:", `current_op_hidden` true); and, like the worker list, the
  fleet's history (per base model its queue depth, oldest wait and live workers, and the
  fleet's tokens per second: sums over every tenant, naming none of them or their models).

Retry and cancel take a request of the caller's tenant (an admin's: any); another tenant's
request is 404 exactly like a missing one. Drain is admin-only (403).
"""

from __future__ import annotations

from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, Response
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.errors import UserInputError
from queue_tinker.gateway.auth import Caller, caller_of
from queue_tinker.gateway.off_loop import OffLoopRoute
from queue_tinker.gateway.queue_access import not_found
from queue_tinker.queue import redis_bytes
from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.control import actions
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.history import read_history
from queue_tinker.queue.observe.overview import hide_other_tenants, queue_overview
from queue_tinker.queue.observe.records import RecordLog
from queue_tinker.settings import Settings
from queue_tinker.store import dashboard_queries as dq
from queue_tinker.types.enums import JobStatus, OpKind
from queue_tinker.types.finite_json import finite_json

API = "/api/v1/dashboard"
MAX_ROWS = 500
# The page's own files; nothing else under static/ is served.
_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page loads nothing from elsewhere and runs no inline script: a key typed into it can
# only go to this gateway.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
_NO_STORE = {"Cache-Control": "no-store"}

CallerDep = Annotated[Caller, Depends(caller_of)]


def _static(name: str) -> str:
    return (resources.files("queue_tinker.gateway") / "static" / name).read_text("utf-8")


def _db(request: Request) -> async_sessionmaker[AsyncSession]:
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    return sessions


def _redis(request: Request) -> RedisClient:
    redis: RedisClient = request.app.state.redis
    return redis


def _hidden(caller: Caller, tenant: str | None) -> bool:
    return tenant is None or (caller.scope is not None and tenant != caller.scope)


async def _actionable_job(request: Request, keys: Keys, caller: Caller, job_id: str) -> None:
    """404 unless the job exists and is the caller's to act on (another tenant's: 404 too);
    400 for a job only the record still knows (Redis keeps jobs for QT_RESULT_TTL_S)."""
    tenant = await redis_bytes.hget(_redis(request), keys.job(job_id), "tenant_id")
    if tenant is not None:
        if _hidden(caller, tenant.decode()):
            raise not_found(f"request {job_id!r}")
        return
    if _hidden(caller, await dq.request_tenant(_db(request), job_id)):
        raise not_found(f"request {job_id!r}")
    raise UserInputError(
        f"request_id: {job_id} is older than QT_RESULT_TTL_S and no longer "
        "kept in the queue, so it cannot be retried or cancelled"
    )


def _page_routes(router: APIRouter) -> None:
    @router.get("/dashboard", include_in_schema=False)
    async def page() -> HTMLResponse:
        """The page; it asks for the key, so it loads without one."""
        return HTMLResponse(
            _static("index.html"), headers={**_NO_STORE, "Content-Security-Policy": _CSP}
        )

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in _ASSETS:
            raise HTTPException(404, f"name {name!r}: not found")
        return Response(_static(name), media_type=_ASSETS[name], headers=_NO_STORE)


def _read_routes(router: APIRouter, settings: Settings, keys: Keys) -> None:
    @router.get(f"{API}/overview")
    async def overview(request: Request, caller: CallerDep) -> dict[str, Any]:
        """Queues (depth, oldest wait, state), workers, and rate-limit state per tenant."""
        body = await queue_overview(_redis(request), keys, settings, tenant=caller.scope)
        if caller.scope is not None:
            await hide_other_tenants(_redis(request), keys, body["workers"], caller.scope)
        else:  # the same shape for an admin, who sees everything
            for worker in body["workers"]:
                worker.update(resident_hidden=0, current_op_hidden=False)
        # Records Postgres refused (nothing accepted should be there): shown when any are.
        dead = await RecordLog(_redis(request), keys).dead(caller.scope)
        return {
            **body,
            "dead_letters": dead,
            "caller": {"tenant_id": caller.tenant_id, "admin": caller.admin},
        }

    @router.get(f"{API}/requests")
    async def requests(
        request: Request,
        caller: CallerDep,
        limit: int = Query(50, ge=1, le=MAX_ROWS),
        status: JobStatus | None = None,
        kind: OpKind | None = None,
        model: str | None = Query(None, max_length=256),
    ) -> dict[str, Any]:
        """The newest requests with their latency and error (no traceback: see /requests/id)."""
        rows = await dq.recent_requests(
            _db(request), caller.scope, limit=limit, status=status, model_id=model, kind=kind
        )
        return {"requests": rows}

    @router.get(f"{API}/requests/{{request_id}}")
    async def request_detail(
        request_id: str, request: Request, caller: CallerDep
    ) -> dict[str, Any]:
        """One request with its traceback (`error_detail`) and metrics."""
        row = await dq.request_detail(_db(request), caller.scope, request_id)
        if row is None:
            raise not_found(f"request {request_id!r}")
        return row

    @router.get(f"{API}/runs")
    async def runs(
        request: Request, caller: CallerDep, limit: int = Query(50, ge=1, le=MAX_ROWS)
    ) -> dict[str, Any]:
        """Training runs, most recently active first, with step count and last loss (a
        diverged one as "NaN" / "Infinity": FastAPI's own encoding would make it null)."""
        return finite_json(
            {"runs": await dq.run_summaries(_db(request), caller.scope, limit=limit)}
        )

    @router.get(f"{API}/runs/{{run_id}}/loss")
    async def loss(run_id: str, request: Request, caller: CallerDep) -> dict[str, Any]:
        """The run's loss curve: `loss:sum` of each finished forward_backward, in seq order."""
        if not await dq.run_visible(_db(request), caller.scope, run_id):
            raise not_found(f"training run {run_id!r}")
        return finite_json(
            {
                "run_id": run_id,
                "metric": dq.LOSS_METRIC,
                "points": await dq.loss_curve(_db(request), run_id),
            }
        )

    @router.get(f"{API}/checkpoints")
    async def checkpoints(
        request: Request,
        caller: CallerDep,
        limit: int = Query(100, ge=1, le=MAX_ROWS),
        run: str | None = Query(None, max_length=256),
    ) -> dict[str, Any]:
        """Live checkpoints, newest first (of one run with ?run=)."""
        if run and not await dq.run_visible(_db(request), caller.scope, run):
            raise not_found(f"training run {run!r}")
        return {
            "checkpoints": await dq.checkpoints(_db(request), caller.scope, limit=limit, run_id=run)
        }


def _fleet_routes(router: APIRouter, settings: Settings, keys: Keys) -> None:
    @router.get(f"{API}/history")
    async def history(request: Request, caller: CallerDep) -> dict[str, Any]:
        """The fleet's last hours, sampled every QT_HISTORY_INTERVAL_S by the gateways: per
        base model queue depth, oldest wait and live workers, and the fleet's tokens/s."""
        return await read_history(_redis(request), keys, settings)


def _action_routes(router: APIRouter, settings: Settings, keys: Keys) -> None:
    @router.post(f"{API}/requests/{{request_id}}/retry")
    async def retry(request_id: str, request: Request, caller: CallerDep) -> dict[str, Any]:
        """Queue a failed request's op again at the end of its model's queue."""
        await _actionable_job(request, keys, caller, request_id)
        new_id = await actions.retry_job(
            _redis(request), keys, request_id, caller.scope, result_ttl_s=settings.result_ttl_s
        )
        return {"request_id": request_id, "retry_request_id": new_id}

    @router.post(f"{API}/requests/{{request_id}}/cancel")
    async def cancel(request_id: str, request: Request, caller: CallerDep) -> dict[str, Any]:
        """Cancel a request that has not started, or a sample while it runs (its worker stops
        it at the next decode step): it fails with "cancelled"."""
        await _actionable_job(request, keys, caller, request_id)
        was = await actions.cancel_job(_redis(request), keys, request_id, caller.scope)
        return {"request_id": request_id, "cancelled": True, "was": was}

    @router.post(f"{API}/workers/{{worker_id}}/drain")
    async def drain(worker_id: str, request: Request, caller: CallerDep) -> dict[str, Any]:
        """The worker finishes its current op, hands its models to others and exits."""
        if not caller.admin:
            raise HTTPException(
                403,
                "X-API-Key: draining a worker needs an admin key "
                "(queue-tinker keys create --admin --tenant NAME)",
            )
        await actions.drain_worker(_redis(request), keys, worker_id)
        return {"worker_id": worker_id, "draining": True}


def dashboard_router(settings: Settings, keys: Keys) -> APIRouter:
    router = APIRouter(route_class=OffLoopRoute)
    _page_routes(router)
    _read_routes(router, settings, keys)
    _fleet_routes(router, settings, keys)
    _action_routes(router, settings, keys)
    return router
