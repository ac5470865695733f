"""Futures of results: woken by pub/sub, and a slow safety sweep that must not misfire."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from queue_tinker.errors import ResultExpiredError
from queue_tinker.queue.dispatch.dispatcher import Dispatcher, Outcome
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.queue.results.listener import ResultListener
from queue_tinker.types import JobStatus, OpKind


async def test_sweep_fails_only_confirmed_jobs_that_vanished(
    aredis: Redis, key_prefix: str
) -> None:
    """A future whose submit has not reached Redis yet survives the sweep; a submitted job
    that is gone from Redis fails with ResultExpiredError; a missed message is recovered."""
    keys = Keys(key_prefix)
    jobs = JobQueue(aredis, keys, result_ttl_s=60)
    listener = ResultListener(aredis, keys, jobs, sweep_interval_s=0.05)
    try:
        await jobs.register_model(
            "m", base_model="tiny", tenant_id="default", session_id=None, lora_config={}
        )
        await listener.watch("m")
        not_yet = listener.expect("j-slow-submit")
        vanished = listener.expect("j-vanished")
        listener.confirm("j-vanished")
        await asyncio.sleep(0.3)
        assert not not_yet.done()
        with pytest.raises(ResultExpiredError, match="j-vanished"):
            vanished.result()

        # The slow submit lands and its result is published while nobody listens to the
        # channel (as during a reconnect): the sweep still resolves it.
        await jobs.enqueue("m", OpKind.PING, b"", job_id="j-slow-submit")
        listener.confirm("j-slow-submit")
        await listener._pubsub.unsubscribe(keys.model_events("m"))
        worker = Dispatcher(
            aredis, keys, worker_id="w", base_model="tiny", lease_ttl_ms=5000, result_ttl_s=60
        )
        lease = await worker.claim("m")
        assert lease is not None
        ops, _, _ = await worker.read({"m": 0}, b"0-0", block_ms=100)
        await worker.publish_batch(
            [(lease, ops[0], Outcome(JobStatus.DONE, b"ok"), None)], started=False
        )
        outcome = await asyncio.wait_for(not_yet, timeout=2)
        assert outcome.result == b"ok"
    finally:
        await listener.close()
