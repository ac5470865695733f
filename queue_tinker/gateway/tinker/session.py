"""The Tinker protocol's session calls (docs/tinker-http-protocol.md, sections 2 and 7):
client config, sessions and their heartbeats, server capabilities, telemetry."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from queue_tinker.gateway.auth import tenant_of
from queue_tinker.gateway.off_loop import OffLoopRoute
from queue_tinker.queue.control import silent_sessions
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import RecordLog
from queue_tinker.settings import Settings
from queue_tinker.types import SessionRecord

# The SDK's protocol features, on where this gateway serves their endpoints (the JWT exchange
# is not offered: tinker/unserved.py).
# The SDK's own chunking defaults (tinker.types.ClientConfigResponse).
SDK_CHUNK_LEN = 1024
SDK_CHUNK_BYTES = 5_000_000
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "proto_compress_fwdbwd": True,  # envelope/compressed.py
    "sample_use_retrieve_futures": True,  # tinker/sample_futures.py
    "custom_loss_server_side": True,  # tinker/custom_loss.py
    "sample_join_sampling_session": True,  # tinker/sample_futures.py
}


class HeartbeatRequest(BaseModel):
    session_id: str


def session_router(settings: Settings, keys: Keys) -> APIRouter:
    router = APIRouter(prefix="/api/v1", route_class=OffLoopRoute)

    def records(request: Request) -> RecordLog:
        return RecordLog(request.app.state.redis, keys)

    @router.post("/client/config")
    async def client_config(_: str = Depends(tenant_of)) -> dict[str, Any]:
        # The SDK splits a big forward_backward into chunks of these sizes: keep them within
        # what this deployment accepts in one request, so lowered limits still fit (the SDK's
        # byte count is its own estimate, so leave it half the body cap as margin).
        return {
            **CLIENT_CONFIG,
            "fwdbwd_max_chunk_len": min(SDK_CHUNK_LEN, settings.max_datums_per_request),
            "fwdbwd_max_chunk_bytes_count": min(SDK_CHUNK_BYTES, settings.max_request_bytes // 2),
        }

    @router.post("/create_session")
    async def create_session(request: Request, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        session_id = f"sess-{uuid.uuid4().hex}"
        await request.app.state.gateway_queue.open_session(session_id, tenant)
        await records(request).append(
            SessionRecord(id=session_id, tenant_id=tenant, created_at=time.time())
        )
        return {"session_id": session_id, "type": "create_session"}

    @router.post("/session_heartbeat")
    async def session_heartbeat(
        body: HeartbeatRequest, request: Request, tenant: str = Depends(tenant_of)
    ) -> dict[str, Any]:
        """Keeps the session alive (only the owner's heartbeat counts): its samples stay while
        heartbeats come (silent_sessions.py)."""
        await request.app.state.gateway_queue.session_of(body.session_id, tenant)
        await silent_sessions.heard_from(request.app.state.redis, keys, body.session_id)
        return {"type": "session_heartbeat"}

    @router.post("/sessions/{session_id}/finish")
    async def finish_session(
        session_id: str, request: Request, tenant: str = Depends(tenant_of)
    ) -> dict[str, Any]:
        """The session's record stays, and its silence from now on cancels nothing; another
        tenant's session is 404."""
        await request.app.state.gateway_queue.session_of(session_id, tenant)
        await silent_sessions.forget(request.app.state.redis, keys, session_id)
        return {}

    @router.get("/get_server_capabilities")
    async def server_capabilities(request: Request, _: str = Depends(tenant_of)) -> dict[str, Any]:
        """Base models served by live workers right now, each with its longest
        `Base:peft:<tokens>` name."""
        registry = WorkerRegistry(request.app.state.redis, keys)
        names = await registry.model_names(settings.lease_ttl_ms * 3)
        return {
            "supported_models": [
                {
                    "model_name": name,
                    "max_context_length": context,
                    "trainable": True,
                    "sampleable": True,
                }
                for name, context in names.items()
            ]
        }

    @router.post("/telemetry")
    async def telemetry(_: str = Depends(tenant_of)) -> dict[str, Any]:
        return {"status": "accepted"}  # and dropped: the service keeps its own record

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return router
