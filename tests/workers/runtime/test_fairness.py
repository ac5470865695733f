"""Fair scheduling across tenants: a tenant that floods the queue does not starve another.

A worker takes turns by tenant, then by each tenant's models (workers/runtime/worker.py
_next_runnable); offers go first to the tenant holding the fewest models (lua/take_offer.lua).
"""

from __future__ import annotations

import time
from pathlib import Path

import redis
from procs import running_workers
from redis.asyncio import Redis

from queue_tinker.client import ServiceClient
from queue_tinker.queue.dispatch.dispatcher import Dispatcher
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.settings import Settings
from queue_tinker.types import OpKind

BASE = "tiny"


async def test_an_offer_goes_to_the_tenant_holding_the_fewest_models(
    aredis: Redis, key_prefix: str
) -> None:
    """Five older offers of a tenant that already holds a model, one newer offer of a tenant
    that holds none: the newer one is taken first."""
    keys = Keys(key_prefix)
    jobs = JobQueue(aredis, keys, result_ttl_s=60)
    models = {
        "flood-0": "flood",
        **{f"flood-{i}": "flood" for i in range(1, 6)},
        "quiet-0": "quiet",
    }
    worker = Dispatcher(
        aredis, keys, worker_id="w", base_model=BASE, lease_ttl_ms=5_000, result_ttl_s=60
    )
    for model_id, tenant in models.items():
        await jobs.register_model(
            model_id, base_model=BASE, tenant_id=tenant, session_id=None, lora_config={}
        )
        await jobs.enqueue(model_id, OpKind.PING, b"", job_id=f"{model_id}-op")
        if model_id == "flood-0":
            assert await worker.take_offer() == "flood-0"
            assert await worker.claim("flood-0") is not None
    assert await worker.take_offer() == "quiet-0"
    assert await worker.take_offer() == "flood-1"  # then the oldest
    # A busy worker leaves a fresh offer of a tenant that holds a model to idle workers.
    assert await worker.take_offer(min_age_ms=60_000, unserved_min_age_ms=0) is None


def job_times(settings: Settings, job_ids: list[str]) -> list[tuple[float, float]]:
    """(queued_at, started_at) of each job, on the server's clock."""
    client = redis.Redis.from_url(settings.redis_url or "")
    keys = Keys(settings.key_prefix)
    try:
        with client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(keys.job(job_id), "queued_at", "started_at")
            rows = pipe.execute()
    finally:
        client.close()
    return [(float(q), float(s)) for q, s in rows]


def leased(settings: Settings, model_ids: list[str]) -> bool:
    client = redis.Redis.from_url(settings.redis_url or "")
    keys = Keys(settings.key_prefix)
    try:
        return all(client.exists(keys.model_lease(m)) for m in model_ids)
    finally:
        client.close()


def test_a_flooding_tenant_delays_another_tenants_op_by_at_most_one_round(
    settings: Settings, tmp_path: Path
) -> None:
    """One worker; tenant `flood` has 1,000 ops queued over 10 models; tenant `quiet` sends
    one op. Between its arrival and its start at most one scheduling round passes: the flood
    op in progress, plus one the worker picked while the op was on its way (per-model round
    robin would run one op of each of the 10 flood models first)."""
    flood_settings = settings.model_copy(update={"tenant": "flood"})
    quiet_settings = settings.model_copy(update={"tenant": "quiet"})
    with (
        running_workers(settings, 1, tmp_path),
        ServiceClient(flood_settings) as flood,
        ServiceClient(quiet_settings) as quiet,
    ):
        runs = [flood.create_lora_training_client(BASE, rank=4) for _ in range(10)]
        flood_ops = [run.ping(i, delay_ms=5) for i in range(100) for run in runs]
        deadline = time.monotonic() + 20
        while not leased(settings, [run.model_id for run in runs]):  # all 10 on the worker
            assert time.monotonic() < deadline, "the worker never took every flood model"
            time.sleep(0.05)
        quiet_run = quiet.create_lora_training_client(BASE, rank=4)  # claimed while busy
        quiet_op = quiet_run.ping("quiet")
        assert quiet_op.result(60)["data"] == "quiet"
        assert not flood_ops[-1].done(), "the flood ended before the quiet op: test too short"
        for future in flood_ops:
            future.result(120)
    [(arrived, started)] = job_times(settings, [quiet_op.request_id])
    flood_starts = [s for _, s in job_times(settings, [f.request_id for f in flood_ops])]
    overtaking = [s for s in flood_starts if arrived < s < started]
    assert len(overtaking) <= 2, f"{len(overtaking)} flood ops ran while the quiet op waited"
