"""A cold start told to the waiting: while a worker loads its base model (before it registers),
an op queued on that base model is `paused_capacity` with a reason saying a worker has been
loading it for so long; once it serves, or dies while loading, that is no longer said."""

from __future__ import annotations

import asyncio
import time

import pytest

from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.results.state import model_state
from queue_tinker.settings import Settings
from queue_tinker.types import QueueState
from queue_tinker.workers.runtime.presence import Identity
from queue_tinker.workers.runtime.queue_link import QueueLink

MAX_AGE_MS = 600


async def state_of(link: QueueLink) -> tuple[QueueState, str | None]:
    """The state of a model on `tiny`, which no live worker serves, told from the registry."""
    served = await link.registry.base_models(MAX_AGE_MS)
    loading = await link.registry.loading_since(MAX_AGE_MS)
    return model_state({b"base_model": b"tiny"}, served, loading)


@pytest.mark.timeout(30)
async def test_a_loading_worker_is_told_to_those_waiting_on_its_base_model(
    settings: Settings,
) -> None:
    identity = Identity("w-loading", "tiny", "cpu", started_at=time.time() - 7)
    link = QueueLink.open(settings, identity)
    try:
        unserved = "no live worker serves base model tiny"
        assert await state_of(link) == (QueueState.PAUSED_CAPACITY, unserved)
        async with link.loading(identity, heartbeat_ms=100):
            await asyncio.sleep(0.3)  # beats more than once; 7.3 s after the start
            state, reason = await state_of(link)
            assert state == QueueState.PAUSED_CAPACITY
            assert reason == f"{unserved} yet: a worker has been loading it for 7 s"
        assert await state_of(link) == (QueueState.PAUSED_CAPACITY, unserved)
        # A load done before the first beat reached Redis ends there too (it once hung: a
        # cancelled beat swallowed its cancellation mid-command).
        for i in range(40):
            async with asyncio.timeout(5), link.loading(identity, heartbeat_ms=100):
                await asyncio.sleep(i * 0.0001)  # ends before, during, after the first beat
        assert await state_of(link) == (QueueState.PAUSED_CAPACITY, unserved)
    finally:
        await link.close()


async def test_a_worker_that_died_while_loading_drops_out(settings: Settings) -> None:
    keys = Keys(settings.key_prefix)
    link = QueueLink.open(settings, Identity("w-any", "tiny", "cpu", time.time()))
    try:
        registry = WorkerRegistry(link.redis, keys)
        await registry.loading("w-dead", "tiny", time.time() * 1000)
        assert list(await registry.loading_since(MAX_AGE_MS)) == ["tiny"]
        await asyncio.sleep(MAX_AGE_MS / 1000 + 0.1)
        assert await registry.loading_since(MAX_AGE_MS) == {}
        assert not await link.redis.hexists(keys.workers_loading(), "w-dead")
    finally:
        await link.close()
