"""Alembic environment, on the asyncio engine (asyncpg) like the rest of the store.

The URL comes from, in order: `config.attributes["url"]` (queue_tinker.store.migrate),
`-x url=...` on the alembic CLI, the `sqlalchemy.url` option, then $QT_DATABASE_URL.
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from queue_tinker.store.db import to_async_url
from queue_tinker.store.models import Base

config = context.config
target_metadata = Base.metadata

# Only the alembic CLI has an ini file; never reconfigure logging of a host process.
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = (
        config.attributes.get("url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("QT_DATABASE_URL")
    )
    if not url:
        raise RuntimeError(
            "no database URL: pass -x url=..., set sqlalchemy.url or QT_DATABASE_URL"
        )
    return to_async_url(url)


def _configure(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


async def _run_online() -> None:
    # NullPool: a migration is one connection, used once; nothing to keep.
    engine = create_async_engine(_url(), poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_configure)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online())
