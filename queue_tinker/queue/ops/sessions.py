"""What the Tinker protocol's door keeps in Redis beside the ops: a gateway session's tenant,
how to answer a job once it is done, and the secret that signs download URLs. Every gateway
replica reads the same keys, so a client may reach any of them."""

from __future__ import annotations

import json
import secrets
from typing import Any

from queue_tinker.queue import redis_bytes
from queue_tinker.queue.connection import RedisClient
from queue_tinker.queue.keys import Keys

SESSION_TTL_S = 7 * 86_400  # renewed by every heartbeat


class ProtocolState:
    def __init__(self, redis: RedisClient, keys: Keys, result_ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.result_ttl_s = result_ttl_s  # a reply lives as long as its job's result

    async def open_session(self, session_id: str, tenant: str) -> None:
        await self.redis.set(self.keys.session(session_id), tenant, ex=SESSION_TTL_S)

    async def session_tenant(self, session_id: str) -> str | None:
        """The tenant a session belongs to (None: no such session), its TTL renewed."""
        key = self.keys.session(session_id)
        tenant = await redis_bytes.get(self.redis, key)
        if tenant is None:
            return None
        await self.redis.expire(key, SESSION_TTL_S)
        return tenant.decode()

    async def set_reply(self, job_id: str, reply: dict[str, Any]) -> None:
        """How to answer for the job once it is done, beyond what its kind says."""
        await self.redis.set(self.keys.job_reply(job_id), json.dumps(reply), ex=self.result_ttl_s)

    async def reply(self, job_id: str) -> dict[str, Any]:
        raw = await redis_bytes.get(self.redis, self.keys.job_reply(job_id))
        return dict(json.loads(raw)) if raw else {}

    async def signing_secret(self) -> bytes:
        """The deployment's URL-signing secret: made once by whichever gateway needs it first."""
        await self.redis.set(self.keys.download_signing_secret(), secrets.token_hex(32), nx=True)
        return await redis_bytes.get(self.redis, self.keys.download_signing_secret()) or b""
