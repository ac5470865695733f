"""Engines, sessions and database housekeeping on the asyncio (asyncpg) driver."""

from __future__ import annotations

import re

from sqlalchemy import text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, InterfaceError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

_ASYNC_DRIVER = "postgresql+asyncpg"
# Database names are interpolated into CREATE/DROP DATABASE (no bind parameters there).
_SAFE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def _async_url(url: str | URL) -> URL:
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend not in ("postgresql", "postgres"):
        raise ValueError(f"database url: expected a postgresql:// URL, got scheme {backend!r}")
    parsed = parsed.set(drivername=_ASYNC_DRIVER)
    query = dict(parsed.query)
    # libpq spells it sslmode, asyncpg spells it ssl; asyncpg refuses the unknown keyword.
    if "sslmode" in query:
        query["ssl"] = query.pop("sslmode")
        parsed = parsed.set(query=query)
    return parsed


def to_async_url(url: str) -> str:
    """`postgresql://`, `postgres://` or `postgresql+psycopg://` as a `postgresql+asyncpg://` URL.

    Query parameters are kept, so unix-socket URLs (`...@/db?host=/tmp/pgdir`, as pgserver
    gives them) reach asyncpg as its `host` argument.
    """
    return _async_url(url).render_as_string(hide_password=False)


# A connect that takes longer is to a host that is gone (asyncpg would wait 60 s); a statement
# that takes longer is on a connection that died silently (no RST: a partition, a failover).
# Either way the caller's retry loop (recorder) or a 503 (gateway) is better than a hang. Every
# statement the service runs is a small indexed read or a batched write, far below this.
POSTGRES_CONNECT_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 60.0
# A session idle inside a transaction this long is ended by Postgres, releasing its row locks.
# A process cut off from the network mid-transaction (a host partitioned away) cannot send its
# COMMIT, and Postgres keeps such a session, and the locks its writes took, until TCP gives up
# (hours): meanwhile every other recorder writing the same rows waited on them. None of our
# transactions waits on anything but Postgres in between its statements.
IDLE_IN_TRANSACTION_MS = 30_000


def make_engine(url: str, *, idle_in_transaction_ms: int = IDLE_IN_TRANSACTION_MS) -> AsyncEngine:
    """An asyncpg engine; pre-ping so a restarted Postgres costs one retry, not an error."""
    return create_async_engine(
        _async_url(url),
        pool_pre_ping=True,
        connect_args={
            "timeout": POSTGRES_CONNECT_TIMEOUT_S,
            "command_timeout": COMMAND_TIMEOUT_S,
            "server_settings": {"idle_in_transaction_session_timeout": str(idle_in_transaction_ms)},
        },
    )


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    # expire_on_commit=False: rows read in a session stay usable after it closes.
    return async_sessionmaker(engine, expire_on_commit=False)


def with_database(url: str, name: str) -> str:
    """The same server and credentials as `url`, with database `name`."""
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _checked_name(name: str) -> str:
    if not _SAFE_NAME.match(name):
        raise ValueError(f"database name {name!r}: use letters, digits and _ (at most 63)")
    return name


async def _admin_execute(admin_url: str, sql: str) -> None:
    # CREATE/DROP DATABASE cannot run inside a transaction block, hence AUTOCOMMIT.
    engine = create_async_engine(_async_url(admin_url), isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(text(sql))
    finally:
        await engine.dispose()


async def create_database(admin_url: str, name: str) -> None:
    """Create an empty database `name` on the server `admin_url` points at."""
    await _admin_execute(admin_url, f'CREATE DATABASE "{_checked_name(name)}"')


async def drop_database(admin_url: str, name: str) -> None:
    """Drop database `name`, disconnecting whoever is still connected to it."""
    await _admin_execute(admin_url, f'DROP DATABASE IF EXISTS "{_checked_name(name)}" WITH (FORCE)')


def unreachable(exc: BaseException) -> bool:
    """Postgres did not answer (down, restarting, a connection cut or timed out), as opposed
    to refusing what it was sent or a bug in the statement. asyncpg's connect raises plain
    OSErrors (refused, reset) and TimeoutError (POSTGRES_CONNECT_TIMEOUT_S, COMMAND_TIMEOUT_S)."""
    if isinstance(exc, DBAPIError):
        # A cut connection, or Postgres saying it cannot serve (SQLSTATE 08 connection
        # exception, 53 insufficient resources, 57 operator intervention: shutting down).
        return (
            exc.connection_invalidated
            or isinstance(exc, InterfaceError)
            or _sqlstate(exc)[:2] in ("08", "53", "57")
        )
    return isinstance(exc, ConnectionError | TimeoutError)


def _sqlstate(exc: DBAPIError) -> str:
    return str(getattr(exc.orig, "sqlstate", "") or "")


def refused(exc: DBAPIError) -> bool:
    """Postgres refused the data itself (a constraint, or a value it cannot store, such as a
    NUL character: SQLSTATE classes 23 and 22), as opposed to an outage."""
    if isinstance(exc, IntegrityError | DataError):
        return True
    return _sqlstate(exc)[:2] in ("22", "23")
