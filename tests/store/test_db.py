"""The engine's connection settings (store/db.py), against the real Postgres."""

from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from queue_tinker.store.db import make_engine


async def test_a_transaction_left_idle_is_ended_and_its_row_locks_released(
    database_url: str,
) -> None:
    """A client that stops talking inside a transaction (its host partitioned away mid-write:
    it cannot send its COMMIT) holds the row locks it took for idle_in_transaction_ms only;
    then Postgres ends its session, and another writer of the same row goes on."""
    engine = make_engine(database_url, idle_in_transaction_ms=1_000)
    table = f"idle_lock_probe_{uuid.uuid4().hex[:8]}"
    try:
        async with engine.begin() as setup:
            await setup.execute(text(f"CREATE TABLE {table} (id int PRIMARY KEY, n int)"))
            await setup.execute(text(f"INSERT INTO {table} VALUES (1, 0)"))
        cut_off = await engine.connect()
        await cut_off.begin()
        await cut_off.execute(text(f"UPDATE {table} SET n = n + 1 WHERE id = 1"))
        # From here the cut-off client sends nothing, as if its link were down.
        began = time.monotonic()
        async with engine.begin() as other:
            await other.execute(text(f"UPDATE {table} SET n = 100 WHERE id = 1"))
        waited = time.monotonic() - began
        assert 0.5 < waited < 10, waited
        with pytest.raises(DBAPIError):
            await cut_off.execute(text("SELECT 1"))  # its session was ended by the server
        await cut_off.close()
        async with engine.connect() as check:
            assert (await check.execute(text(f"SELECT n FROM {table}"))).scalar_one() == 100
    finally:
        async with engine.begin() as cleanup:
            await cleanup.execute(text(f"DROP TABLE IF EXISTS {table}"))
        await engine.dispose()
