"""The HTTP gateway: the Tinker protocol (the official tinker SDK works against it unchanged),
health, and the dashboard (behind the same API keys)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text
from sqlalchemy.exc import DataError, DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from queue_tinker.errors import (
    ErrorCategory,
    HeldOpsFullError,
    QueueTinkerError,
    RedisUnavailableError,
    StorageUnavailableError,
    UnknownModelError,
)
from queue_tinker.gateway import openai_compat
from queue_tinker.gateway.auth import KeyCache
from queue_tinker.gateway.dashboard import dashboard_router
from queue_tinker.gateway.downloads import download_router
from queue_tinker.gateway.envelope.body_limit import BodyLimit
from queue_tinker.gateway.envelope.request_checks import RequestChecks
from queue_tinker.gateway.metrics import metrics_router
from queue_tinker.gateway.queue_access import GatewayQueue
from queue_tinker.gateway.responses import GatewayJSONResponse
from queue_tinker.gateway.tinker import (
    account,
    copy_weights,
    custom_loss,
    futures,
    publish,
    sample_futures,
    sampling,
    training,
)
from queue_tinker.gateway.tinker.rest import recorded, rest_router
from queue_tinker.gateway.tinker.session import session_router
from queue_tinker.gateway.tinker.unserved import unserved_router
from queue_tinker.queue.connection import connect
from queue_tinker.queue.control import silent_sessions
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe import history
from queue_tinker.queue.outage import REDIS_DOWN
from queue_tinker.services.recorder import RecorderThread
from queue_tinker.settings import Settings
from queue_tinker.store.db import make_engine, session_factory, unreachable

# How long a client told "503: a store is away" should wait before it tries again.
OUTAGE_RETRY_AFTER_S = 2
HELD_FULL_RETRY_AFTER_S = 1

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    if not settings.redis_url or not settings.database_url:
        raise ValueError("the gateway needs QT_REDIS_URL and QT_DATABASE_URL")
    keys = Keys(settings.key_prefix)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.redis = connect(settings.redis_url or "")
        app.state.db = make_engine(settings.database_url or "")
        app.state.sessions = session_factory(app.state.db)
        app.state.gateway_queue = GatewayQueue(app.state.redis, keys, settings)
        app.state.key_cache = KeyCache(settings.api_key_cache_s, settings.api_key_outage_s)
        # The gateway also writes the record behind, so Postgres keeps up with no worker alive.
        recorder = RecorderThread(settings, consumer=f"gateway-{uuid.uuid4().hex[:8]}")
        recorder.start()
        timeout_s = settings.session_heartbeat_timeout_s
        background = []
        if timeout_s > 0:
            background.append(silent_sessions.watch(app.state.redis, keys, timeout_s))
        stop_sampling = asyncio.Event()
        if settings.history_interval_s > 0:
            background.append(
                history.sample_forever(app.state.redis, keys, settings, stop_sampling)
            )
        tasks = [asyncio.create_task(job) for job in background]
        try:
            yield
        finally:
            stop_sampling.set()  # ends the sampler even where the cancel below is swallowed
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await asyncio.to_thread(recorder.stop)
            await app.state.gateway_queue.close()
            await app.state.redis.aclose()
            await app.state.db.dispose()

    # Every JSON answer writes NaN / infinity as strings (a diverging step's metrics).
    app = FastAPI(
        title="queue_tinker", lifespan=lifespan, default_response_class=GatewayJSONResponse
    )
    app.state.settings = settings
    app.add_middleware(BodyLimit, settings=settings)  # QT_MAX_REQUEST_BYTES: 413 before parsing
    app.add_middleware(RequestChecks)  # runs first: 404/422/415 on a request's envelope
    # First: the SDK paths not offered answer 501 (a catch-all {checkpoint_id:path} route
    # below would take .../publish); serving one means taking it out of UNSERVED.
    app.include_router(unserved_router())
    app.include_router(publish.router)  # before DELETE .../{checkpoint_id:path}
    app.include_router(session_router(settings, keys))
    app.include_router(rest_router(settings, keys))
    app.include_router(download_router(keys, recorded))
    app.include_router(dashboard_router(settings, keys))
    app.include_router(metrics_router(settings, keys))
    for module in (
        training,
        sampling,
        futures,
        sample_futures,
        account,
        custom_loss,
        copy_weights,
        openai_compat,
    ):
        app.include_router(module.router)

    add_error_handlers(app)

    @app.get("/healthz")
    async def healthz(request: Request) -> JSONResponse:
        """200 when Redis and Postgres both answer; 503 naming the one that does not."""
        checks: dict[str, str] = {}
        try:
            await request.app.state.redis.ping()
            checks["redis"] = "ok"
        except Exception as exc:
            checks["redis"] = f"error: {exc}"
        try:
            async with request.app.state.db.connect() as conn:
                await conn.execute(text("select 1"))
            checks["postgres"] = "ok"
        except Exception as exc:
            checks["postgres"] = f"error: {exc}"
        healthy = all(v == "ok" for v in checks.values())
        return JSONResponse(checks, status_code=200 if healthy else 503)

    return app


async def storage_away(request: Request, exc: Exception) -> Response:
    """Checkpoint storage unreachable (an object store away): 503 with Retry-After, which the
    SDK retries; nothing was changed."""
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return GatewayJSONResponse(
        {"detail": str(exc)}, status_code=503, headers={"Retry-After": str(OUTAGE_RETRY_AFTER_S)}
    )


def add_error_handlers(app: FastAPI) -> None:
    """Every error a route can raise, answered with its status and a detail naming the field
    (HTTP status codes live here, not in the layers below)."""
    app.add_exception_handler(StorageUnavailableError, storage_away)

    @app.exception_handler(QueueTinkerError)
    async def queue_tinker_error(request: Request, exc: QueueTinkerError) -> JSONResponse:
        """Our own errors, by their category (errors.py). A user error is the caller's to fix:
        400 (404 for an unknown model) with the message that names the field; never a
        body-less 400, which the SDK retries as a proxy glitch. A server error is ours: 500,
        logged with its traceback. Errors with handlers of their own (HeldOpsFullError,
        RedisUnavailableError) are answered there."""
        if exc.category is ErrorCategory.USER:
            status = 404 if isinstance(exc, UnknownModelError) else 400
        else:
            log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
            status = 500
        return JSONResponse({"detail": exc.message}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """FastAPI's answer, with Starlette's bare "Not Found" / "Method Not Allowed" (a path
        no route has) saying what was not found."""
        detail = exc.detail
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"path: {request.url.path!r} is not a route of this gateway"
        elif exc.status_code == 405 and detail == "Method Not Allowed":
            detail = f"method: {request.method} is not allowed on {request.url.path!r}"
        return await http_exception_handler(
            request, StarletteHTTPException(exc.status_code, detail, headers=exc.headers)
        )

    @app.exception_handler(HeldOpsFullError)
    async def held_full(request: Request, exc: HeldOpsFullError) -> JSONResponse:
        """Too many calls sent ahead of a missing seq_id: 429, which the SDK retries after
        Retry-After; by then the missing call has usually arrived and let them run."""
        return GatewayJSONResponse(
            {"detail": exc.message},
            status_code=429,
            headers={"Retry-After": str(HELD_FULL_RETRY_AFTER_S)},
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's own 422, whose errors echo the input: a JSON NaN in a field that fails
        validation made its response unrenderable (a 500)."""
        return GatewayJSONResponse({"detail": validation_errors(exc)}, status_code=422)

    @app.exception_handler(DataError)
    async def unstorable(request: Request, exc: DataError) -> JSONResponse:
        """A value Postgres cannot hold or compare (a number past bigint, text it cannot
        encode) that no check before it caught: the caller's to fix, not a 500."""
        reason = str(exc.orig).splitlines()[0] if exc.orig is not None else type(exc).__name__
        return GatewayJSONResponse(
            {"detail": f"request: a value is out of range or not storable ({reason})"},
            status_code=400,
        )

    async def store_outage(request: Request, exc: Exception) -> JSONResponse:
        """Redis or Postgres away (a restart, a failover) is a 503 with Retry-After, which
        the SDK retries with the same body, not a 500 that reads as a bug. Other errors of
        these types (Postgres refusing a row) are bugs: raised on, for the 500 and the log."""
        store = outage_of(exc)
        if store is None:
            raise exc
        return JSONResponse(
            {"detail": f"{store} is unreachable; retry shortly"},
            status_code=503,
            headers={"Retry-After": str(OUTAGE_RETRY_AFTER_S)},
        )

    # RedisUnavailableError too: it is a QueueTinkerError first, which would make it a 500.
    for outage in (*REDIS_DOWN, RedisUnavailableError, DBAPIError, ConnectionError, TimeoutError):
        app.add_exception_handler(outage, store_outage)


def validation_errors(exc: RequestValidationError) -> list[Any]:
    """FastAPI's errors, each naming its field in `loc`; the input each echoes is cut short
    (it may be a whole body) and a bytes one decoded leniently (a body that is not UTF-8
    made FastAPI's own handler raise)."""
    errors = []
    for error in exc.errors():
        given = error.get("input")
        if isinstance(given, bytes | bytearray):
            given = bytes(given[:200]).decode("utf-8", "replace")
        elif isinstance(given, str):
            given = given[:200]
        elif isinstance(given, dict | list) and len(json.dumps(given, default=str)) > 200:
            given = "(too long to echo)"
        errors.append({**error, "input": given})
    return list(jsonable_encoder(errors))


def outage_of(exc: BaseException) -> str | None:
    """'Redis' or 'Postgres' when `exc` says that store is not answering, else None."""
    if isinstance(exc, (*REDIS_DOWN, RedisUnavailableError)):
        return "Redis"
    return "Postgres" if unreachable(exc) else None
