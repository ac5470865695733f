"""The Redis and Postgres a benchmark runs against, and its own space in them: the URLs (the
local servers, or embedded ones where none answers), a scratch database per run, a fresh key
prefix per part, the settings its processes see, its clients and the job timestamps the queue
writes.

This mirrors parts of tests/procs.py on purpose: tests must not import bench, and bench does
not import tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from queue_tinker.client import ServiceClient
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings, settings_env

REPO = Path(__file__).resolve().parents[2]
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
# Every service benchmark reads its URLs from these (bench.with_services and the suite set them).
REDIS_ENV, POSTGRES_ENV = "QT_BENCH_REDIS_URL", "QT_BENCH_DATABASE_URL"


def redis_url() -> str:
    return os.environ.get(REDIS_ENV, DEFAULT_REDIS)


def postgres_url() -> str:
    return os.environ.get(POSTGRES_ENV, DEFAULT_POSTGRES)


@contextlib.contextmanager
def local_services(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """`env` with both URLs set: those it has, else the default servers when they answer, else
    embedded ones, started here and stopped afterwards."""
    from queue_tinker.local.embedded import EmbeddedPostgres, EmbeddedRedis, listening

    env = dict(env)
    with contextlib.ExitStack() as stack:
        # Not under pytest's or a user's tmp: as root, pgserver runs Postgres as its own user.
        data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qt-services-")))
        data.chmod(0o755)
        if REDIS_ENV not in env:
            url = DEFAULT_REDIS
            if not listening("127.0.0.1", 6379):
                url = stack.enter_context(EmbeddedRedis(data / "redis"))
            env[REDIS_ENV] = url
        if POSTGRES_ENV not in env:
            url = DEFAULT_POSTGRES
            if not listening("127.0.0.1", 5432):
                url = stack.enter_context(EmbeddedPostgres(data / "postgres"))
            env[POSTGRES_ENV] = url
        yield env


# --- settings ----------------------------------------------------------------------------------
def child_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child process see `settings`."""
    return {**settings_env(settings, os.environ), "PYTHONUNBUFFERED": "1"}


def make_settings(redis_url: str, database_url: str, prefix: str, data_dir: Path) -> Settings:
    """Settings for one part of a run."""
    # Production defaults for leases, heartbeats and linger: nothing tuned for the benchmark.
    return Settings(
        redis_url=redis_url, database_url=database_url, key_prefix=prefix, data_dir=data_dir
    )


@contextlib.contextmanager
def deployment(
    redis_url: str, database_url: str, part: str, data_dir: Path, **changes: Any
) -> Iterator[Settings]:
    """Settings for one part of a run on a fresh key prefix (its keys deleted afterwards),
    with `changes` made to the defaults."""
    with fresh_prefix(redis_url, part) as prefix:
        settings = make_settings(redis_url, database_url, prefix, data_dir)
        yield settings.model_copy(update=changes) if changes else settings


# --- clients -----------------------------------------------------------------------------------
@contextlib.contextmanager
def service_client(settings: Settings, timeout: float = 15) -> Iterator[ServiceClient]:
    """A ServiceClient on `settings`, closed afterwards, but never hanging the benchmark on it:
    a close that does not return in `timeout` seconds is reported and left behind (its thread
    is a daemon)."""
    service = ServiceClient(settings)
    try:
        yield service
    finally:
        closer = threading.Thread(target=service.close, name="qt-bench-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            warning = f"warning: ServiceClient.close() did not return within {timeout:g} s"
            print(warning, file=sys.stderr, flush=True)


def job_times(redis_url: str, keys: Keys, job_ids: list[str]) -> list[tuple[float, ...] | None]:
    """(queued_at, started_at, finished_at) of each job, from its hash (Redis clock); None for
    a job without all three."""
    names = [keys.job(job_id) for job_id in job_ids]
    replies = hash_fields(redis_url, names, "queued_at", "started_at", "finished_at")
    return [None if None in r else tuple(float(v) for v in r) for r in replies]


def hash_fields(redis_url: str, names: Sequence[str | bytes], *fields: str) -> list[list[Any]]:
    """The `fields` of each hash in `names` (None where missing), pipelined 5,000 at a time."""
    replies: list[list[Any]] = []
    with redis.Redis.from_url(redis_url) as client:
        for start in range(0, len(names), 5_000):
            pipe = client.pipeline(transaction=False)
            for name in names[start : start + 5_000]:
                pipe.hmget(name, list(fields))
            replies += pipe.execute()
    return replies


# --- Redis and Postgres scratch space ----------------------------------------------------------
def delete_matching(redis_url: str, pattern: str) -> int:
    """Delete every key matching `pattern`; how many there were."""
    with redis.Redis.from_url(redis_url) as client:
        found = list(client.scan_iter(match=pattern, count=1000))
        for start in range(0, len(found), 500):
            client.delete(*found[start : start + 500])
        return len(found)


@contextlib.contextmanager
def fresh_prefix(redis_url: str, part: str) -> Iterator[str]:
    """A key prefix nothing else uses; its keys are deleted afterwards."""
    prefix = f"qt-bench-{part}-{uuid.uuid4().hex[:8]}"
    try:
        yield prefix
    finally:
        delete_matching(redis_url, f"{prefix}:*")


@contextlib.contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    """A new database at the head migration, dropped afterwards."""
    from queue_tinker.store.db import create_database, drop_database, with_database
    from queue_tinker.store.migrate import upgrade

    name = f"qt_bench_{uuid.uuid4().hex[:12]}"
    asyncio.run(create_database(admin_url, name))
    try:
        url = with_database(admin_url, name)
        upgrade(url)
        yield url
    finally:
        asyncio.run(drop_database(admin_url, name))


def postgres_version(url: str) -> str:
    """`SHOW server_version`, or "unknown (<error>)"."""
    from sqlalchemy import text

    from queue_tinker.store.db import make_engine

    async def ask() -> str:
        engine = make_engine(url)
        try:
            async with engine.connect() as conn:
                return str((await conn.execute(text("SHOW server_version"))).scalar())
        finally:
            await engine.dispose()

    try:
        return asyncio.run(ask())
    except Exception as exc:
        return f"unknown ({type(exc).__name__})"


def redis_version(url: str) -> str:
    with redis.Redis.from_url(url) as client:
        return str(client.info("server")["redis_version"])
