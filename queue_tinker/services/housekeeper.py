"""Housekeeping as rq jobs: checkpoint TTL expiry, run by `queue-tinker housekeeper`.

A checkpoint saved with a TTL gets an rq job scheduled for its expiry time
(`schedule_checkpoint_expiry`, called by the worker that wrote it). When the job fires it reads
the checkpoint's own `qt_meta.json`, which is the source of truth: only if that says the
checkpoint has expired are the files removed, so a job that fires early, or for a checkpoint
saved again since, does no harm. Then the `checkpoints` row gets `deleted_at`. The recorder
writes rows behind the queue, so a row that is not there yet is tried again a few seconds later.
A periodic sweep over Postgres catches whatever a lost job (Redis flushed, housekeeper down) left
behind. The files and the row are
store/checkpoints.py's (a user's delete and a TTL change through the gateway go through the same
code there); the job names and their scheduling are queue/control/expiry_jobs.py's.

The jobs are synchronous (rq jobs are); their database work goes through the asyncpg engine
under `asyncio.run`, so no second Postgres driver is needed. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from rq import Queue, SimpleWorker, get_current_job
from rq.exceptions import DuplicateJobError

from queue_tinker.errors import CheckpointPathError
from queue_tinker.health import HealthFile
from queue_tinker.local.processes import die_with_parent
from queue_tinker.queue.connection import SyncRedisClient, connect_sync
from queue_tinker.queue.control.expiry_jobs import (
    expiry_job_id,
    housekeeping_queue,
    id_token,
    schedule_job,
    sweep_job_id,
)
from queue_tinker.queue.outage import is_redis_error
from queue_tinker.settings import Settings, load_settings
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.storage.configured import open_store
from queue_tinker.store import checkpoints
from queue_tinker.store.checkpoint_queries import due_checkpoints
from queue_tinker.store.checkpoints import ExpiryOutcome, ExpiryResult, expire
from queue_tinker.store.db import make_engine, session_factory

log = logging.getLogger("queue_tinker.services.housekeeper")

ROW_RETRY_DELAY_S = 3.0  # the recorder lags ~1 s; a few tries cover a short Postgres hiccup too
ROW_RETRIES = 10
EXPIRY_SWEEP_INTERVAL_S = 60.0
# How long the scheduler process gets to stop on SIGTERM before SIGKILL (stop_scheduler).
SCHEDULER_STOP_S = 0.1
SWEEP_BATCH = 500


@dataclass(frozen=True)
class HousekeepingConfig:
    """What the jobs need from the process running them (never carried in Redis: the
    database URL holds credentials)."""

    database_url: str
    storage: str  # QT_STORAGE: a directory or s3://bucket/prefix; nothing outside is deleted

    def store(self) -> CheckpointStore:
        return open_store(load_settings(), self.storage)


_configured: list[HousekeepingConfig] = []  # set once by the housekeeper process (or a test)


def configure(database_url: str, storage: Path | str) -> None:
    """Set the database and storage that jobs run in this process use."""
    _configured[:] = [HousekeepingConfig(database_url, str(storage))]


def reset_configuration() -> None:
    _configured.clear()


def _config(database_url: str | None, storage_dir: str | Path | None) -> HousekeepingConfig:
    """Explicit arguments win, then configure(), then QT_* settings (a plain `rq worker`)."""
    base = _configured[0] if _configured else None
    if base is None and (database_url is None or storage_dir is None):
        settings = load_settings()
        base = HousekeepingConfig(settings.database_url or "", settings.storage_location)
    url = database_url or (base.database_url if base else "")
    if not url:
        raise RuntimeError("housekeeping: no database URL (set QT_DATABASE_URL)")
    storage = str(storage_dir) if storage_dir is not None else (base.storage if base else "")
    return HousekeepingConfig(url, storage)


async def _expire_once(
    config: HousekeepingConfig, checkpoint_id: str, location: str, files_removed: bool
) -> ExpiryResult:
    engine = make_engine(config.database_url)
    try:
        return await expire(
            engine, checkpoint_id, location, config.store(), files_removed=files_removed
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
    result = asyncio.run(_expire_once(config, checkpoint_id, directory, files_removed))
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
    if (
        result.outcome is ExpiryOutcome.KEPT
        and result.meta_expires_at is not None
        and job
        and queue
    ):
        # Fired early, or the TTL moved: come back when the meta says (one job per time).
        at = math.ceil(result.meta_expires_at)
        if expiry_job_id(queue.name, checkpoint_id, f"-at{at}") == job.id:
            at += 1  # this very job, early by the scheduler's clock: never reuse a running id
        schedule_job(queue, expiry_job_id(queue.name, checkpoint_id, f"-at{at}"), at, kwargs)
    elif result.outcome is ExpiryOutcome.ROW_MISSING:
        if queue is not None and attempt < max_retries:
            # A new id per attempt: this job's own hash is rewritten (or deleted) when it ends.
            job_id = expiry_job_id(queue.name, checkpoint_id, f"-r{attempt + 1}")
            kwargs |= {"attempt": attempt + 1, "files_removed": result.files_removed}
            schedule_job(queue, job_id, time.time() + retry_delay_s, kwargs)
        else:
            log.warning(
                "checkpoint %s: no row after %d tries; the sweep will mark it",
                checkpoint_id,
                attempt + 1,
            )
    log.info("checkpoint %s: %s", checkpoint_id, result.outcome)
    return str(result.outcome)


def delete_checkpoint_now(checkpoint_id: str, directory: str) -> bool:
    """The rq job behind a Python client's delete (it writes no Postgres itself): the files
    removed and the row marked, as the gateway's DELETE does. True if files were removed now."""
    config = _config(None, None)

    async def delete() -> bool:
        engine = make_engine(config.database_url)
        try:
            return await checkpoints.delete_checkpoint(
                engine, checkpoint_id, directory, config.store()
            )
        finally:
            await engine.dispose()

    removed = asyncio.run(delete())
    log.info("checkpoint %s: deleted (files %s)", checkpoint_id, "removed" if removed else "gone")
    return removed


