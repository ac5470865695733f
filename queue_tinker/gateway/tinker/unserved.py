"""The paths the tinker SDK calls that this service does not offer: each answers 501 with the
feature it belongs to and what to use instead, never FastAPI's bare 404/405, so a user who
reaches one learns why (docs/tinker-http-protocol.md, section 12 lists every SDK path).

This router is included first (before routes such as DELETE .../{checkpoint_id:path}, which
would take .../publish), so UNSERVED is the closed list of what is not offered: serving a path
means taking it out of the list (tests/gateway/test_sdk_protocol.py fails while both exist).
501 is a 5xx, which the SDK's HTTP layer would retry ten times; `x-should-retry: false` stops
that (its outer retry loop still retries 5xx for up to 300 s where a call is wrapped in it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from queue_tinker.gateway.auth import tenant_of


@dataclass(frozen=True)
class Unserved:
    method: str
    path: str  # FastAPI's form: a checkpoint id holds a '/', so it is {checkpoint_id:path}
    feature: str
    instead: str

    @property
    def detail(self) -> str:
        return f"{self.feature}: not offered by this self-hosted service; {self.instead}"


UNSERVED = (
    Unserved(
        "POST",
        "/api/v1/auth/token",
        "JWT exchange (pjwt_auth_enabled)",
        "send the tml- API key itself as X-API-Key",
    ),
    Unserved(
        "PUT",
        "/api/v1/sessions/{session_id}/project",
        "projects",
        "a tenant's sessions, runs and checkpoints are its own; there are no projects",
    ),
    Unserved(
        "GET",
        "/api/v1/billing/usage/events",
        "billing usage events",
        "tokens per tenant are on /metrics (qt_tenant_tokens_total); storage is at "
        "/api/v1/billing/usage/checkpoints/current",
    ),
)


def unserved_router() -> APIRouter:
    router = APIRouter()
    for entry in UNSERVED:
        router.add_api_route(
            entry.path, _answer(entry), methods=[entry.method], include_in_schema=False
        )
    return router


def _answer(entry: Unserved) -> Any:
    async def not_offered(_: str = Depends(tenant_of)) -> JSONResponse:
        return JSONResponse(
            {"detail": entry.detail}, status_code=501, headers={"x-should-retry": "false"}
        )

    not_offered.__name__ = f"not_offered_{entry.method.lower()}_{entry.path}"
    return not_offered
