"""Who is calling: the `X-API-Key` header (a `tml-` key) resolved to its tenant in Postgres.

Valid keys are remembered for QT_API_KEY_CACHE_S, so a training loop's every call does not
cost a Postgres query; a revoked key therefore stops working within that time.
"""

from __future__ import annotations

import time

from fastapi import HTTPException, Request

from queue_tinker.store import api_keys

MAX_CACHED_KEYS = 10_000


class KeyCache:
    """key hash -> (tenant, valid until); only valid keys are kept, so a new key works at once."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[str, float]] = {}

    def get(self, key_hash: str) -> str | None:
        entry = self._entries.get(key_hash)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def put(self, key_hash: str, tenant: str) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= MAX_CACHED_KEYS:
            self._entries.clear()
        self._entries[key_hash] = (tenant, time.monotonic() + self.ttl_s)


async def tenant_of(request: Request) -> str:
    """The caller's tenant; 401 without a valid, unrevoked key."""
    key = request.headers.get("X-API-Key")
    if not key:
        raise HTTPException(401, "missing X-API-Key header: send a tml-... key "
                                 "(queue-tinker keys create --tenant NAME)")
    cache: KeyCache = request.app.state.key_cache
    key_hash = api_keys.hash_key(key)
    tenant = cache.get(key_hash)
    if tenant is None:
        tenant = await api_keys.tenant_for_key(request.app.state.sessions, key)
        if tenant is None:
            raise HTTPException(401, "invalid or revoked API key")
        cache.put(key_hash, tenant)
    return tenant