def change_checkpoint_ttl(
    tenant_id: str, checkpoint_id: str, directory: str, expires_at: float | None
) -> bool:
    """The rq job behind a Python client's TTL change: the meta, then the row, then the expiry
    job scheduled, as the gateway's PUT .../ttl does. False if the checkpoint is gone."""
    config = _config(None, None)

    async def change() -> bool:
        engine = make_engine(config.database_url)
        try:
            return await checkpoints.set_checkpoint_ttl(
                session_factory(engine),
                config.store(),
                tenant_id,
                checkpoint_id,
                directory,
                expires_at,
            )
        finally:
            await engine.dispose()

    changed = asyncio.run(change())
    job = get_current_job()
    if changed and expires_at is not None and job is not None:
        queue = Queue(job.origin, connection=job.connection)
        schedule_job(
            queue,
            expiry_job_id(queue.name, checkpoint_id),
            expires_at,
            {"checkpoint_id": checkpoint_id, "directory": directory},
        )
    return changed


async def _sweep(config: HousekeepingConfig, batch: int) -> dict[str, int]:
    counts = {outcome.value: 0 for outcome in ExpiryOutcome} | {"refused": 0}
    engine = make_engine(config.database_url)
    store = config.store()
    try:
        after: tuple[datetime, str] | None = None
        while True:
            async with engine.connect() as conn:
                rows = await due_checkpoints(conn, after, batch)
            for row in rows:
                try:
                    result = await expire(engine, row.id, row.path, store, files_removed=False)
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


def enqueue_sweep(queue: Queue, interval_s: float = EXPIRY_SWEEP_INTERVAL_S) -> bool:
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


class _Ticker(threading.Thread):
    """Runs `tick` on a Redis client of its own at start and every interval until stopped; a
    Redis error costs that tick only (the worker loop reports Redis trouble itself).

    Two run in the housekeeper. The sweep ticker queues a sweep: a thread rather than an rq
    repeat/self-rescheduling job, since a job chain lives in Redis and is lost exactly when the
    sweep is needed (Redis flushed); this restarts with the process (rq's cron needs a separate
    process). The health ticker touches QT_HEALTH_FILE while Redis answers a PING: rq's loop
    beats only between blocking dequeues (every 405 s idle) and not at all while a job runs in
    this process (a sweep may take minutes)."""

    def __init__(
        self,
        name: str,
        redis_url: str,
        interval_s: float,
        tick: Callable[[SyncRedisClient], object],
        failed: str | None = None,
    ) -> None:
        """`failed`: what a tick that met a Redis error logs as a warning (None: nothing)."""
        super().__init__(name=name, daemon=True)
        self._redis = connect_sync(redis_url)
        self._interval_s = interval_s
        self._tick = tick
        self._failed = failed
        self._stopping = threading.Event()

    def run(self) -> None:
        while True:
            try:
                self._tick(self._redis)
            except Exception as err:
                if not is_redis_error(err):
                    raise
                if self._failed is not None:
                    log.warning("%s: %s", self._failed, err)
            if self._stopping.wait(self._interval_s):
                return

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)
        self._redis.close()


