"""Run the alembic migrations from code (CLI, service start-up, test fixtures), and wait for
another process to have run them (`queue-tinker migrate --wait-s`, a pod's init container).

The alembic Config is built here rather than read from alembic.ini, and points at the
installed `migrations` package, so this works from a wheel as well as from the repo root.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from queue_tinker import migrations
from queue_tinker.store.db import to_async_url

T = TypeVar("T")


def alembic_config(url: str) -> Config:
    """An alembic Config for `url`, with the packaged migrations as its script location."""
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    # Through attributes, not set_main_option: ConfigParser would treat a '%' in a
    # password as interpolation.
    config.attributes["url"] = url
    return config


def _off_loop(fn: Callable[[], T]) -> T:
    """Call `fn` here, or on a fresh thread when this thread already runs an event loop.

    migrations/env.py uses asyncio.run, which refuses to start inside a running loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision`."""
    _off_loop(lambda: command.upgrade(alembic_config(url), revision))


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision` (base: drop everything)."""
    _off_loop(lambda: command.downgrade(alembic_config(url), revision))


def _current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def _current(url: str, connect_timeout_s: float | None = None) -> str | None:
    connect_args = {} if connect_timeout_s is None else {"timeout": connect_timeout_s}
    engine = create_async_engine(to_async_url(url), poolclass=NullPool, connect_args=connect_args)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(_current_revision)
    finally:
        await engine.dispose()


def current_revision(url: str) -> str | None:
    """The revision the database at `url` is at; None when it has never been migrated."""
    return _off_loop(lambda: asyncio.run(_current(url)))


def head() -> str:
    """The newest revision in migrations/ (what `upgrade` reaches)."""
    from alembic.script import ScriptDirectory

    revision = ScriptDirectory.from_config(alembic_config("postgresql://unused")).get_current_head()
    assert revision is not None
    return revision


# One look at the schema gives up on a Postgres that does not answer after this long (asyncpg
# waits 60 s by default, longer than a short --wait-s).
SCHEMA_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class SchemaState:
    """Whether the schema is ready for this release, and a line saying why (not)."""

    ready: bool
    reason: str


def schema_state(url: str) -> SchemaState:
    """Ready when the database at `url` is at this release's head, or at a revision this
    release does not know: a newer release migrated it, as an upgrade does before its pods
    restart one at a time (migrations keep the schema readable by the release before)."""
    from alembic.script import ScriptDirectory

    target = head()
    try:
        current = _off_loop(lambda: asyncio.run(_current(url, SCHEMA_CONNECT_TIMEOUT_S)))
    except (OSError, SQLAlchemyError) as exc:  # not up yet, or its address or password wrong
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return SchemaState(False, f"cannot read the schema's revision: {first_line}")
    if current == target:
        return SchemaState(True, f"the schema is at head ({target})")
    if current is None:
        return SchemaState(False, "the database was never migrated: `queue-tinker migrate`")
    scripts = ScriptDirectory.from_config(alembic_config(url))
    if current in {script.revision for script in scripts.walk_revisions()}:
        return SchemaState(
            False, f"the schema is at {current}, behind head ({target}): `queue-tinker migrate`"
        )
    return SchemaState(
        True,
        f"the schema is at {current}, which this release does not know: taken as newer than "
        f"its head ({target})",
    )


def wait_for_schema(url: str, wait_s: float, poll_s: float = 1.0) -> SchemaState:
    """Look at the schema every `poll_s` until it is ready or `wait_s` has passed; the last
    look. Migrates nothing."""
    deadline = time.monotonic() + wait_s
    while True:
        state = schema_state(url)
        if state.ready or time.monotonic() + poll_s > deadline:
            return state
        time.sleep(poll_s)
