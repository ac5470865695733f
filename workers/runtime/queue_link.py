"""The worker's link to the queue: its one Redis connection, and the parts of queue/ the runtime
reaches Redis through over it (the dispatcher, the registry, the records log, inflight
targets, the housekeeper's expiry jobs, the reconnector that rides out an outage).

No other module of workers/ opens a Redis connection or imports redis (an import contract in
pyproject.toml holds it): everything the worker says to Redis goes through what is built here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from queue_tinker.queue.connection import RedisClient, connect
from queue_tinker.queue.control.expiry_jobs import ExpiryScheduler
from queue_tinker.queue.dispatch.dispatcher import Dispatcher
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import RecordLog
from queue_tinker.queue.ops.inflight import InflightWeights
from queue_tinker.queue.outage import Reconnector, describe, is_redis_error
from queue_tinker.settings import Settings
from queue_tinker.workers.runtime.presence import Identity

log = logging.getLogger(__name__)


@dataclass
class QueueLink:
    redis: RedisClient
    keys: Keys
    dispatcher: Dispatcher
    registry: WorkerRegistry
    records: RecordLog
    inflight: InflightWeights  # reads only: the TTL is the publisher's (clients and gateways)
    reconnect: Reconnector
    expiry: ExpiryScheduler

    @classmethod
    def open(cls, settings: Settings, identity: Identity) -> QueueLink:
        """The worker's connection to the deployment's Redis (QT_REDIS_URL) and the parts over
        it, for the worker `identity`."""
        if not settings.redis_url:
            raise ValueError("QT_REDIS_URL must be set")
        keys = Keys(settings.key_prefix)
        redis = connect(settings.redis_url)
        dispatcher = Dispatcher(
            redis,
            keys,
            worker_id=identity.worker_id,
            base_model=identity.base_model,
            lease_ttl_ms=settings.lease_ttl_ms,
            result_ttl_s=settings.result_ttl_s,
            max_attempts=settings.max_op_attempts,
        )
        return cls(
            redis=redis,
            keys=keys,
            dispatcher=dispatcher,
            registry=WorkerRegistry(redis, keys),
            records=RecordLog(redis, keys),
            inflight=InflightWeights(redis, keys, dispatcher.scripts, ttl_s=0),
            reconnect=Reconnector(redis, identity.worker_id),
            expiry=ExpiryScheduler(settings.redis_url, settings.key_prefix),
        )

    async def close(self) -> None:
        await self.reconnect.close()
        self.expiry.close()
        await self.redis.aclose()

    @contextlib.asynccontextmanager
    async def loading(self, identity: Identity, heartbeat_ms: int) -> AsyncIterator[None]:
        """While the body loads the base model, say so each heartbeat (WorkerRegistry.loading):
        clients waiting on that base model are told a worker is on its way and for how long,
        which is what a cold start (a scaler's first worker) looks like to them. Redis away
        costs the message, not the load."""

        stopping = asyncio.Event()

        async def beat() -> None:
            while not stopping.is_set():
                try:
                    await self.registry.loading(
                        identity.worker_id, identity.base_model, identity.started_at * 1000
                    )
                except Exception as err:
                    if not is_redis_error(err):
                        raise
                    log.info("cannot say the worker is loading: %s", describe(err))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), heartbeat_ms / 1000)

        # Stopped by an event, not cancelled: redis-py can swallow a cancellation that lands
        # mid-command, and the beat would go on for ever.
        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            stopping.set()
            await task
            with contextlib.suppress(Exception):  # stale entries drop out by themselves
                await self.registry.loaded(identity.worker_id)