def _sweep_ticker(redis_url: str, queue_name: str, interval_s: float) -> _Ticker:
    def tick(client: SyncRedisClient) -> None:
        enqueue_sweep(Queue(queue_name, connection=client), interval_s)

    return _Ticker("sweep-ticker", redis_url, interval_s, tick, "could not queue a sweep")


def _health_ticker(redis_url: str, health: HealthFile, interval_s: float) -> _Ticker:
    def tick(client: SyncRedisClient) -> None:
        client.ping()
        health.touch()

    return _Ticker("health-ticker", redis_url, interval_s, tick)


class _HousekeeperWorker(SimpleWorker):
    """A SimpleWorker (jobs run in this process: no fork per job) that also honours a stop
    signal which arrived before rq installed its own handlers."""

    early_stop: threading.Event

    def subscribe(self) -> None:
        """No pubsub channel: it carries rq's remote commands (`rq` CLI's shutdown, kill-horse),
        which nothing here sends, and its thread's exit cost a stop up to 1 s more (rq joins
        it with a 1 s timeout while it waits 60 s for a message)."""

    def _install_signal_handlers(self) -> None:
        super()._install_signal_handlers()
        if self.early_stop.is_set():
            self._stop_requested = True  # the work loop checks it before each dequeue

    def stop_scheduler(self) -> None:
        """Stop the scheduler process at once. rq's own sends it SIGTERM and waits for it,
        which it notices only after its 1 s sleep between heartbeats: up to 1 s of every stop
        (a `queue-tinker up` stopped in 2.5 s against its 2 s). Here it gets SCHEDULER_STOP_S,
        then SIGKILL, and this process releases the scheduler's locks: they are its own,
        acquired here before the fork, so the next housekeeper takes over without waiting
        for them to expire. Its moves of due jobs onto the queue are transactions: a kill
        leaves each done or not."""
        process = self.scheduler._process if self.scheduler is not None else None
        if process is None or process.pid is None:
            return
        with contextlib.suppress(OSError):
            os.kill(process.pid, signal.SIGTERM)
        process.join(SCHEDULER_STOP_S)
        if process.is_alive():
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGKILL)
            process.join()
            assert self.scheduler is not None
            self.scheduler.release_locks()
            self.scheduler.register_death()


def run_housekeeper(
    settings: Settings, *, sweep_interval_s: float = EXPIRY_SWEEP_INTERVAL_S
) -> int:
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
    configure(settings.database_url, settings.storage_location)
    connection = connect_sync(settings.redis_url)
    queue = Queue(housekeeping_queue(settings.key_prefix), connection=connection)
    # The queue name in the worker's name too, so all rq keys of a deployment share it.
    worker = _HousekeeperWorker(
        [queue], connection=connection, name=f"{id_token(queue.name)}--{uuid.uuid4().hex[:12]}"
    )
    worker.early_stop = early_stop
    ticker = _sweep_ticker(settings.redis_url, queue.name, sweep_interval_s)
    health = HealthFile(settings.health_file)
    health.clear()  # touched again once Redis answers
    health_ticker = _health_ticker(settings.redis_url, health, settings.heartbeat_ms / 1000)
    log.info(
        "housekeeper on queue %s (storage %s, sweep every %.0f s)",
        queue.name,
        settings.storage_location,
        sweep_interval_s,
    )
    die_with_us = die_with_parent()
    if die_with_us is not None:
        # rq forks its scheduler from here; PDEATHSIG makes a `kill -9` of the housekeeper
        # take it along instead of leaving it running with the scheduler lock.
        os.register_at_fork(after_in_child=die_with_us)
    ticker.start()
    health_ticker.start()
    try:
        # with_scheduler: moves due enqueue_at jobs onto the queue (one scheduler per queue
        # holds rq's lock; others stand by).
        worker.work(with_scheduler=True, logging_level="INFO")
    finally:
        health_ticker.stop()
        ticker.stop()
        connection.close()
    log.info("housekeeper stopped")
    return 0
