"""The Tinker protocol's REST calls (docs/tinker-http-protocol.md, section 7): training runs,
their checkpoints (list, delete, TTL), weights info, sessions and samplers.

Everything is scoped to the caller's tenant: another tenant's id gets the same 404 as a
missing one, so nothing tells whether it exists. Reads come from the Postgres record, except
a sampler, which the SDK asks for right after creating it, before its row is written behind;
every route first waits for the recorders to write the records still in the records stream
(GatewayQueue.recorded), so a result the client holds is never a 404 here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.errors import CheckpointPathError, StorageUnavailableError
from queue_tinker.gateway.auth import tenant_of
from queue_tinker.gateway.off_loop import OffLoopRoute
from queue_tinker.gateway.queue_access import not_found
from queue_tinker.queue.control.expiry_jobs import schedule_expiry
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.store import checkpoints, queries, rest_views
from queue_tinker.store.models import CheckpointRow
from queue_tinker.types.enums import CheckpointKind
from queue_tinker.types.requests.training import MAX_TTL_SECONDS
from queue_tinker.types.service.checkpoints import SCHEME

MAX_PAGE = 1_000
MAX_OFFSET = 2**31 - 1  # far past any listing; a bigger one would not fit Postgres's bigint
_SEGMENTS = {kind.path_segment: kind for kind in CheckpointKind}


# --- request checks --------------------------------------------------------------------------


def checkpoint_tinker_path(run_id: str, checkpoint_id: str) -> str:
    """tinker://<run>/<checkpoint_id> for a checkpoint_id of the form weights/<name> or
    sampler_weights/<name>; 400 naming the field otherwise."""
    segment, _, name = checkpoint_id.partition("/")
    if segment not in _SEGMENTS or not name or "/" in name:
        raise HTTPException(
            400,
            f"checkpoint_id: {checkpoint_id!r} is not a checkpoint id; "
            "expected weights/<name> or sampler_weights/<name>",
        )
    return f"{SCHEME}{run_id}/{checkpoint_id}"


def run_of_tinker_path(path: object) -> str:
    """The run id of a tinker://<run>/weights|sampler_weights/<name> path; 400 otherwise.
    Run ids may hold ':' (the SDK's <session>:train:<n>), never '/'."""
    parts = path.removeprefix(SCHEME).split("/") if isinstance(path, str) else []
    if (
        not isinstance(path, str)
        or not path.startswith(SCHEME)
        or len(parts) != 3
        or not path.isprintable()
        or parts[1] not in _SEGMENTS
        or not parts[0]
        or not parts[2]
    ):
        raise HTTPException(
            400,
            f"tinker_path: {path!r} is not a checkpoint path; expected "
            f"{SCHEME}<run id>/weights/<name> or "
            f"{SCHEME}<run id>/sampler_weights/<name>",
        )
    return parts[0]


def ttl_seconds(body: dict[str, Any]) -> int | None:
    """A positive whole number of seconds, or null (also when absent) to remove the TTL."""
    ttl = body.get("ttl_seconds")
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 < ttl <= MAX_TTL_SECONDS:
        raise HTTPException(
            422,
            f"ttl_seconds: must be a whole number of seconds from 1 to "
            f"{MAX_TTL_SECONDS}, or null to remove the TTL; got {ttl!r}",
        )
    return ttl


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser
        body = None
    if not isinstance(body, dict):
        raise HTTPException(422, "body: expected a JSON object")
    return body


def _store(request: Request) -> CheckpointStore:
    store: CheckpointStore = request.app.state.gateway_queue.store
    return store


@contextlib.contextmanager
def _storage_errors() -> Iterator[None]:
    """Checkpoint storage trouble as an error that says what is wrong with the deployment."""
    try:
        yield
    except StorageUnavailableError as err:
        raise HTTPException(503, f"checkpoint storage: {err}") from err
    except CheckpointPathError as err:
        raise HTTPException(500, f"checkpoint storage: {err}") from err


# --- the routes ------------------------------------------------------------------------------


async def recorded(request: Request, tenant: str = Depends(tenant_of)) -> None:
    """A dependency for every REST call: the record events still on their way to Postgres are
    written first (GatewayQueue.recorded: the recorders write them at once), so a checkpoint
    whose save the client has seen finish is never a 404 here (read-your-writes). After
    authentication: a caller without a key makes the recorders do nothing."""
    await request.app.state.gateway_queue.recorded()


def rest_router(settings: Settings, keys: Keys) -> APIRouter:
    router = APIRouter(prefix="/api/v1", route_class=OffLoopRoute, dependencies=[Depends(recorded)])
    _add_run_routes(router)
    _add_checkpoint_routes(router, settings)
    _add_session_routes(router, settings, keys)
    return router


def _db(request: Request) -> async_sessionmaker[AsyncSession]:
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    return sessions


async def _owned_checkpoint(
    request: Request, tenant: str, run_id: str, checkpoint_id: str
) -> CheckpointRow:
    path = checkpoint_tinker_path(run_id, checkpoint_id)
    row = await queries.get_live_checkpoint(_db(request), tenant, path)
    if row is None:
        raise not_found(f"checkpoint {checkpoint_id!r} of training run {run_id!r}")
    return row


def _add_run_routes(router: APIRouter) -> None:
    @router.get("/training_runs")
    async def list_training_runs(
        request: Request,
        tenant: str = Depends(tenant_of),
        limit: int = Query(20, ge=1, le=MAX_PAGE),
        offset: int = Query(0, ge=0, le=MAX_OFFSET),
    ) -> dict[str, Any]:
        """The tenant's runs, newest first (access_scope and project_id are not used: every
        run a tenant can see is its own)."""
        return await rest_views.training_runs(_db(request), tenant, limit, offset)

    @router.get("/training_runs/{run_id}")
    async def get_training_run(
        run_id: str, request: Request, tenant: str = Depends(tenant_of)
    ) -> dict[str, Any]:
        run = await rest_views.training_run(_db(request), tenant, run_id)
        if run is None:
            raise not_found(f"training run {run_id!r}")
        return run

    @router.get("/training_runs/{run_id}/checkpoints")
    async def list_run_checkpoints(
        run_id: str, request: Request, tenant: str = Depends(tenant_of)
    ) -> dict[str, Any]:
        listed = await rest_views.run_checkpoints(_db(request), tenant, run_id)
        if listed is None:
            raise not_found(f"training run {run_id!r}")
        return listed

    @router.get("/checkpoints")
    async def list_user_checkpoints(
        request: Request,
        tenant: str = Depends(tenant_of),
        limit: int = Query(100, ge=1, le=MAX_PAGE),
        offset: int = Query(0, ge=0, le=MAX_OFFSET),
    ) -> dict[str, Any]:
        return await rest_views.user_checkpoints(_db(request), tenant, limit, offset)

    @router.post("/weights_info")
    async def weights_info(request: Request, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        path = (await _json_object(request)).get("tinker_path")
        run_id = run_of_tinker_path(path)
        info = await rest_views.weights_info(_db(request), tenant, str(path), run_id)
        if info is None:
            raise not_found(f"checkpoint {path!r}")
        return info


def _add_checkpoint_routes(router: APIRouter, settings: Settings) -> None:

    # The ttl route first: both take a path-type checkpoint id (it holds a '/').
    @router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_checkpoint_ttl(
        run_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tenant_of)
    ) -> dict[str, Any]:
        """Set (from now) or remove a checkpoint's TTL. The meta file first: it is what expiry
        obeys; then the row (listings); then the expiry job. A removed TTL leaves any job in
        place: it finds no expiry in the meta and does nothing."""
        ttl = ttl_seconds(await _json_object(request))
        row = await _owned_checkpoint(request, tenant, run_id, checkpoint_id)
        expires_at = time.time() + ttl if ttl is not None else None
        with _storage_errors():
            changed = await checkpoints.set_checkpoint_ttl(
                _db(request), _store(request), tenant, row.id, row.path, expires_at
            )
        if not changed:
            raise not_found(f"checkpoint {checkpoint_id!r} of training run {run_id!r}")
        if expires_at is not None:
            await schedule_expiry(
                settings.redis_url or "", settings.key_prefix, row.id, row.path, expires_at
            )
        return {}

    @router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(
        run_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tenant_of)
    ) -> dict[str, Any]:
        """Remove the files and mark the row deleted, through the housekeeper's own path."""
        row = await _owned_checkpoint(request, tenant, run_id, checkpoint_id)
        with _storage_errors():
            await checkpoints.delete_checkpoint(
                request.app.state.db, row.id, row.path, _store(request)
            )
        return {}


