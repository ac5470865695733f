"""Who is calling: the `X-API-Key` header (a `tml-` key) resolved to its tenant in Postgres.

Valid keys are remembered for QT_API_KEY_CACHE_S, so a training loop's every call does not
cost a Postgres query; a revoked key therefore stops working within that time. While Postgres
cannot be reached, a key Postgres vouched for at most QT_API_KEY_OUTAGE_S ago keeps working
(training goes on through Redis), a key it refused at its last check (revoked) stays refused
(401), and any other key gets 503 with Retry-After rather than a 500.

Two dependencies share that cache: `tenant_of` (the Tinker protocol routes: a key acts as its
tenant, admin or not) and `caller_of` (the dashboard: an admin key sees every tenant).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from queue_tinker.store import api_keys
from queue_tinker.store.db import unreachable

MAX_CACHED_KEYS = 10_000


@dataclass(frozen=True)
class Caller:
    """The owner of a valid key: its tenant, and whether it is an admin key."""

    tenant_id: str
    admin: bool = False

    @property
    def scope(self) -> str | None:
        """The tenant whose things the caller sees on the dashboard; None (every tenant) for
        an admin key. The queue module's functions take exactly this."""
        return None if self.admin else self.tenant_id


class KeyCache:
    """key hash -> (caller, when Postgres last vouched for it); and the keys Postgres last
    refused (unknown or revoked), so an outage cannot bring a revoked key back."""

    def __init__(self, ttl_s: float, outage_s: float = 0.0) -> None:
        self.ttl_s = ttl_s
        self.outage_s = outage_s
        self._entries: dict[str, tuple[Caller, float]] = {}
        self._refused: dict[str, float] = {}

    def get(self, key_hash: str) -> Caller | None:
        entry = self._entries.get(key_hash)
        if entry is None or entry[1] + self.ttl_s < time.monotonic():
            return None
        return entry[0]

    def last_known(self, key_hash: str) -> Caller | None:
        """The caller this key had when last checked, if that check is at most outage_s old
        (Postgres is down); None for a key Postgres refused since."""
        entry = self._entries.get(key_hash)
        if entry is None or key_hash in self._refused:
            return None
        return entry[0] if time.monotonic() - entry[1] <= self.outage_s else None

    def refused(self, key_hash: str) -> bool:
        """Whether Postgres said no to this key at its last check."""
        return key_hash in self._refused

    def put(self, key_hash: str, caller: Caller) -> None:
        self._refused.pop(key_hash, None)
        if self.ttl_s <= 0 and self.outage_s <= 0:
            return
        if len(self._entries) >= MAX_CACHED_KEYS:
            self._entries.clear()
        self._entries[key_hash] = (caller, time.monotonic())

    def refuse(self, key_hash: str) -> None:
        self._entries.pop(key_hash, None)
        if len(self._refused) >= MAX_CACHED_KEYS:
            self._refused.clear()
        self._refused[key_hash] = time.monotonic()


async def caller_of(request: Request) -> Caller:
    """The caller of a dashboard route; 401 without a valid, unrevoked key."""
    key = request.headers.get("X-API-Key")
    if not key:
        raise HTTPException(
            401,
            "missing X-API-Key header: send a tml-... key (queue-tinker keys create --tenant NAME)",
        )
    return await caller_of_key(request, key)


async def caller_of_key(request: Request, key: str) -> Caller:
    """The owner of `key` however it was sent (X-API-Key, or a bearer token on the
    OpenAI-compatible routes); 401 unless it is valid and unrevoked."""
    cache: KeyCache = request.app.state.key_cache
    key_hash = api_keys.hash_key(key)
    caller = cache.get(key_hash)
    if caller is None:
        try:
            owner = await api_keys.owner_of_key(request.app.state.sessions, key)
        except Exception as exc:
            # Postgres away: a key it refused last time stays refused; a key it vouched for
            # within QT_API_KEY_OUTAGE_S keeps working; any other is the app's store-outage
            # 503 (gateway/app.py), as every route's is.
            if unreachable(exc) and cache.refused(key_hash):
                raise HTTPException(401, "invalid or revoked API key") from None
            stale = cache.last_known(key_hash) if unreachable(exc) else None
            if stale is None:
                raise
            return stale
        if owner is None:
            cache.refuse(key_hash)
            raise HTTPException(401, "invalid or revoked API key")
        caller = Caller(tenant_id=owner.tenant_id, admin=owner.admin)
        cache.put(key_hash, caller)
    return caller


async def tenant_of(request: Request) -> str:
    """The caller's tenant; 401 without a valid, unrevoked key. An admin key acts as its own
    tenant here: the Tinker routes never cross tenants."""
    return (await caller_of(request)).tenant_id


# The route parameter that is the caller's tenant (by its API key): one definition for every route.
TenantDep = Annotated[str, Depends(tenant_of)]
