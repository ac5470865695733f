"""Housekeeping as rq jobs: checkpoint TTL expiry, run by `queue-tinker housekeeper`.

A checkpoint saved with a TTL gets an rq job scheduled for its expiry time
(`schedule_checkpoint_expiry`, called by the worker that wrote it). When the job fires it reads
the checkpoint's own `qt_meta.json`, which is the source of truth: only if that says the
checkpoint has expired are the files removed, so a job that fires early, or for a checkpoint
saved again since, does no harm. Then the `checkpoints` row gets `deleted_at`. The recorder
writes rows behind the queue, so a row that is not there yet is tried again a few seconds later.
A periodic sweep over Postgres catches whatever a lost job (Redis flushed, housekeeper down) left
behind. A user's delete through the gateway (`delete_checkpoint`) and a TTL changed there
(`set_meta_expiry`, then `schedule_checkpoint_expiry`) go through the same code, so the
storage checks and the meta-first rule hold for them too.

The jobs are synchronous (rq jobs are); their database work goes through the asyncpg engine
under `asyncio.run`, so no second Postgres driver is needed. `delete_checkpoint` is a coroutine
for the gateway's own loop. No torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum, StrEnum
from pathlib import Path
from types import FrameType
from typing import Any

import redis
from rq import Queue, Retry, SimpleWorker, get_current_job
from rq.exceptions import DuplicateJobError
from rq.job import Job
from sqlalchemy import Table, func, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker

from queue_tinker.local.processes import _die_with_parent
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings, load_settings
from queue_tinker.store import queries
from queue_tinker.store.db import make_engine
from queue_tinker.store.models import Checkpoint
from queue_tinker.types.checkpoints import META_FILE

log = logging.getLogger("queue_tinker.services.housekeeper")

ROW_RETRY_DELAY_S = 3.0  # the recorder lags ~1 s; a few tries cover a short Postgres hiccup too
ROW_RETRIES = 10
SWEEP_INTERVAL_S = 60.0
SWEEP_BATCH = 500
# Failures (Postgres down, storage not mounted) are retried by rq itself; the sweep is the
# backstop after that.
_ON_ERROR = Retry(max=3, interval=[10, 60, 300])
_JOB_OPTIONS: dict[str, Any] = {
    "job_timeout": 600,
    "result_ttl": 3_600,  # an hour of outcomes to inspect with `rq info` / dashboards
    "failure_ttl": 7 * 86_400,
}
_CHECKPOINTS: Table = Checkpoint.__table__  # type: ignore[assignment]
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")  # rq job ids allow only [A-Za-z0-9_-]


class Outcome(StrEnum):
    """What one expiry did (the rq job's return value)."""

    EXPIRED = "expired"  # the files are gone and the row says so (now or before)
    KEPT = "kept"  # not expired by the checkpoint's own meta (or not ours): nothing touched
    ROW_MISSING = "row-missing"  # files gone, row not recorded yet (a retry is scheduled)


class CheckpointPathError(ValueError):
    """A directory the housekeeper must not delete (outside checkpoint storage)."""


class StorageUnavailableError(RuntimeError):
    """Checkpoint storage is not there: not mounted, or not shared with the workers."""


class _Disk(Enum):
    REMOVED = "removed"  # we removed the files just now
    ABSENT = "absent"  # nothing there (removed earlier)
    KEPT = "kept"  # there, and not expired (or not the checkpoint asked for)


@dataclass(frozen=True)
class HousekeepingConfig:
    """What the jobs need from the process running them (never carried in Redis: the
    database URL holds credentials)."""

    database_url: str
    storage_dir: Path | None  # when set, only directories below it are ever deleted


_configured: list[HousekeepingConfig] = []  # set once by the housekeeper process (or a test)


def configure(database_url: str, storage_dir: Path | str | None) -> None:
    """Set the database and storage that jobs run in this process use."""
    _configured[:] = [HousekeepingConfig(database_url, Path(storage_dir) if storage_dir else None)]


def reset_configuration() -> None:
    _configured.clear()


def _config(database_url: str | None, storage_dir: str | Path | None) -> HousekeepingConfig:
    """Explicit arguments win, then configure(), then QT_* settings (a plain `rq worker`)."""
    base = _configured[0] if _configured else None
    if base is None and database_url is None:
        settings = load_settings()
        base = HousekeepingConfig(settings.database_url or "", settings.storage_dir)
    url = database_url or (base.database_url if base else "")
    if not url:
        raise RuntimeError("housekeeping: no database URL (set QT_DATABASE_URL)")
    storage = Path(storage_dir) if storage_dir is not None else (base.storage_dir if base else None)
    return HousekeepingConfig(url, storage)


# --- names ---------------------------------------------------------------------------------


def housekeeping_queue(prefix: str) -> str:
    """The rq queue of this deployment's housekeeping jobs."""
    return Keys(prefix).housekeeping_queue()


def _id_token(queue_name: str) -> str:
    return _UNSAFE_ID_CHARS.sub("_", queue_name)


def expiry_job_id(queue_name: str, checkpoint_id: str, suffix: str = "") -> str:
    """Deterministic per (deployment, checkpoint): scheduling twice replaces, never doubles.
    Starts with the queue name so every rq key of a deployment can be found by it."""
    digest = hashlib.sha256(checkpoint_id.encode()).hexdigest()[:32]
    return f"{_id_token(queue_name)}--expire-{digest}{suffix}"


def sweep_job_id(queue_name: str) -> str:
    return f"{_id_token(queue_name)}--sweep"


# --- scheduling ----------------------------------------------------------------------------


def schedule_checkpoint_expiry(
    redis: redis.Redis, prefix: str, checkpoint_id: str, directory: str, expires_at: float
) -> None:
    """Have the housekeeper expire `checkpoint_id` (files in `directory`) at `expires_at`
    (unix seconds). Scheduling the same checkpoint again moves its one job to the new time."""
    queue = Queue(housekeeping_queue(prefix), connection=redis)
    job_id = expiry_job_id(queue.name, checkpoint_id)
    _schedule(queue, job_id, expires_at, {"checkpoint_id": checkpoint_id, "directory": directory})


def _schedule(queue: Queue, job_id: str, at: float, kwargs: dict[str, Any]) -> None:
    # rq's scheduled registry keeps whole seconds and fires a job once floor(now) reaches its
    # score: rounding up keeps it from firing up to a second before the checkpoint expires.
    when = datetime.fromtimestamp(math.ceil(at), tz=UTC)
    with queue.connection.pipeline() as pipe:
        # A finished run under the same id leaves its hash with a result TTL, which HSET keeps:
        # drop it, or the new schedule could vanish before it fires.
        pipe.delete(Job.key_for(job_id))
        queue.enqueue_at(
            when,
            expire_checkpoint,
            kwargs=kwargs,
            job_id=job_id,
            pipeline=pipe,
            retry=_ON_ERROR,
            **_JOB_OPTIONS,
        )
        pipe.execute()


# --- the files -----------------------------------------------------------------------------


def _read_meta(directory: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # unreadable: not something to delete on a guess
        log.warning("checkpoint %s: unreadable %s (%s); leaving it", directory, META_FILE, err)
        return None
    return meta if isinstance(meta, dict) else None


def _is_expired(meta: dict[str, Any] | None, checkpoint_id: str, now: float) -> bool:
    if meta is None or meta.get("id") != checkpoint_id:
        return False
    expires_at = meta.get("expires_at")
    return isinstance(expires_at, int | float) and expires_at <= now


def _check_inside(directory: Path, storage_dir: Path | None) -> None:
    """Refuse to touch anything outside checkpoint storage (paths come from Redis and
    Postgres), and fail loudly if storage is not there (an unmounted volume must not read as
    'every checkpoint already deleted')."""
    if storage_dir is None:
        return
    root = storage_dir.resolve()
    if not root.is_dir():
        raise StorageUnavailableError(
            f"checkpoint storage {root} does not exist here; the housekeeper needs the same "
            "storage directory as the workers"
        )
    target = directory.resolve()
    if target == root or not target.is_relative_to(root):
        raise CheckpointPathError(f"{directory} is not inside checkpoint storage {root}")


def _is_due(meta: dict[str, Any] | None, checkpoint_id: str, now: float, force: bool) -> bool:
    """Whether to remove: always our checkpoint (its meta names it), and expired unless forced
    (a user's delete)."""
    if force:
        return meta is not None and meta.get("id") == checkpoint_id
    return _is_expired(meta, checkpoint_id, now)


def _remove_if_expired(
    checkpoint_id: str,
    directory: Path,
    now: float,
    storage_dir: Path | None,
    *,
    force: bool = False,
) -> tuple[_Disk, float | None]:
    """Remove `directory` if its meta says `checkpoint_id` expired by `now` (with `force`: if
    it is that checkpoint at all); the state on disk and, when kept, the meta's expires_at."""
    _check_inside(directory, storage_dir)
    if not directory.exists():
        return _Disk.ABSENT, None
    meta = _read_meta(directory)
    if not _is_due(meta, checkpoint_id, now, force):
        expires_at = meta.get("expires_at") if meta and meta.get("id") == checkpoint_id else None
        return _Disk.KEPT, expires_at if isinstance(expires_at, int | float) else None
    # Move it aside in one rename, so readers see the checkpoint or nothing, never half of it;
    # a hidden sibling name, like the workers' own temporary directories.
    trash = directory.with_name(f".{directory.name}-expired-{uuid.uuid4().hex[:8]}")
    try:
        directory.rename(trash)
    except FileNotFoundError:
        return _Disk.ABSENT, None
    if not _is_due(_read_meta(trash), checkpoint_id, now, force):
        # Saved again (or its TTL moved) between our read and the rename: put it back.
        trash.rename(directory)
        return _Disk.KEPT, None
    shutil.rmtree(trash)
    return _Disk.REMOVED, None


def set_meta_expiry(
    checkpoint_id: str, directory: Path, expires_at: float | None, storage_dir: Path | None
) -> bool:
    """Write a new expires_at (unix seconds, None: never) into the checkpoint's meta, which is
    what expiry obeys; False if the directory does not hold that checkpoint (any more)."""
    return _update_meta(checkpoint_id, directory, storage_dir, expires_at=expires_at)


def set_meta_public(
    checkpoint_id: str, directory: Path, public: bool, storage_dir: Path | None
) -> bool:
    """Mark the checkpoint published (readable by every tenant) or not in its meta, which is
    what workers obey; False if the directory does not hold that checkpoint (any more)."""
    return _update_meta(checkpoint_id, directory, storage_dir, public=public)


def _update_meta(
    checkpoint_id: str, directory: Path, storage_dir: Path | None, **changes: object
) -> bool:
    _check_inside(directory, storage_dir)
    meta = _read_meta(directory)
    if meta is None or meta.get("id") != checkpoint_id:
        return False
    meta.update(changes)
    # Replace the file in one rename: the housekeeper never reads half a meta. If the
    # directory is moved aside meanwhile, the write fails instead of landing in its trash.
    tmp = directory / f".{META_FILE}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, directory / META_FILE)
    except FileNotFoundError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def copy_checkpoint_files(
    source: Path, destination: Path, storage_dir: Path | None, **meta_changes: object
) -> int:
    """Copy a checkpoint directory (copy_weights): every file hard-linked where storage allows
    (named checkpoints are never rewritten in place, so the copy shares the bytes and outlives
    the source's removal), copied where it does not; its meta rewritten with `meta_changes`
    (the new run, tenant, id). Appears in one rename; a repeat replaces it. Returns bytes."""
    _check_inside(source, storage_dir)
    _check_inside(destination, storage_dir)
    meta = _read_meta(source)
    if meta is None:
        raise FileNotFoundError(source / META_FILE)
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.with_name(f".{destination.name}-copy-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        for item in source.iterdir():
            if item.name != META_FILE and item.is_file():
                _link_or_copy(item, tmp / item.name)
        (tmp / META_FILE).write_text(json.dumps({**meta, **meta_changes}, indent=2))
        size = sum(f.stat().st_size for f in tmp.iterdir())
        if destination.exists():  # a retried copy: the same files again
            shutil.rmtree(destination)
        tmp.rename(destination)
        return size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another device, or a file system without hard links
        shutil.copy2(source, target)


# --- the row -------------------------------------------------------------------------------


async def _mark_deleted(conn: AsyncConnection, checkpoint_id: str, *, only_if_due: bool) -> Outcome:
    """Set deleted_at once. `only_if_due`: the files were not seen expiring (already absent),
    so trust the row's own expires_at instead."""
    table = _CHECKPOINTS
    conditions = [table.c.id == checkpoint_id, table.c.deleted_at.is_(None)]
    if only_if_due:
        conditions.append(table.c.expires_at <= func.now())
    marked = await conn.execute(
        update(table).where(*conditions).values(deleted_at=func.now()).returning(table.c.id)
    )
    if marked.first() is not None:
        return Outcome.EXPIRED
    found = await conn.execute(select(table.c.deleted_at).where(table.c.id == checkpoint_id))
    row = found.first()
    if row is None:
        return Outcome.ROW_MISSING
    return Outcome.EXPIRED if row.deleted_at is not None else Outcome.KEPT


@dataclass(frozen=True)
class _Result:
    outcome: Outcome
    files_removed: bool
    meta_expires_at: float | None  # when kept: what the checkpoint's meta says


async def _expire(
    engine: AsyncEngine,
    checkpoint_id: str,
    directory: Path,
    storage_dir: Path | None,
    *,
    files_removed: bool,
    force: bool = False,
) -> _Result:
    # Off the event loop: the gateway runs this too, and an rmtree can take a while.
    disk, meta_expires_at = await asyncio.to_thread(
        _remove_if_expired, checkpoint_id, directory, time.time(), storage_dir, force=force
    )
    if disk is _Disk.KEPT and not force:
        return _Result(Outcome.KEPT, files_removed, meta_expires_at)
    if disk is _Disk.KEPT:  # forced, but the directory is not this checkpoint's: leave it
        log.warning(
            "checkpoint %s: %s does not hold it (no matching %s); files left in place",
            checkpoint_id,
            directory,
            META_FILE,
        )
    removed = files_removed or disk is _Disk.REMOVED
    async with engine.begin() as conn:
        # A user's delete marks the row whatever its expires_at says.
        outcome = await _mark_deleted(conn, checkpoint_id, only_if_due=not (removed or force))
    return _Result(outcome, removed, None)


async def change_checkpoint_ttl(
    sessions: async_sessionmaker[AsyncSession],
    settings: Settings,
    tenant_id: str,
    row: Checkpoint,
    ttl_seconds: int | None,
) -> bool:
    """Set (from now) or remove (None) a checkpoint's TTL: the meta file first, since it is
    what expiry obeys; then the row (listings); then the expiry job. A removed TTL leaves any
    job in place: it finds no expiry in the meta and does nothing. False if the checkpoint is
    gone meanwhile."""
    expires_at = time.time() + ttl_seconds if ttl_seconds is not None else None
    written = await asyncio.to_thread(
        set_meta_expiry, row.id, Path(row.path), expires_at, settings.storage_dir
    )
    when = datetime.fromtimestamp(expires_at, tz=UTC) if expires_at is not None else None
    if not written or not await queries.set_checkpoint_expiry(sessions, tenant_id, row.id, when):
        return False
    if expires_at is not None:

        def schedule() -> None:
            # rq speaks sync Redis; a TTL change is rare enough for a connection of its own.
            with redis.Redis.from_url(settings.redis_url or "") as client:
                schedule_checkpoint_expiry(
                    client, settings.key_prefix, row.id, row.path, expires_at
                )

        await asyncio.to_thread(schedule)
    return True


async def delete_checkpoint(
    engine: AsyncEngine, checkpoint_id: str, directory: Path, storage_dir: Path | None
) -> bool:
    """A user's delete (the REST DELETE): the same path as TTL expiry (storage checks, one
    rename aside, then deleted_at), only without waiting for the TTL. True if files were
    removed now. A scheduled expiry job for it later finds nothing to do."""
    result = await _expire(
        engine, checkpoint_id, directory, storage_dir, files_removed=False, force=True
    )
    return result.files_removed


async def _expire_once(
    config: HousekeepingConfig, checkpoint_id: str, directory: Path, files_removed: bool
) -> _Result:
    engine = make_engine(config.database_url)
    try:
        return await _expire(
            engine, checkpoint_id, directory, config.storage_dir, files_removed=files_removed
        )
    finally:
        await engine.dispose()


# --- the jobs ------------------------------------------------------------------------------


def expire_checkpoint(
    checkpoint_id: str,
    directory: str,
    database_url: str | None = None,
    *,
    attempt: int = 0,
    files_removed: bool = False,
    retry_delay_s: float = ROW_RETRY_DELAY_S,
    max_retries: int = ROW_RETRIES,
    storage_dir: str | None = None,
) -> str:
    """The rq job: remove the checkpoint's files if its meta says it expired, then mark its
    row deleted. Idempotent. `database_url` / `storage_dir` default to the housekeeper's."""
    config = _config(database_url, storage_dir)
    result = asyncio.run(_expire_once(config, checkpoint_id, Path(directory), files_removed))
    job = get_current_job()
    queue = Queue(job.origin, connection=job.connection) if job is not None else None
    kwargs: dict[str, Any] = {
        "checkpoint_id": checkpoint_id,
        "directory": directory,
        "database_url": database_url,
        "retry_delay_s": retry_delay_s,
        "max_retries": max_retries,
        "storage_dir": storage_dir,
    }
    if result.outcome is Outcome.KEPT and result.meta_expires_at is not None and job and queue:
        # Fired early, or the TTL moved: come back when the meta says (one job per time).
        at = math.ceil(result.meta_expires_at)
        if expiry_job_id(queue.name, checkpoint_id, f"-at{at}") == job.id:
            at += 1  # this very job, early by the scheduler's clock: never reuse a running id
        _schedule(queue, expiry_job_id(queue.name, checkpoint_id, f"-at{at}"), at, kwargs)
    elif result.outcome is Outcome.ROW_MISSING:
        if queue is not None and attempt < max_retries:
            # A new id per attempt: this job's own hash is rewritten (or deleted) when it ends.
            job_id = expiry_job_id(queue.name, checkpoint_id, f"-r{attempt + 1}")
            kwargs |= {"attempt": attempt + 1, "files_removed": result.files_removed}
            _schedule(queue, job_id, time.time() + retry_delay_s, kwargs)
        else:
            log.warning(
                "checkpoint %s: no row after %d tries; the sweep will mark it",
                checkpoint_id,
                attempt + 1,
            )
    log.info("checkpoint %s: %s", checkpoint_id, result.outcome)
    return str(result.outcome)


def _due_rows(after: tuple[datetime, str] | None, batch: int) -> Any:
    table = _CHECKPOINTS
    query = (
        select(table.c.id, table.c.path, table.c.expires_at)
        .where(table.c.expires_at < func.now(), table.c.deleted_at.is_(None))
        .order_by(table.c.expires_at, table.c.id)
        .limit(batch)
    )
    if after is not None:  # keyset paging: rows kept by their meta do not hide later ones
        query = query.where(tuple_(table.c.expires_at, table.c.id) > tuple_(*after))
    return query


async def _sweep(config: HousekeepingConfig, batch: int) -> dict[str, int]:
    counts = {outcome.value: 0 for outcome in Outcome} | {"refused": 0}
    engine = make_engine(config.database_url)
    try:
        after: tuple[datetime, str] | None = None
        while True:
            async with engine.connect() as conn:
                rows = (await conn.execute(_due_rows(after, batch))).all()
            for row in rows:
                try:
                    result = await _expire(
                        engine, row.id, Path(row.path), config.storage_dir, files_removed=False
                    )
                except CheckpointPathError as err:
                    log.error("checkpoint %s: %s; not touched", row.id, err)
                    counts["refused"] += 1
                    continue
                counts[result.outcome.value] += 1
            if len(rows) < batch:
                return counts
            after = (rows[-1].expires_at, rows[-1].id)
    finally:
        await engine.dispose()


def sweep_expired_checkpoints(
    database_url: str | None = None, *, storage_dir: str | None = None, batch: int = SWEEP_BATCH
) -> dict[str, int]:
    """Expire every checkpoint whose row is past expires_at and not yet deleted (jobs lost
    with a flushed Redis, or never scheduled); counts per outcome, plus 'refused'."""
    counts = asyncio.run(_sweep(_config(database_url, storage_dir), batch))
    log.info("sweep: %s", counts)
    return counts


# --- the process ---------------------------------------------------------------------------


def enqueue_sweep(queue: Queue, interval_s: float = SWEEP_INTERVAL_S) -> bool:
    """Queue one sweep unless one is already queued or running; True if queued."""
    try:
        # unique + result_ttl=0: the id is taken exactly while a sweep waits or runs, so a
        # slow sweep never piles up others behind it; a failed one blocks for one interval.
        queue.enqueue(
            sweep_expired_checkpoints,
            job_id=sweep_job_id(queue.name),
            unique=True,
            result_ttl=0,
            failure_ttl=max(1, int(interval_s)),
            job_timeout=3_600,
        )
    except DuplicateJobError:
        return False
    return True


class _SweepTicker(threading.Thread):
    """Queues a sweep at start and every interval. A thread in the housekeeper rather than
    an rq repeat/self-rescheduling job: a job chain lives in Redis and is lost exactly when
    the sweep is needed (Redis flushed); this restarts with the process. rq's cron needs a
    separate process."""

    def __init__(self, redis_url: str, queue_name: str, interval_s: float) -> None:
        super().__init__(name="sweep-ticker", daemon=True)
        self._redis = redis.Redis.from_url(redis_url)
        self._queue = Queue(queue_name, connection=self._redis)
        self._interval_s = interval_s
        self._stopping = threading.Event()

    def run(self) -> None:
        while True:
            try:
                enqueue_sweep(self._queue, self._interval_s)
            except redis.RedisError as err:  # the worker loop reports Redis trouble itself
                log.warning("could not queue a sweep: %s", err)
            if self._stopping.wait(self._interval_s):
                return

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)
        self._redis.close()


class _HousekeeperWorker(SimpleWorker):
    """A SimpleWorker (jobs run in this process: no fork per job) that also honours a stop
    signal which arrived before rq installed its own handlers."""

    early_stop: threading.Event

    def _install_signal_handlers(self) -> None:
        super()._install_signal_handlers()
        if self.early_stop.is_set():
            self._stop_requested = True  # the work loop checks it before each dequeue


def run_housekeeper(settings: Settings, *, sweep_interval_s: float = SWEEP_INTERVAL_S) -> int:
    """Serve the housekeeping queue (with rq's scheduler) until SIGTERM/SIGINT; exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not settings.redis_url or not settings.database_url:
        log.error("QT_REDIS_URL and QT_DATABASE_URL must be set (or use `queue-tinker up`)")
        return 2
    early_stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        early_stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    configure(settings.database_url, settings.storage_dir)
    connection = redis.Redis.from_url(settings.redis_url)
    queue = Queue(housekeeping_queue(settings.key_prefix), connection=connection)
    # The queue name in the worker's name too, so all rq keys of a deployment share it.
    worker = _HousekeeperWorker(
        [queue], connection=connection, name=f"{_id_token(queue.name)}--{uuid.uuid4().hex[:12]}"
    )
    worker.early_stop = early_stop
    ticker = _SweepTicker(settings.redis_url, queue.name, sweep_interval_s)
    log.info(
        "housekeeper on queue %s (storage %s, sweep every %.0f s)",
        queue.name,
        settings.storage_dir,
        sweep_interval_s,
    )
    die_with_us = _die_with_parent()
    if die_with_us is not None:
        # rq forks its scheduler from here; PDEATHSIG makes a `kill -9` of the housekeeper
        # take it along instead of leaving it running with the scheduler lock.
        os.register_at_fork(after_in_child=die_with_us)
    ticker.start()
    try:
        # with_scheduler: moves due enqueue_at jobs onto the queue (one scheduler per queue
        # holds rq's lock; others stand by).
        worker.work(with_scheduler=True, logging_level="INFO")
    finally:
        ticker.stop()
        connection.close()
    log.info("housekeeper stopped")
    return 0
