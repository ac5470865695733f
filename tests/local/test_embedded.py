"""The embedded default runs real servers from pip packages and keeps their data."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import text

from queue_tinker.errors import EmbeddedServerError
from queue_tinker.local.embedded import EmbeddedPostgres, EmbeddedRedis, free_port
from queue_tinker.local.processes import pid_alive
from queue_tinker.store.db import make_engine


@pytest.fixture
def scratch_dir() -> Iterator[Path]:
    """A directory outside /tmp/pytest-of-<user>. As root, pgserver runs Postgres as the user
    `pgserver`, and every pytest start (another run in parallel, say) chmods that root to 0700,
    locking Postgres out of its own data mid-run."""
    path = Path(tempfile.mkdtemp(prefix="qt-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_embedded_redis_answers_and_keeps_data_across_restart(tmp_path: Path) -> None:
    """A key written before stop is read back after a restart on the same data dir (AOF)."""
    server = EmbeddedRedis(tmp_path / "redis")
    with server as url:
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.set("qt-embedded", "kept")
        client.close()
        assert server.proc is not None
        pid = server.proc.pid
    assert not pid_alive(pid)
    assert (tmp_path / "redis" / "appendonly.aof").exists()

    port = free_port()
    with EmbeddedRedis(tmp_path / "redis", port=port) as url:
        assert url == f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        assert client.get("qt-embedded") == b"kept"
        client.close()


def test_an_embedded_replica_holds_what_its_primary_was_written(tmp_path: Path) -> None:
    """`replica_of`: the second server replicates the first (WAIT counts it), read-only."""
    with EmbeddedRedis(tmp_path / "primary") as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with (
            EmbeddedRedis(tmp_path / "replica", replica_of=port) as replica_url,
            redis.Redis.from_url(url) as primary,
            redis.Redis.from_url(replica_url) as replica,
        ):
            primary.set("qt-replicated", "held")
            assert primary.wait(1, 20_000) == 1
            assert replica.get("qt-replicated") == b"held"
            with pytest.raises(redis.ReadOnlyError):
                replica.set("qt-replicated", "no")


def test_embedded_redis_reports_why_it_failed(tmp_path: Path) -> None:
    """A port already in use fails fast with redis' own log lines in the message."""
    with EmbeddedRedis(tmp_path / "a") as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(EmbeddedServerError, match="redis-server exited"):
            EmbeddedRedis(tmp_path / "b", port=port).start()


async def test_embedded_postgres_answers_select_1(scratch_dir: Path) -> None:
    """pgserver's Postgres answers at the URL we return, through the service's own asyncpg
    engine (unix-socket URL included), and stops cleanly."""
    server = EmbeddedPostgres(scratch_dir / "postgres")
    url = server.start()
    try:
        engine = make_engine(url)
        try:
            async with engine.connect() as conn:
                assert (await conn.execute(text("select 1"))).scalar() == 1
                database = (await conn.execute(text("select current_database()"))).scalar()
                assert database == "postgres"
        finally:
            await engine.dispose()
        pid = int((scratch_dir / "postgres" / "postmaster.pid").read_text().split()[0])
    finally:
        server.stop()
    assert not pid_alive(pid)
