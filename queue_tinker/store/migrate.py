"""Run the alembic migrations from code (CLI, service start-up, test fixtures).

The alembic Config is built here rather than read from alembic.ini, and points at the
installed `migrations` package, so this works from a wheel as well as from the repo root.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Connection
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


async def _current(url: str) -> str | None:
    engine = create_async_engine(to_async_url(url), poolclass=NullPool)
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
