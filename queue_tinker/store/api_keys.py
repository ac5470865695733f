"""API keys: `tml-` tokens mapped to tenants. Only a key's SHA-256 is stored; the key itself is
shown once, when it is created.

A key is 32 random bytes, so a plain (unsalted) hash is safe to store and lets a lookup be one
indexed equality on `key_hash`.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.errors import UserInputError
from queue_tinker.store.models import ApiKeyRow, TenantRow

KEY_PREFIX = "tml-"
SHOWN_PREFIX = 12  # characters of a key kept for display ("tml-AbCdEfGh")
MAX_TENANT_ID = 64


@dataclass(frozen=True)
class KeyInfo:
    """A key as listed: never the key itself."""

    id: str
    tenant_id: str
    prefix: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None
    admin: bool = False


@dataclass(frozen=True)
class KeyOwner:
    """Who a valid key speaks for: its tenant, and whether it is an admin key (which sees
    every tenant on the dashboard and may drain workers)."""

    tenant_id: str
    admin: bool


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant_id(tenant_id: str) -> str:
    if (
        not isinstance(tenant_id, str)
        or not tenant_id
        or len(tenant_id) > MAX_TENANT_ID
        or not all(c.isalnum() or c in "-_." for c in tenant_id)
    ):
        raise UserInputError(
            f"tenant: must be 1 to {MAX_TENANT_ID} letters, digits, '-', '_' or '.', "
            f"got {tenant_id!r}"
        )
    return tenant_id


def _info(row: ApiKeyRow) -> KeyInfo:
    return KeyInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        prefix=row.prefix,
        name=row.name,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        admin=row.admin,
    )


async def create_key(
    sessions: async_sessionmaker[AsyncSession],
    tenant_id: str,
    name: str | None = None,
    admin: bool = False,
) -> tuple[KeyInfo, str]:
    """A new key for `tenant_id` (the tenant is created on its first key): (its info, the key,
    which is not stored and cannot be shown again). An admin key still belongs to a tenant (its
    own runs are made there) but sees all tenants on the dashboard."""
    check_tenant_id(tenant_id)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    async with sessions() as session, session.begin():
        await session.execute(
            insert(TenantRow).values(id=tenant_id, name=tenant_id).on_conflict_do_nothing()
        )
        row = ApiKeyRow(
            id=f"key-{uuid.uuid4().hex[:16]}",
            tenant_id=tenant_id,
            key_hash=hash_key(key),
            prefix=key[:SHOWN_PREFIX],
            name=name,
            admin=bool(admin),
        )
        session.add(row)
        await session.flush()
        await session.refresh(row)
        return _info(row), key


async def list_keys(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str | None = None
) -> list[KeyInfo]:
    """Every key (of one tenant, if given), oldest first, revoked ones included."""
    query = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id)
    if tenant_id is not None:
        query = query.where(ApiKeyRow.tenant_id == tenant_id)
    async with sessions() as session:
        return [_info(row) for row in await session.scalars(query)]


async def revoke_key(sessions: async_sessionmaker[AsyncSession], key_id: str) -> bool:
    """Revoke a key by its id; False if there is no such key or it was already revoked."""
    async with sessions() as session, session.begin():
        result = await session.execute(
            update(ApiKeyRow)
            .where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
            .values(revoked_at=func.now())
        )
        return bool(result.rowcount)  # type: ignore[attr-defined]


async def key_info(sessions: async_sessionmaker[AsyncSession], key: str) -> KeyInfo | None:
    """The listing of a valid (unrevoked) key, looked up by the key itself; None otherwise."""
    async with sessions() as session:
        row = await session.scalar(
            select(ApiKeyRow).where(
                ApiKeyRow.key_hash == hash_key(key), ApiKeyRow.revoked_at.is_(None)
            )
        )
    return _info(row) if row is not None else None


async def tenant_for_key(sessions: async_sessionmaker[AsyncSession], key: str) -> str | None:
    """The tenant a key belongs to; None for a malformed, unknown or revoked key."""
    owner = await owner_of_key(sessions, key)
    return owner.tenant_id if owner else None


async def owner_of_key(sessions: async_sessionmaker[AsyncSession], key: str) -> KeyOwner | None:
    """The tenant of a key and whether it is an admin key; None for a malformed, unknown or
    revoked key."""
    if not isinstance(key, str) or not key.startswith(KEY_PREFIX):
        return None
    async with sessions() as session:
        row = (
            await session.execute(
                select(ApiKeyRow.tenant_id, ApiKeyRow.admin).where(
                    ApiKeyRow.key_hash == hash_key(key), ApiKeyRow.revoked_at.is_(None)
                )
            )
        ).first()
    return KeyOwner(tenant_id=row.tenant_id, admin=bool(row.admin)) if row else None


def utc_text(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if moment else "-"
