"""Real services for every test: the local Redis/Postgres when they answer, else embedded ones.

Each test gets its own Redis key prefix (flushed afterwards); the run gets a scratch Postgres
database created through the alembic migrations, dropped at the end.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import hypothesis
import pytest
import redis
import tinker
from procs import (
    assert_nothing_dead_lettered,
    close_sdk_clients,
    gateway_process,
    lora_deployment,
    make_key,
    sdk_client,
)
from redis.asyncio import Redis as AsyncRedis

from queue_tinker.client import ServiceClient
from queue_tinker.local.embedded import EmbeddedPostgres, EmbeddedRedis, listening
from queue_tinker.queue.connection import connect
from queue_tinker.settings import Settings

if TYPE_CHECKING:
    import object_store

# The fuzz tests (test_fuzz.py, test_hostile_routes.py) draw the same examples on every run, so
# a red gate means a change broke something rather than a new draw finding an old case; set
# QT_TEST_FUZZ_EXPLORE=1 to draw new ones (how the scalar-target case in test_fuzz.py was found).
hypothesis.settings.register_profile("gate", derandomize=True)
hypothesis.settings.register_profile("explore", derandomize=False)
hypothesis.settings.load_profile("explore" if os.environ.get("QT_TEST_FUZZ_EXPLORE") else "gate")

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def services_dir() -> Iterator[Path]:
    """Data of embedded fallbacks. Not under pytest's tmp: as root, pgserver runs Postgres as
    its own user, and each pytest start locks /tmp/pytest-of-root back down to root."""
    path = Path(tempfile.mkdtemp(prefix="qt-services-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url(services_dir: Path) -> Iterator[str]:
    url = os.environ.get("QT_TEST_REDIS_URL")
    if url:
        yield url
        return
    if listening("127.0.0.1", 6379):
        yield LOCAL_REDIS
        return
    server = EmbeddedRedis(services_dir / "redis")
    yield server.start()
    server.stop()


@pytest.fixture(scope="session")
def postgres_admin_url(services_dir: Path) -> Iterator[str]:
    url = os.environ.get("QT_TEST_DATABASE_URL")
    if url:
        yield url
        return
    if listening("127.0.0.1", 5432):
        yield LOCAL_POSTGRES
        return
    server = EmbeddedPostgres(services_dir / "postgres")
    yield server.start()
    server.stop()


def _scratch_database(admin_url: str) -> tuple[str, str]:
    """Create an empty database beside the admin one; return (its URL, its name)."""
    from queue_tinker.store.db import create_database, with_database

    name = f"qt_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(create_database(admin_url, name))
    return with_database(admin_url, name), name


@pytest.fixture(scope="session")
def database_url(postgres_admin_url: str) -> Iterator[str]:
    """A scratch database at the head migration, shared by the run."""
    from queue_tinker.store.db import drop_database
    from queue_tinker.store.migrate import upgrade

    url, name = _scratch_database(postgres_admin_url)
    upgrade(url)
    yield url
    asyncio.run(drop_database(postgres_admin_url, name))


@pytest.fixture
def empty_database_url(postgres_admin_url: str) -> Iterator[str]:
    """A brand-new empty database for this test alone (migration tests)."""
    from queue_tinker.store.db import drop_database

    url, name = _scratch_database(postgres_admin_url)
    yield url
    asyncio.run(drop_database(postgres_admin_url, name))


@pytest.fixture
def key_prefix(redis_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A key prefix of the test's own; afterwards its dead-letter stream must be empty
    (a test that buries records on purpose says so with @pytest.mark.dead_letters)."""
    prefix = f"qt-test-{uuid.uuid4().hex[:10]}"
    yield prefix
    if request.node.get_closest_marker("dead_letters") is None:
        assert_nothing_dead_lettered(redis_url, prefix)
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    # The housekeeper's rq queue is named after the prefix; rq keeps its keys under rq:.
    keys += list(client.scan_iter(match=f"rq:*{prefix}-housekeeping*", count=1000))
    client.srem("rq:queues", f"rq:queue:{prefix}-housekeeping")
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])
    client.close()


@pytest.fixture
def settings(redis_url: str, database_url: str, key_prefix: str, tmp_path: Path) -> Settings:
    return Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=key_prefix,
        data_dir=tmp_path / "data",
        lease_ttl_ms=3_000,
        heartbeat_ms=500,
        linger_ms=2_000,
    )


@pytest.fixture
def service(settings: Settings) -> Iterator[ServiceClient]:
    """A client of the test's deployment, closed afterwards."""
    client = ServiceClient(settings)
    yield client
    client.close()


@pytest.fixture(scope="module")
def deployment(redis_url: str, database_url: str) -> Iterator[Settings]:
    """The module's deployment: one LoRA worker on the tiny model (a module that needs other
    settings defines its own `deployment`)."""
    with lora_deployment(redis_url, database_url, "queue-tinker/tiny-llama") as settings:
        yield settings


@pytest.fixture(scope="module")
def key(deployment: Settings) -> str:
    """An API key of a new tenant of the module's deployment."""
    return make_key(deployment, f"sdk-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def sdk_service(gateway: str, key: str) -> Iterator[tinker.ServiceClient]:
    """The official tinker SDK's ServiceClient on the module's gateway, as that key's tenant."""
    with sdk_client(gateway, key) as client:
        yield client


@pytest.fixture(scope="module")
def gateway(deployment: Settings) -> Iterator[str]:
    """A `queue-tinker serve` process for the module's `deployment` fixture (each module that
    drives a gateway process defines its deployment); its URL. The tinker SDK clients still
    open when the module ends are closed before it stops (procs.close_sdk_clients)."""
    with gateway_process(deployment, deployment.data_dir / "gateway.log") as url:
        yield url
        close_sdk_clients()


@pytest.fixture(autouse=True)
def root_logger_kept() -> Iterator[None]:
    """Code under test may configure the root logger as a script would (the tinker-cookbook's
    loops replace its handlers with one on the sys.stderr of the moment, pytest's capture, and
    set it to INFO): it is put back after each test. Left as it was, later records (an SDK
    client's background thread, pgserver's exit) went to a capture stream pytest had closed:
    "--- Logging error ---" at the end of the run."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture
def sdk_sockets_collected() -> Iterator[None]:
    """After a test that used the tinker SDK: give its background cleanup a moment, then
    collect the sockets it left (procs.SDK_CLIENT_MARKS)."""
    yield
    time.sleep(0.3)
    gc.collect()


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[AsyncRedis]:
    """An asyncio client of the test Redis (the queue's own connection settings)."""
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[object_store.S3Server]:
    """An S3-compatible server of the test's own (moto), with credentials it takes in the
    environment (workers started by the test inherit them)."""
    import object_store  # moto and boto3 load only for the tests that use them

    object_store.aws_env(monkeypatch)
    server = object_store.S3Server()
    yield server
    server.stop()
