"""API keys: `tml-` keys map to tenants, only their hash is stored, revoking takes effect at
once; and the `queue-tinker keys` command that manages them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from procs import REPO
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queue_tinker.errors import UserInputError
from queue_tinker.store import api_keys
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.store.models import ApiKeyRow

T = TypeVar("T")


def run(database_url: str, fn: Callable[[async_sessionmaker[AsyncSession]], Awaitable[T]]) -> T:
    async def go() -> T:
        engine = make_engine(database_url)
        try:
            return await fn(session_factory(engine))
        finally:
            await engine.dispose()

    return asyncio.run(go())


def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def test_a_key_maps_to_its_tenant_and_only_its_hash_is_stored(database_url: str) -> None:
    who = tenant()
    info, key = run(database_url, lambda s: api_keys.create_key(s, who, "laptop"))
    assert key.startswith("tml-") and len(key) > 40
    assert (info.tenant_id, info.name, info.revoked_at) == (who, "laptop", None)
    assert key.startswith(info.prefix) and len(info.prefix) < len(key)
    assert run(database_url, lambda s: api_keys.tenant_for_key(s, key)) == who

    async def stored(s: async_sessionmaker[AsyncSession]) -> tuple[str, str]:
        async with s() as session:
            row = (await session.scalars(select(ApiKeyRow).where(ApiKeyRow.id == info.id))).one()
            name = await session.scalar(text("SELECT name FROM tenants WHERE id = :t"), {"t": who})
            return row.key_hash, name

    key_hash, tenant_name = run(database_url, stored)
    assert key_hash == api_keys.hash_key(key) and key not in key_hash
    assert tenant_name == who  # the tenant was made with its first key

    # A second key of the same tenant; each resolves on its own.
    _, other = run(database_url, lambda s: api_keys.create_key(s, who))
    assert other != key
    assert run(database_url, lambda s: api_keys.tenant_for_key(s, other)) == who
    listed = run(database_url, lambda s: api_keys.list_keys(s, who))
    assert len(listed) == 2 and listed[0].id == info.id


@pytest.mark.parametrize("key", ["", "tml-", "tml-not-a-real-key", "sk-abc", "x" * 500])
def test_unknown_and_malformed_keys_have_no_tenant(database_url: str, key: str) -> None:
    assert run(database_url, lambda s: api_keys.tenant_for_key(s, key)) is None


def test_a_revoked_key_stops_working_at_once(database_url: str) -> None:
    who = tenant()
    info, key = run(database_url, lambda s: api_keys.create_key(s, who))
    assert run(database_url, lambda s: api_keys.revoke_key(s, info.id)) is True
    assert run(database_url, lambda s: api_keys.tenant_for_key(s, key)) is None
    assert run(database_url, lambda s: api_keys.revoke_key(s, info.id)) is False
    (listed,) = run(database_url, lambda s: api_keys.list_keys(s, who))
    assert listed.revoked_at is not None


@pytest.mark.parametrize("bad", ["", "has space", "a/b", "x" * 65])
def test_tenant_ids_are_checked(database_url: str, bad: str) -> None:
    with pytest.raises(UserInputError, match="tenant: must be 1 to 64 letters"):
        run(database_url, lambda s: api_keys.create_key(s, bad))


def keys_cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QT_DATABASE_URL": database_url}
    return subprocess.run(
        [sys.executable, "-m", "queue_tinker.cli", "keys", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_keys_command_creates_lists_and_revokes(database_url: str) -> None:
    who = tenant()
    created = keys_cli(database_url, "create", "--tenant", who, "--name", "ci runner")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("tml-") and "shown only now" in created.stderr
    assert run(database_url, lambda s: api_keys.tenant_for_key(s, key)) == who

    listed = keys_cli(database_url, "list", "--tenant", who)
    assert listed.returncode == 0, listed.stderr
    (line,) = [row for row in listed.stdout.splitlines() if who in row]
    key_id = line.split()[0]
    assert key_id.startswith("key-") and key[:12] in line and key not in listed.stdout
    assert line.endswith("ci runner")

    assert keys_cli(database_url, "revoke", key_id).returncode == 0
    assert run(database_url, lambda s: api_keys.tenant_for_key(s, key)) is None
    again = keys_cli(database_url, "revoke", key_id)
    assert again.returncode == 1 and "no active key" in again.stderr
    bad = keys_cli(database_url, "create", "--tenant", "no spaces please")
    assert bad.returncode == 2 and "tenant: must be" in bad.stderr
