"""Checkpoint TTL expiry by the rq housekeeper: real Redis, Postgres, rq and files.

rq's scheduler in burst mode (`work(burst=True, with_scheduler=True)`) moves the scheduled jobs
that are due at that moment onto the queue once, before the worker drains it; a job that comes
due later waits for the next burst. Scores are whole seconds, so the tests wait for due times
rounded up.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from object_store import S3Server
from procs import REPO, child_env
from rq import Queue, SimpleWorker, Worker
from rq.job import Job
from rq.registry import ScheduledJobRegistry
from rq.scheduler import RQScheduler
from sqlalchemy import select

from queue_tinker.errors import HousekeeperUnavailableError
from queue_tinker.queue.control.expiry_jobs import (
    DELETE_JOB,
    TTL_JOB,
    expiry_job_id,
    housekeeping_queue,
    run_now,
    schedule_checkpoint_expiry,
)
from queue_tinker.services.housekeeper import (
    configure,
    expire_checkpoint,
    reset_configuration,
    sweep_expired_checkpoints,
)
from queue_tinker.settings import Settings
from queue_tinker.store.checkpoints import ExpiryOutcome
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.store.models import CheckpointRow
from queue_tinker.store.record_writer import apply_records
from queue_tinker.types import CheckpointRecord
from queue_tinker.types.enums import CheckpointKind

# A SIGTERM'd housekeeper's exit, its rq scheduler process included: 0.12-0.17 s here; rq's own
# stop, which waits out the scheduler's 1 s sleep between heartbeats, took 0.92 s.
STOPPED_WITHIN_S = 0.8

HOUR = 3_600.0


# --- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture
def queue_name(key_prefix: str) -> str:
    return housekeeping_queue(key_prefix)


@pytest.fixture
def rq_redis(redis_url: str, queue_name: str) -> Iterator[redis.Redis]:
    """A sync client; afterwards every rq key of the test's queue is deleted (job, worker and
    registry names all contain the queue name)."""
    client = redis.Redis.from_url(redis_url)
    yield client
    keys = list(client.scan_iter(match=f"rq:*{queue_name}*", count=1000))
    if keys:
        client.delete(*keys)
    client.srem("rq:queues", f"rq:queue:{queue_name}")
    client.close()


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


@pytest.fixture
def configured(database_url: str, storage: Path) -> Iterator[None]:
    """What the housekeeper process sets up, for jobs run by an in-test rq worker."""
    configure(database_url, storage)
    yield
    reset_configuration()


def make_checkpoint(storage: Path, expires_at: float | None) -> tuple[str, Path]:
    """A checkpoint directory as a worker leaves it; its tinker:// id and directory."""
    run, name = f"run-{uuid.uuid4().hex[:10]}", "ckpt"
    checkpoint_id = f"tinker://{run}/weights/{name}"
    directory = storage / run / "weights" / name
    directory.mkdir(parents=True)
    (directory / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    write_meta(directory, checkpoint_id, expires_at)
    return checkpoint_id, directory


def write_meta(directory: Path, checkpoint_id: str, expires_at: float | None) -> None:
    meta = {
        "id": checkpoint_id,
        "expires_at": expires_at,
        "kind": "state",
        "model_id": checkpoint_id.split("/")[2],
        "created_at": time.time() - HOUR,
    }
    (directory / "qt_meta.json").write_text(json.dumps(meta))


def record(
    database_url: str, checkpoint_id: str, directory: Path | str, expires_at: float | None
) -> None:
    """The row the recorder would write (`directory`: a path, or a location in a bucket)."""
    rec = CheckpointRecord(
        id=checkpoint_id,
        model_id=checkpoint_id.split("/")[2],
        tenant_id="default",
        name=str(directory).rsplit("/", 1)[-1],
        kind=CheckpointKind.STATE,
        path=str(directory),
        size_bytes=64,
        created_at=time.time() - HOUR,
        expires_at=expires_at,
    )

    async def apply() -> None:
        engine = make_engine(database_url)
        try:
            await apply_records(session_factory(engine), [rec])
        finally:
            await engine.dispose()

    asyncio.run(apply())


def deleted_at(database_url: str, checkpoint_id: str) -> datetime | None:
    async def fetch() -> Any:
        engine = make_engine(database_url)
        try:
            async with engine.connect() as conn:
                query = select(CheckpointRow.deleted_at).where(CheckpointRow.id == checkpoint_id)
                return (await conn.execute(query)).one().deleted_at
        finally:
            await engine.dispose()

    result: datetime | None = asyncio.run(fetch())
    return result


def burst(connection: redis.Redis, queue_name: str) -> None:
    """One rq burst: the scheduler moves due jobs onto the queue, then the worker drains it."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    worker = SimpleWorker(
        [Queue(queue_name, connection=connection)],
        connection=connection,
        name=f"{queue_name}--test-{uuid.uuid4().hex[:8]}",
    )
    try:
        worker.work(burst=True, with_scheduler=True, logging_level="WARNING")
    finally:  # rq installs its own SIGINT/SIGTERM handlers; give pytest its own back
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def scheduled(connection: redis.Redis, queue_name: str) -> dict[str, float]:
    """Job id -> due time (unix seconds) of the queue's scheduled jobs."""
    key = ScheduledJobRegistry(queue_name, connection=connection).key
    entries: list[tuple[bytes, float]] = connection.zrange(key, 0, -1, withscores=True)  # type: ignore[assignment]
    return {job_id.decode(): score for job_id, score in entries}


def sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()) + 0.05)


