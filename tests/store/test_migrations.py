"""The schema comes only from the alembic migrations, and the ORM models match it."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, inspect, text
from sqlalchemy.exc import IntegrityError

from queue_tinker.store.db import (
    create_database,
    drop_database,
    make_engine,
    to_async_url,
    with_database,
)
from queue_tinker.store.migrate import (
    SchemaState,
    current_revision,
    downgrade,
    head,
    schema_state,
    upgrade,
    wait_for_schema,
)
from queue_tinker.store.models import Base
from queue_tinker.types.enums import CheckpointKind, JobStatus, OpKind

TABLES = {
    "tenants",
    "api_keys",
    "sessions",
    "training_runs",
    "custom_loss_graphs",
    "sampling_sessions",
    "requests",
    "checkpoints",
    "workers",
}


async def _on_sync(url: str, fn: Any) -> Any:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(fn)
    finally:
        await engine.dispose()


def _tables(url: str) -> set[str]:
    return set(asyncio.run(_on_sync(url, lambda c: inspect(c).get_table_names())))


def _diff(conn: Connection) -> list[Any]:
    return compare_metadata(MigrationContext.configure(conn), Base.metadata)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:p@h:5/db", "postgresql+asyncpg://u:p@h:5/db"),
        ("postgres://u@h/db", "postgresql+asyncpg://u@h/db"),
        (
            "postgresql+psycopg://u@h/db?application_name=x",
            "postgresql+asyncpg://u@h/db?application_name=x",
        ),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgresql://u@h/db?sslmode=require", "postgresql+asyncpg://u@h/db?ssl=require"),
        (
            "postgresql://postgres:@/postgres?host=/tmp/pg",
            "postgresql+asyncpg://postgres:@/postgres?host=%2Ftmp%2Fpg",
        ),
    ],
)
def test_to_async_url(url: str, expected: str) -> None:
    """Every Postgres URL spelling becomes an asyncpg URL with its query kept."""
    assert to_async_url(url) == expected


def test_to_async_url_refuses_other_databases() -> None:
    """A non-Postgres URL is refused with the scheme named."""
    with pytest.raises(ValueError, match="'sqlite'"):
        to_async_url("sqlite:///x.db")


def test_with_database_keeps_server_and_query() -> None:
    """with_database swaps only the database name (unix-socket host query kept)."""
    assert with_database("postgresql://postgres:@/postgres?host=/tmp/pg", "other") == (
        "postgresql://postgres:@/other?host=%2Ftmp%2Fpg"
    )


def test_upgrade_builds_schema_and_default_tenant(empty_database_url: str) -> None:
    """upgrade on an empty database creates every table and the default tenant."""
    assert current_revision(empty_database_url) is None
    upgrade(empty_database_url)
    assert current_revision(empty_database_url) == head()
    assert _tables(empty_database_url) == TABLES | {"alembic_version"}
    select_tenants = text("SELECT id, name FROM tenants")
    tenants = asyncio.run(_on_sync(empty_database_url, lambda c: c.execute(select_tenants).all()))
    assert [tuple(row) for row in tenants] == [("default", "default")]


def test_downgrade_to_base_then_upgrade_again(empty_database_url: str) -> None:
    """downgrade to base leaves only alembic_version; upgrading again works."""
    upgrade(empty_database_url)
    downgrade(empty_database_url)
    assert current_revision(empty_database_url) is None
    assert _tables(empty_database_url) == {"alembic_version"}
    upgrade(empty_database_url)
    assert _tables(empty_database_url) == TABLES | {"alembic_version"}


def test_orm_matches_migrations(database_url: str) -> None:
    """alembic finds no difference between the migrated schema and Base.metadata."""
    assert asyncio.run(_on_sync(database_url, _diff)) == []


async def test_upgrade_from_inside_an_event_loop(empty_database_url: str) -> None:
    """upgrade/current work when called from async code (they step off the running loop)."""
    upgrade(empty_database_url)
    assert current_revision(empty_database_url) == head()


async def test_check_constraints_follow_the_enums(database_url: str) -> None:
    """Every JobStatus/OpKind value is accepted and anything else refused."""
    engine = make_engine(database_url)
    insert = text(
        "INSERT INTO requests (id, model_id, tenant_id, seq, kind, status, queued_at) "
        "VALUES (:id, 'ck-model', 'default', :seq, :kind, :status, now())"
    )
    try:
        async with engine.connect() as conn:
            for seq, status in enumerate(JobStatus):
                for k, kind in enumerate(OpKind):
                    row = {"id": f"ck-{status}-{kind}", "kind": kind.value, "status": status.value}
                    await conn.execute(insert, {**row, "seq": seq * 100 + k})
            await conn.rollback()
            for bad in ({"kind": "ping", "status": "lost"}, {"kind": "teleport", "status": "done"}):
                with pytest.raises(IntegrityError, match="ck_requests_"):
                    await conn.execute(insert, {"id": "ck-bad", "seq": 999, **bad})
                await conn.rollback()
    finally:
        await engine.dispose()


async def test_checkpoint_kinds_follow_the_enum(database_url: str) -> None:
    """Every CheckpointKind value (external included) is accepted and anything else refused."""
    engine = make_engine(database_url)
    insert = text(
        "INSERT INTO checkpoints (id, model_id, tenant_id, name, kind, path, size_bytes) "
        "VALUES (:id, 'ck-model', 'default', :id, :kind, '/nowhere', 0)"
    )
    try:
        async with engine.connect() as conn:
            for kind in CheckpointKind:
                await conn.execute(insert, {"id": f"ck-{kind}", "kind": kind.value})
            await conn.rollback()
            with pytest.raises(IntegrityError, match="ck_checkpoints_kind"):
                await conn.execute(insert, {"id": "ck-bad", "kind": "snapshot"})
    finally:
        await engine.dispose()


def test_pgserver_unix_socket_url() -> None:
    """A pgserver unix-socket URL works for create_database, migrations and drop_database."""
    pgserver = pytest.importorskip("pgserver")
    # Not under tmp_path: as root, pgserver runs postgres as user 'pgserver' and opens up the
    # parent folders, but every pytest start chmods /tmp/pytest-of-root back to 0700, so a
    # concurrent pytest run made initdb fail with "Permission denied".
    with tempfile.TemporaryDirectory(prefix="qt-pgserver-") as tmp:
        server = pgserver.get_server(Path(tmp) / "pg", cleanup_mode="delete")
        try:
            admin = server.get_uri()
            assert "host=" in admin
            asyncio.run(create_database(admin, "qt_socket"))
            url = with_database(admin, "qt_socket")
            upgrade(url)
            assert current_revision(url) == head()
            asyncio.run(drop_database(admin, "qt_socket"))
        finally:
            server.cleanup()


def test_schema_state_says_when_this_release_may_start(empty_database_url: str) -> None:
    """What `migrate --wait-s` waits for: ready at head, or at a revision this release does not
    know (a newer release migrated it first); not ready when never migrated or behind head."""
    url = empty_database_url
    never = schema_state(url)
    assert not never.ready and "never migrated" in never.reason
    upgrade(url)
    assert schema_state(url) == SchemaState(True, f"the schema is at head ({head()})")
    downgrade(url, "-1")
    behind = schema_state(url)
    assert not behind.ready and f"behind head ({head()})" in behind.reason
    upgrade(url)
    newer = text("UPDATE alembic_version SET version_num = 'f0f0f0f0f0f0'")
    asyncio.run(_on_sync(url, lambda c: (c.execute(newer), c.commit())))
    ahead = schema_state(url)
    assert ahead.ready and "f0f0f0f0f0f0, which this release does not know" in ahead.reason


def test_schema_state_waits_out_a_postgres_that_is_not_there() -> None:
    """A database that cannot be reached is not ready, and the reason names the failure."""
    state = wait_for_schema("postgresql://postgres@127.0.0.1:1/none", wait_s=0.1, poll_s=0.05)
    assert not state.ready
    assert state.reason.startswith("cannot read the schema's revision: ")