def _add_session_routes(router: APIRouter, settings: Settings, keys: Keys) -> None:
    @router.get("/sessions")
    async def list_sessions(
        request: Request,
        tenant: str = Depends(tenant_of),
        limit: int = Query(20, ge=1, le=MAX_PAGE),
        offset: int = Query(0, ge=0, le=MAX_OFFSET),
    ) -> dict[str, Any]:
        ids = await queries.list_session_ids(_db(request), tenant, limit=limit, offset=offset)
        return {"sessions": ids}

    @router.get("/sessions/{session_id}")
    async def get_session(
        session_id: str, request: Request, tenant: str = Depends(tenant_of)
    ) -> dict[str, Any]:
        members = await queries.session_members(_db(request), tenant, session_id)
        if members is None:
            raise not_found(f"session {session_id!r}")
        runs, samplers = members
        return {"training_run_ids": runs, "sampler_ids": samplers}

    @router.get("/samplers/{sampler_id}")
    async def get_sampler(
        sampler_id: str, request: Request, tenant: str = Depends(tenant_of)
    ) -> dict[str, Any]:
        """Redis first: the SDK asks right after creating the session, before its row exists."""
        jobs = request.app.state.gateway_queue.jobs
        info = await jobs.tenant_model(sampler_id, tenant, kind="sampling")
        if info is not None:
            return {
                "sampler_id": sampler_id,
                "base_model": info["base_model"],
                "model_path": info["model_path"],
            }
        row = await queries.get_sampling_session(_db(request), tenant, sampler_id)
        if row is None:
            raise not_found(f"sampler {sampler_id!r}")
        return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}