def job_result(connection: redis.Redis, job_id: str) -> Any:
    return Job.fetch(job_id, connection=connection).return_value()


# --- the job -------------------------------------------------------------------------------


def test_expire_removes_an_expired_checkpoint_and_marks_its_row(
    database_url: str, storage: Path
) -> None:
    """Called directly: files gone, deleted_at set; again is a no-op; checkpoints with a TTL
    ahead or none are left alone, files and rows."""
    now = time.time()
    expired, expired_dir = make_checkpoint(storage, now - 5)
    later, later_dir = make_checkpoint(storage, now + HOUR)
    forever, forever_dir = make_checkpoint(storage, None)
    for cid, path, exp in (
        (expired, expired_dir, now - 5),
        (later, later_dir, now + HOUR),
        (forever, forever_dir, None),
    ):
        record(database_url, cid, path, exp)

    def expire(cid: str, directory: Path) -> str:
        return expire_checkpoint(cid, str(directory), database_url, storage_dir=str(storage))

    assert expire(expired, expired_dir) == ExpiryOutcome.EXPIRED
    assert not expired_dir.exists()
    assert not any(p.name.startswith(".") for p in expired_dir.parent.iterdir())  # no trash
    marked = deleted_at(database_url, expired)
    assert marked is not None

    assert expire(expired, expired_dir) == ExpiryOutcome.EXPIRED
    assert deleted_at(database_url, expired) == marked  # marked once

    for cid, path in ((later, later_dir), (forever, forever_dir)):
        assert expire(cid, path) == ExpiryOutcome.KEPT
        assert (path / "adapter_model.safetensors").exists()
        assert deleted_at(database_url, cid) is None


