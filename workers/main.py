"""`queue-tinker worker`: one process serving one base model until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING

import redis

from queue_tinker.errors import (
    RedisUnavailableError,
    StorageUnavailableError,
    WorkerFitError,
    WorkerGroupError,
)
from queue_tinker.queue.connection import Reconnector, connect
from queue_tinker.queue.dispatch.dispatcher import Dispatcher
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import RecordLog
from queue_tinker.services.recorder import RecorderThread
from queue_tinker.settings import Settings
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.storage.configured import open_store
from queue_tinker.types import CheckpointRecord
from queue_tinker.types.service.records import Record
from queue_tinker.workers.executor.queue_only import QueueOnlyEngine
from queue_tinker.workers.interface import Engine
from queue_tinker.workers.runtime.worker import Worker, WorkerConfig

if TYPE_CHECKING:  # torch and friends load only when a LoRA engine is built
    from queue_tinker.workers.executor.lora import LoraExecutor
    from queue_tinker.workers.model.tensor_parallel import Shards
    from queue_tinker.workers.sampling.sessions import QuantumOver

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
    shards: Shards | None = None,
    quantum_over: QuantumOver | None = None,
    store: CheckpointStore | None = None,
) -> LoraExecutor:
    """The LoRA engine with the deployment's settings; a worker group's rank passes its shards,
    rank 0's decode quanta and (ranks 1..N-1) storage that writes nothing."""
    from queue_tinker.types.requests.request_limits import RequestLimits
    from queue_tinker.workers.executor.lora import LoraExecutor  # torch and friends load only here
    from queue_tinker.workers.training.model_pass import PassPlan

    return LoraExecutor(
        base_model,
        device,
        store or open_store(settings),
        settings.models_dir,
        max_resident=settings.max_resident_adapters,
        snapshot_every=settings.snapshot_every_steps,
        max_batch_sequences=settings.sample_batch_sequences,
        sample_cache_tokens=settings.sample_cache_tokens,
        request_limits=RequestLimits.of(settings),
        cross_adapter_batch=settings.cross_adapter_batch,
        train_batch_tokens=settings.train_batch_tokens,
        dtype=settings.dtype,
        lora_matmul_dtype=settings.lora_matmul_dtype,
        liger_kernels=settings.liger_kernels,
        decode_step=settings.decode_step,
        plan=PassPlan(
            activation_checkpointing=settings.activation_checkpointing,
            checkpoint_min_tokens=settings.activation_checkpointing_tokens,
        ),
        shards=shards,
        quantum_over=quantum_over,
    )


def expiry_scheduler(settings: Settings) -> Callable[[list[Record]], Awaitable[None]]:
    """Hands each new checkpoint with a TTL to the housekeeper (rq), which deletes it then."""
    from queue_tinker.queue.control.expiry_jobs import schedule_checkpoint_expiry

    sync_redis = redis.Redis.from_url(settings.redis_url or "")

    def schedule(records: list[Record]) -> None:
        for record in records:
            if isinstance(record, CheckpointRecord) and record.expires_at is not None:
                schedule_checkpoint_expiry(
                    sync_redis, settings.key_prefix, record.id, record.path, record.expires_at
                )

    async def on_records(records: list[Record]) -> None:
        await asyncio.to_thread(schedule, records)

    return on_records


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
    keys = Keys(settings.key_prefix)
    redis = connect(settings.redis_url)
    config = WorkerConfig(
        base_model=base_model,
        device=resolve_device(device),
        lease_ttl_ms=settings.lease_ttl_ms,
        heartbeat_ms=settings.heartbeat_ms,
        linger_ms=settings.linger_ms,
    )
    records = RecordLog(redis, keys)
    dispatcher = Dispatcher(
        redis,
        keys,
        worker_id=config.worker_id,
        base_model=base_model,
        lease_ttl_ms=settings.lease_ttl_ms,
        result_ttl_s=settings.result_ttl_s,
        max_attempts=settings.max_op_attempts,
    )
    log.info("loading %s on %s (%s engine)", base_model, config.device, engine)
    try:
        # A bucket that is not there or credentials it refuses stop the worker here, not at
        # the first save of some user's run.
        await asyncio.to_thread(lambda: open_store(settings).check())
        built = await asyncio.to_thread(
            build or partial(build_engine, settings, engine, base_model, config.device)
        )
    except (WorkerFitError, WorkerGroupError, StorageUnavailableError) as error:
        # Nothing is loaded yet: the worker refuses to start, saying what to change.
        await redis.aclose()
        raise SystemExit(f"worker refuses to start: {error.message}") from None
    # Redis away (a restart, or not up yet): the worker waits for it and carries on.
    reconnect = Reconnector(redis, config.worker_id)
    worker = Worker(
        config,
        built,
        dispatcher,
        WorkerRegistry(redis, keys),
        records,
        on_records=expiry_scheduler(settings),
        reconnect=reconnect,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    log.info("worker %s serving %s on %s", worker.id, base_model, config.device)
    recorder = RecorderThread(settings.redis_url, settings.database_url, keys, worker.id)
    try:
        await reconnect.call(records.ensure_group)
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
        await redis.aclose()
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
