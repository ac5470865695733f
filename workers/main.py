"""`queue-tinker worker`: one process serving one base model until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from queue_tinker.errors import (
    RedisUnavailableError,
    StorageUnavailableError,
    WorkerFitError,
    WorkerGroupError,
)
from queue_tinker.health import HealthFile
from queue_tinker.services.recorder import RecorderThread
from queue_tinker.settings import Settings
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.storage.configured import open_store
from queue_tinker.workers.executor.queue_only import QueueOnlyEngine
from queue_tinker.workers.interface import Engine
from queue_tinker.workers.runtime.presence import Identity
from queue_tinker.workers.runtime.queue_link import QueueLink
from queue_tinker.workers.runtime.worker import Worker, new_worker_id

if TYPE_CHECKING:  # torch and friends load only when a LoRA engine is built
    from queue_tinker.workers.executor.lora import GroupRank, LoraExecutor

log = logging.getLogger("queue_tinker.worker")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


ENGINES = ("lora", "queue-only")


def build_engine(settings: Settings, engine: str, base_model: str, device: str) -> Engine:
    if engine == "queue-only":
        return QueueOnlyEngine().engine()
    return lora_executor(settings, base_model, device).engine()


def lora_executor(
    settings: Settings,
    base_model: str,
    device: str,
    group: GroupRank | None = None,
    store: CheckpointStore | None = None,
) -> LoraExecutor:
    """The LoRA engine with the deployment's settings, handed over whole; a worker group's
    rank passes its place in the group and (ranks 1..N-1) storage that writes nothing."""
    from queue_tinker.workers.executor.lora import LoraExecutor  # torch and friends load only here

    store = store or open_store(settings)
    return LoraExecutor(base_model, device, store, settings.models_dir, settings, group)


async def serve_worker(
    settings: Settings,
    base_model: str,
    device: str,
    engine: str,
    build: Callable[[], Engine] | None = None,
) -> None:
    """Serve until SIGTERM; `build` makes the engine instead of `engine` (a worker group's
    rank 0 passes its leader engine)."""
    if not settings.redis_url or not settings.database_url:
        raise SystemExit("QT_REDIS_URL and QT_DATABASE_URL must be set (or use `queue-tinker up`)")
    HealthFile(settings.health_file).clear()  # touched again by the first heartbeat
    identity = Identity(new_worker_id(), base_model, resolve_device(device), time.time())
    link = QueueLink.open(settings, identity)
    log.info("loading %s on %s (%s engine)", base_model, identity.device, engine)
    try:
        # A bucket that is not there or credentials it refuses stop the worker here, not at
        # the first save of some user's run.
        async with link.loading(identity, settings.heartbeat_ms):
            await asyncio.to_thread(lambda: open_store(settings).check())
            built = await asyncio.to_thread(
                build or partial(build_engine, settings, engine, base_model, identity.device)
            )
    except (WorkerFitError, WorkerGroupError, StorageUnavailableError) as error:
        # Nothing is loaded yet: the worker refuses to start, saying what to change.
        await link.close()
        raise SystemExit(f"worker refuses to start: {error.message}") from None
    # Redis away (a restart, or not up yet): the worker waits for it and carries on.
    worker = Worker(settings, identity, built, link)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    log.info(
        "worker %s serving %s on %s, %.1f s after it started",
        worker.id,
        base_model,
        identity.device,
        time.time() - identity.started_at,
    )
    recorder = RecorderThread(settings, worker.id)
    try:
        await link.reconnect.call(link.records.ensure_group)
        recorder.start()
        try:
            await worker.run()
        finally:
            log.info("worker %s: models released; flushing the record", worker.id)
            await asyncio.to_thread(recorder.stop)
    except* RedisUnavailableError as group:
        # Only a stopping worker gives up on Redis: it could not hand its models back, and
        # their leases lapse by themselves.
        raise SystemExit(f"worker {worker.id}: {group.exceptions[0]}") from None
    finally:
        await link.close()
        log.info("worker %s stopped", worker.id)


def run_worker(
    settings: Settings,
    *,
    base_model: str,
    device: str,
    engine: str = "lora",
    build: Callable[[], Engine] | None = None,
) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve_worker(settings, base_model, device, engine, build))
    return 0