def test_expire_removes_an_expired_checkpoint_from_a_bucket(
    database_url: str, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With QT_STORAGE=s3://...: the expired checkpoint's objects are gone and its row marked;
    one with a TTL ahead keeps its objects."""
    monkeypatch.setenv("QT_S3_ENDPOINT_URL", s3_server.url)
    monkeypatch.setenv("QT_DATA_DIR", str(tmp_path / "data"))
    bucket = s3_server.bucket()
    store = s3_server.store(bucket, tmp_path / "cache")
    now = time.time()
    made = []
    for expires_at in (now - 5, now + HOUR):
        checkpoint_id, directory = make_checkpoint(tmp_path / "staged", expires_at)
        key = checkpoint_id.removeprefix("tinker://")
        staged = store.staging(key)
        for item in directory.iterdir():
            (staged / item.name).write_bytes(item.read_bytes())
        store.commit(key, staged)
        record(database_url, checkpoint_id, store.location(key), expires_at)
        made.append((checkpoint_id, key))

    (expired, expired_key), (later, later_key) = made
    outcome = expire_checkpoint(
        expired, store.location(expired_key), database_url, storage_dir=store.root
    )
    assert outcome == ExpiryOutcome.EXPIRED
    listed = s3_server.client().list_objects_v2(Bucket=bucket, Prefix=f"ckpt/{expired_key}/")
    assert listed.get("KeyCount") == 0
    assert deleted_at(database_url, expired) is not None
    kept = expire_checkpoint(later, store.location(later_key), database_url, storage_dir=store.root)
    assert kept == ExpiryOutcome.KEPT
    assert "adapter_model.safetensors" in store.files(later_key)


def test_rq_runs_a_due_expiry_and_scheduling_twice_keeps_one_job(
    database_url: str,
    storage: Path,
    rq_redis: redis.Redis,
    key_prefix: str,
    queue_name: str,
    configured: None,
) -> None:
    """Through rq: a job scheduled in the past runs on the next burst; another checkpoint's
    job, scheduled twice for an hour ahead, is one job and stays scheduled."""
    now = time.time()
    expired, expired_dir = make_checkpoint(storage, now - 5)
    later, later_dir = make_checkpoint(storage, now + HOUR)
    record(database_url, expired, expired_dir, now - 5)
    record(database_url, later, later_dir, now + HOUR)
    schedule_checkpoint_expiry(rq_redis, key_prefix, expired, str(expired_dir), now - 5)
    schedule_checkpoint_expiry(rq_redis, key_prefix, later, str(later_dir), now + HOUR / 2)
    schedule_checkpoint_expiry(rq_redis, key_prefix, later, str(later_dir), now + HOUR)

    later_job = expiry_job_id(queue_name, later)
    assert scheduled(rq_redis, queue_name) == {
        expiry_job_id(queue_name, expired): math.ceil(now - 5),
        later_job: math.ceil(now + HOUR),  # moved, not doubled
    }
    burst(rq_redis, queue_name)

    assert job_result(rq_redis, expiry_job_id(queue_name, expired)) == ExpiryOutcome.EXPIRED
    assert not expired_dir.exists()
    assert deleted_at(database_url, expired) is not None
    assert later_dir.exists() and deleted_at(database_url, later) is None
    assert list(scheduled(rq_redis, queue_name)) == [later_job]


def test_scheduled_expiry_waits_for_its_time(
    database_url: str,
    storage: Path,
    rq_redis: redis.Redis,
    key_prefix: str,
    queue_name: str,
    configured: None,
) -> None:
    """A checkpoint expiring in ~1 s: a burst before then does nothing, one after removes it."""
    expires_at = time.time() + 1.0
    cid, directory = make_checkpoint(storage, expires_at)
    record(database_url, cid, directory, expires_at)
    schedule_checkpoint_expiry(rq_redis, key_prefix, cid, str(directory), expires_at)

    burst(rq_redis, queue_name)
    assert directory.exists() and deleted_at(database_url, cid) is None

    sleep_until(math.ceil(expires_at))
    burst(rq_redis, queue_name)
    assert not directory.exists()
    assert deleted_at(database_url, cid) is not None
    assert scheduled(rq_redis, queue_name) == {}


def test_missing_row_is_retried_until_the_recorder_writes_it(
    database_url: str, storage: Path, rq_redis: redis.Redis, queue_name: str, configured: None
) -> None:
    """Files go at once; the row, recorded later, is marked by the job's retry."""
    expires_at = time.time() - 5
    cid, directory = make_checkpoint(storage, expires_at)
    queue = Queue(queue_name, connection=rq_redis)
    first = queue.enqueue(
        expire_checkpoint,
        job_id=expiry_job_id(queue_name, cid),
        kwargs={"checkpoint_id": cid, "directory": str(directory), "retry_delay_s": 1.0},
    )
    burst(rq_redis, queue_name)

    assert job_result(rq_redis, first.id) == ExpiryOutcome.ROW_MISSING
    assert not directory.exists()
    retry_id = expiry_job_id(queue_name, cid, "-r1")
    due = scheduled(rq_redis, queue_name)
    assert list(due) == [retry_id]

    # The recorder catches up (its record still says the files exist: no deleted_at).
    record(database_url, cid, directory, expires_at)
    sleep_until(due[retry_id])
    burst(rq_redis, queue_name)
    assert job_result(rq_redis, retry_id) == ExpiryOutcome.EXPIRED
    assert deleted_at(database_url, cid) is not None
    assert scheduled(rq_redis, queue_name) == {}


def test_meta_that_says_not_expired_keeps_the_checkpoint(
    database_url: str, storage: Path, rq_redis: redis.Redis, queue_name: str, configured: None
) -> None:
    """The row says expired, but the files' meta (the source of truth) says the TTL was
    extended, or removed: nothing is deleted; the extended one is looked at again then."""
    past, extended_to = time.time() - 5, time.time() + HOUR
    extended, extended_dir = make_checkpoint(storage, past)
    write_meta(extended_dir, extended, extended_to)
    no_ttl, no_ttl_dir = make_checkpoint(storage, past)
    write_meta(no_ttl_dir, no_ttl, None)
    queue = Queue(queue_name, connection=rq_redis)
    jobs = []
    for cid, directory in ((extended, extended_dir), (no_ttl, no_ttl_dir)):
        record(database_url, cid, directory, past)
        jobs.append(
            queue.enqueue(
                expire_checkpoint,
                job_id=expiry_job_id(queue_name, cid),
                kwargs={"checkpoint_id": cid, "directory": str(directory)},
            )
        )
    burst(rq_redis, queue_name)

    for job, (cid, directory) in zip(
        jobs, ((extended, extended_dir), (no_ttl, no_ttl_dir)), strict=True
    ):
        assert job_result(rq_redis, job.id) == ExpiryOutcome.KEPT
        assert (directory / "adapter_model.safetensors").exists()
        assert deleted_at(database_url, cid) is None
    at = math.ceil(extended_to)
    assert scheduled(rq_redis, queue_name) == {expiry_job_id(queue_name, extended, f"-at{at}"): at}


# --- the sweep -----------------------------------------------------------------------------


def run_now_beside_a_worker(
    redis_url: str, prefix: str, connection: redis.Redis, job: str, kwargs: dict[str, Any]
) -> Any:
    """run_now from a thread (it waits for the result), with an rq worker of the housekeeping
    queue taking its job in this thread (rq's signal handlers need the main thread)."""
    done: dict[str, Any] = {}

    def call() -> None:
        try:
            done["result"] = asyncio.run(run_now(redis_url, prefix, job, kwargs, 20))
        except Exception as exc:
            done["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    queue = Queue(housekeeping_queue(prefix), connection=connection)
    deadline = time.monotonic() + 10
    while not queue.count and caller.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    SimpleWorker([queue], connection=connection).work(burst=True)
    caller.join(timeout=30)
    if "error" in done:
        raise done["error"]
    return done["result"]


def test_a_client_s_delete_and_ttl_change_run_now_as_housekeeper_jobs(
    settings: Settings, rq_redis: redis.Redis, storage: Path, configured: None
) -> None:
    """The jobs behind a Python client's TTL change and delete (it writes no Postgres): run at
    once, their results handed back; the TTL is in the meta, the row and a scheduled expiry
    job; the delete removes the files and marks the row; a TTL for a checkpoint gone says so."""
    database_url = settings.database_url or ""
    cid, directory = make_checkpoint(storage, None)
    record(database_url, cid, directory, None)
    later = time.time() + HOUR
    kwargs = {"tenant_id": "default", "checkpoint_id": cid, "directory": str(directory)}
    url, prefix = settings.redis_url or "", settings.key_prefix
    assert run_now_beside_a_worker(url, prefix, rq_redis, TTL_JOB, {**kwargs, "expires_at": later})
    assert json.loads((directory / "qt_meta.json").read_text())["expires_at"] == later
    assert ScheduledJobRegistry(housekeeping_queue(prefix), connection=rq_redis).get_job_ids()
    del kwargs["tenant_id"]
    assert run_now_beside_a_worker(url, prefix, rq_redis, DELETE_JOB, kwargs) is True
    assert not directory.exists()
    assert deleted_at(database_url, cid) is not None
    gone = {"tenant_id": "default", "checkpoint_id": cid, "directory": str(directory)}
    assert not run_now_beside_a_worker(url, prefix, rq_redis, TTL_JOB, {**gone, "expires_at": 1})


def test_a_job_run_now_with_no_housekeeper_says_to_start_one(
    settings: Settings, rq_redis: redis.Redis
) -> None:
    """No housekeeper takes the job within the wait: an error that says how to start one, and
    the job is taken back (it does not run later, when nobody waits for it)."""
    url, prefix = settings.redis_url or "", settings.key_prefix
    began = time.monotonic()
    with pytest.raises(HousekeeperUnavailableError, match="queue-tinker housekeeper"):
        asyncio.run(run_now(url, prefix, DELETE_JOB, {"checkpoint_id": "c", "directory": "d"}, 1))
    assert time.monotonic() - began < 5
    assert Queue(housekeeping_queue(prefix), connection=rq_redis).count == 0


def test_sweep_expires_what_no_job_was_scheduled_for(
    database_url: str, storage: Path, tmp_path: Path
) -> None:
    """Rows past expires_at get their files removed and deleted_at set, also when the files are
    already gone; rows ahead or without TTL, and directories outside storage, are untouched."""
    now = time.time()
    lost, lost_dir = make_checkpoint(storage, now - 30)
    gone, gone_dir = make_checkpoint(storage, now - 30)
    later, later_dir = make_checkpoint(storage, now + HOUR)
    forever, forever_dir = make_checkpoint(storage, None)
    outside, outside_dir = make_checkpoint(tmp_path / "elsewhere", now - 30)
    rows = (
        (lost, lost_dir, now - 30),
        (gone, gone_dir, now - 30),
        (later, later_dir, now + HOUR),
        (forever, forever_dir, None),
        (outside, outside_dir, now - 30),
    )
    for cid, path, exp in rows:
        record(database_url, cid, path, exp)
    for child in gone_dir.iterdir():
        child.unlink()
    gone_dir.rmdir()

    counts = sweep_expired_checkpoints(database_url, storage_dir=str(storage))

    # The database is shared with other tests: their leftovers count too (as refused).
    assert counts["expired"] >= 2 and counts["refused"] >= 1
    assert not lost_dir.exists()
    assert deleted_at(database_url, lost) is not None
    assert deleted_at(database_url, gone) is not None
    for cid, path in ((later, later_dir), (forever, forever_dir), (outside, outside_dir)):
        assert (path / "qt_meta.json").exists()
        assert deleted_at(database_url, cid) is None


# --- the process ---------------------------------------------------------------------------


def wait_for_startup_sweep(
    connection: redis.Redis, queue_name: str, proc: subprocess.Popen[bytes], log_path: Path
) -> None:
    """Until the housekeeper's worker has run its first job (the sweep it queues at start)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()
        workers = Worker.all(queue=Queue(queue_name, connection=connection))
        if any(w.successful_job_count + w.failed_job_count >= 1 for w in workers):
            return
        time.sleep(0.05)
    pytest.fail(f"the housekeeper ran no sweep within 10 s:\n{log_path.read_text()}")


def test_housekeeper_process_expires_a_scheduled_checkpoint_and_stops_on_sigterm(
    settings: Settings, rq_redis: redis.Redis, queue_name: str, tmp_path: Path
) -> None:
    """`queue-tinker housekeeper` (rq worker + scheduler) removes a checkpoint when its TTL
    runs out, through the scheduled job, and exits 0 on SIGTERM."""
    database_url = settings.database_url or ""
    storage = settings.storage_dir
    storage.mkdir(parents=True)
    log_path = tmp_path / "housekeeper.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "queue_tinker.cli", "housekeeper"],
            env=child_env(settings),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        # After the start-up sweep, so the expiry below is the scheduled job's doing.
        wait_for_startup_sweep(rq_redis, queue_name, proc, log_path)
        expires_at = time.time() + 1.0
        cid, directory = make_checkpoint(storage, expires_at)
        record(database_url, cid, directory, expires_at)
        schedule_checkpoint_expiry(rq_redis, settings.key_prefix, cid, str(directory), expires_at)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and deleted_at(database_url, cid) is None:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.1)
        assert not directory.exists(), log_path.read_text()
        assert deleted_at(database_url, cid) is not None
        assert job_result(rq_redis, expiry_job_id(queue_name, cid)) == ExpiryOutcome.EXPIRED

        lock = RQScheduler.get_locking_key(queue_name)
        assert rq_redis.exists(lock), "the housekeeper's scheduler holds its queue's lock"
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, log_path.read_text()
        took = time.monotonic() - began
        print(f"stopped in {took:.2f} s")
        # Its scheduler was stopped without waiting out its 1 s sleep, and its lock is free
        # for the next housekeeper.
        assert took < STOPPED_WITHIN_S, log_path.read_text()
        assert not rq_redis.exists(lock)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("reader", ["docker compose", "compose-spec"])
def test_compose_runs_a_housekeeper_with_the_workers_checkpoint_storage(reader: str) -> None:
    """docker-compose.yml has a housekeeper service on the workers' checkpoint storage (the
    same bucket, endpoint and credentials; read by docker compose where installed, and by the
    compose specification's bindings)."""
    from test_compose import _config

    services = _config(reader)["services"]
    housekeeper, worker = services["housekeeper"], services["worker"]
    assert housekeeper["command"] == ["housekeeper"]
    for variable in ("QT_STORAGE", "QT_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID"):
        assert housekeeper["environment"][variable] == worker["environment"][variable]
