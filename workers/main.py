"""`queue-tinker worker`: one process serving one base model until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

from queue_tinker.queue.connection import connect
from queue_tinker.queue.dispatch import Dispatcher
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.records import RecordLog
from queue_tinker.queue.registry import WorkerRegistry
from queue_tinker.recorder import RecorderThread
from queue_tinker.settings import Settings
from workers.engine import BuiltinEngine, Engine
from workers.worker import Worker, WorkerConfig

log = logging.getLogger("queue_tinker.worker")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_engine(base_model: str, device: str) -> Engine:
    return BuiltinEngine()


async def serve_worker(settings: Settings, base_model: str, device: str) -> None:
    if not settings.redis_url or not settings.database_url:
        raise SystemExit("QT_REDIS_URL and QT_DATABASE_URL must be set (or use `queue-tinker up`)")
    keys = Keys(settings.key_prefix)
    redis = connect(settings.redis_url)
    config = WorkerConfig(
        base_model=base_model, device=resolve_device(device), lease_ttl_ms=settings.lease_ttl_ms,
        heartbeat_ms=settings.heartbeat_ms, linger_ms=settings.linger_ms,
    )
    records = RecordLog(redis, keys)
    dispatcher = Dispatcher(
        redis, keys, worker_id=config.worker_id, base_model=base_model,
        lease_ttl_ms=settings.lease_ttl_ms, result_ttl_s=settings.result_ttl_s,
    )
    worker = Worker(config, build_engine(base_model, config.device), dispatcher,
                    WorkerRegistry(redis, keys), records)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    log.info("worker %s serving %s on %s", worker.id, base_model, config.device)
    await records.ensure_group()
    recorder = RecorderThread(settings.redis_url, settings.database_url, keys, worker.id)
    recorder.start()
    try:
        await worker.run()
    finally:
        log.info("worker %s: models released; flushing the record", worker.id)
        await asyncio.to_thread(recorder.stop)
        await redis.aclose()
        log.info("worker %s stopped", worker.id)


def run_worker(settings: Settings, *, base_model: str, device: str) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve_worker(settings, base_model, device))
    return 0
