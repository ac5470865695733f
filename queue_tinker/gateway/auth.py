"""Who is calling: the `X-API-Key` header (a `tml-` key) resolved to its tenant in Postgres."""

from __future__ import annotations

from fastapi import HTTPException, Request

from queue_tinker.store import api_keys


async def tenant_of(request: Request) -> str:
    """The caller's tenant; 401 without a valid, unrevoked key."""
    key = request.headers.get("X-API-Key")
    if not key:
        raise HTTPException(401, "missing X-API-Key header: send a tml-... key "
                                 "(queue-tinker keys create --tenant NAME)")
    tenant = await api_keys.tenant_for_key(request.app.state.sessions, key)
    if tenant is None:
        raise HTTPException(401, "invalid or revoked API key")
    return tenant
