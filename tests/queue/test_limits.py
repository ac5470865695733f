"""Per-tenant limits, enforced in Redis by the scripts that start ops and lease models: an op
over a limit waits in its queue (never fails for it) and its model reports
`paused_rate_limit` with the reason; the client tells the caller, debounced."""

from __future__ import annotations

import logging
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis
from procs import running_workers
from redis.asyncio import Redis

from queue_tinker.client import ServiceClient
from queue_tinker.client.queue_state import QueueStateChange, QueueStateLogger
from queue_tinker.errors import UserInputError
from queue_tinker.queue.control.limits import Limits, clear_limits, read_limits, set_limits
from queue_tinker.queue.dispatch.dispatcher import Dispatcher, Outcome
from queue_tinker.queue.dispatch.registry import WorkerRegistry
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.overview import queue_overview
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.queue.results.state import queue_state
from queue_tinker.settings import Settings
from queue_tinker.types import JobStatus, OpKind, QueueState, codec

BASE = "tiny"

# The client's debounced queue-state warnings; other loggers (an SDK client another test left
# running, say) may warn meanwhile and are not what these tests count.
QUEUE_STATE_LOGGER = "queue_tinker.queue_state"


def sync_redis(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url or "")


def set_tenant_limits(settings: Settings, tenant: str, **limits: Any) -> None:
    import asyncio

    from queue_tinker.queue.connection import connect

    async def go() -> None:
        client = connect(settings.redis_url or "")
        try:
            await set_limits(client, Keys(settings.key_prefix), tenant, **limits)
        finally:
            await client.aclose()

    asyncio.run(go())


def timings(settings: Settings, job_ids: list[str]) -> list[tuple[float, float]]:
    """(started_at, finished_at) of each job, server clock."""
    client = sync_redis(settings)
    keys = Keys(settings.key_prefix)
    try:
        rows = [client.hmget(keys.job(j), "started_at", "finished_at") for j in job_ids]
    finally:
        client.close()
    return [(float(s), float(f)) for s, f in rows]


def job_field(settings: Settings, job_id: str, field: str) -> str:
    client = sync_redis(settings)
    try:
        return (client.hget(Keys(settings.key_prefix).job(job_id), field) or b"").decode()
    finally:
        client.close()


def wait_until_running(settings: Settings, job_id: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while job_field(settings, job_id, "status") != "running":
        assert time.monotonic() < deadline, f"{job_id} never started"
        time.sleep(0.02)


def job_of(settings: Settings, model_id: str, kind: str) -> str:
    """The id of the model's job of this kind (found by scanning the test's job hashes)."""
    client = sync_redis(settings)
    try:
        for key in client.scan_iter(match=Keys(settings.key_prefix).job("*"), count=1000):
            fields = client.hmget(key, "model_id", "kind", "id")
            if fields[0] == model_id.encode() and fields[1] == kind.encode():
                return fields[2].decode()  # type: ignore[union-attr]
    finally:
        client.close()
    raise AssertionError(f"no {kind} job of {model_id}")


class Recorder:
    """An observer that keeps every queue-state change it is told about."""

    def __init__(self) -> None:
        self.changes: list[QueueStateChange] = []

    def __call__(self, change: QueueStateChange) -> None:
        self.changes.append(change)

    def reasons(self, state: QueueState) -> list[str]:
        return [c.reason or "" for c in self.changes if c.state is state]


# --- the limits themselves -------------------------------------------------------------------
async def test_limits_resolve_own_then_default_then_none(aredis: Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    assert await read_limits(aredis, keys, "acme") == Limits()
    await set_limits(aredis, keys, "*", inflight_ops=4, tokens_per_s=1000)
    await set_limits(aredis, keys, "acme", inflight_ops=2)
    assert await read_limits(aredis, keys, "acme") == Limits(inflight_ops=2, tokens_per_s=1000)
    assert await read_limits(aredis, keys, "other") == Limits(inflight_ops=4, tokens_per_s=1000)
    await clear_limits(aredis, keys, "acme")
    assert (await read_limits(aredis, keys, "acme")).inflight_ops == 4
    with pytest.raises(UserInputError, match="inflight_ops: must be 0"):
        await set_limits(aredis, keys, "acme", inflight_ops=-1)
    with pytest.raises(UserInputError, match="training_runs: must be a whole number"):
        await set_limits(aredis, keys, "acme", training_runs=1.5)  # type: ignore[arg-type]


async def test_an_op_over_the_inflight_limit_stays_queued_and_pauses_its_model(
    aredis: Redis, key_prefix: str
) -> None:
    """At the script level: the second op of a tenant limited to one in flight is refused
    (not failed), its model reports the reason, and it starts once the first is published."""
    keys = Keys(key_prefix)
    jobs = JobQueue(aredis, keys, result_ttl_s=60)
    for model_id in ("m1", "m2"):
        await jobs.register_model(
            model_id, base_model=BASE, tenant_id="acme", session_id=None, lora_config={}
        )
        await jobs.enqueue(model_id, OpKind.PING, b"", job_id=f"{model_id}-op")
    await set_limits(aredis, keys, "acme", inflight_ops=1)
    worker = Dispatcher(
        aredis, keys, worker_id="w", base_model=BASE, lease_ttl_ms=5_000, result_ttl_s=60
    )
    leases = {m: await worker.claim(m) for m in ("m1", "m2")}
    ops = {m: (await worker.read({m: 0}, b"0-0", block_ms=10))[0][0] for m in ("m1", "m2")}
    assert (await worker.start(leases["m1"], ops["m1"])).run  # type: ignore[arg-type]
    refused = await worker.start(leases["m2"], ops["m2"])  # type: ignore[arg-type]
    assert not refused.run and refused.limited and refused.retry_ms == 100
    assert (await jobs.job_fields("m2-op"))["status"] == "queued"
    await WorkerRegistry(aredis, keys).beat("w", {"base_model": BASE}, ttl_ms=5_000)
    state = await queue_state(aredis, keys, WorkerRegistry(aredis, keys), "m2", 5_000)
    assert state == (
        QueueState.PAUSED_RATE_LIMIT,
        "in-flight ops rate limit hit (1 running at once)",
    )
    overview = await queue_overview(aredis, keys, Settings(lease_ttl_ms=5_000), tenant="acme")
    [acme] = overview["tenants"]
    assert acme["inflight_ops"] == 1 and acme["paused_models"] == ["m2"]

    await worker.publish(leases["m1"], ops["m1"], Outcome(JobStatus.DONE), trim_upto=None)  # type: ignore[arg-type]
    assert (await worker.start(leases["m2"], ops["m2"])).run  # type: ignore[arg-type]
    assert await queue_state(aredis, keys, WorkerRegistry(aredis, keys), "m2", 5_000) == (
        QueueState.ACTIVE,
        None,
    )


async def test_the_token_bucket_refuses_a_tenant_in_debt_until_it_refills(
    aredis: Redis, key_prefix: str
) -> None:
    """Tokens are charged when an op finishes; the next op of a tenant below zero waits the
    time the refill needs, and is told how long."""
    keys = Keys(key_prefix)
    jobs = JobQueue(aredis, keys, result_ttl_s=60)
    await jobs.register_model(
        "m1", base_model=BASE, tenant_id="acme", session_id=None, lora_config={}
    )
    for i in range(2):
        await jobs.enqueue("m1", OpKind.PING, b"", job_id=f"op{i}")
    await set_limits(aredis, keys, "acme", tokens_per_s=100)
    worker = Dispatcher(
        aredis, keys, worker_id="w", base_model=BASE, lease_ttl_ms=5_000, result_ttl_s=60
    )
    lease = await worker.claim("m1")
    assert lease is not None
    ops, _, _ = await worker.read({"m1": 0}, b"0-0", block_ms=10)
    assert (await worker.start(lease, ops[0])).run  # a new bucket starts full (100)
    await worker.publish(lease, ops[0], Outcome(JobStatus.DONE, tokens=300), trim_upto=None)
    refused = await worker.start(lease, ops[1])  # 100 - 300 = -200: two seconds of refill
    assert (await read_limits(aredis, keys, "acme")).tokens_per_s == 100
    assert refused.limited and refused.retry_ms == 1_000  # looked at again within a second
    fields = await aredis.hgetall(keys.model_meta("m1"))
    assert fields[b"paused_reason"] == b"tokens per second rate limit hit (100 tokens/s)"


# --- with real workers -----------------------------------------------------------------------
def test_inflight_limit_holds_across_workers_and_nothing_fails(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One op in flight for the tenant: while one worker runs a slow op of one model, another
    worker holding the tenant's second model waits instead of running its ops; all succeed,
    and the client heard why it waited, once per model."""
    caplog.set_level(logging.WARNING, logger=QUEUE_STATE_LOGGER)
    with running_workers(settings, 2, tmp_path), ServiceClient(settings) as service:
        recorder = Recorder()
        service.add_queue_state_observer(recorder)
        first = service.create_lora_training_client(BASE, rank=4)
        slow = first.ping("slow", delay_ms=1_500)
        wait_until_running(settings, slow.request_id)
        # The first worker is busy, so the idle one takes the second model.
        second = service.create_lora_training_client(BASE, rank=4)
        set_tenant_limits(settings, "default", inflight_ops=1)
        held = [second.ping(i, delay_ms=200) for i in range(3)]
        assert slow.result(60)["data"] == "slow"
        assert [f.result(60)["data"] for f in held] == [0, 1, 2]
    owners = {job_field(settings, f.request_id, "worker_id") for f in [slow, *held]}
    assert len(owners) == 2  # the two models were on different workers
    spans = sorted(timings(settings, [f.request_id for f in [slow, *held]]))
    for (_, finished), (started, _) in pairwise(spans):
        assert started >= finished, f"two ops of the tenant ran at once: {spans}"
    assert [
        (c.model_id, c.reason) for c in recorder.changes if c.state is QueueState.PAUSED_RATE_LIMIT
    ][:1] == [(second.model_id, "in-flight ops rate limit hit (1 running at once)")]
    assert [r.getMessage() for r in caplog.records if r.name == QUEUE_STATE_LOGGER] == [
        f"Training is paused for {second.model_id}. Reason: in-flight ops rate limit hit "
        "(1 running at once)"
    ]


def test_a_tenant_at_its_training_runs_limit_waits_for_a_run_to_be_released(
    settings: Settings, tmp_path: Path
) -> None:
    """One training run at a time: the second run's ops wait (paused_rate_limit, "concurrent
    training clients rate limit hit") until the first run's worker hands it back, then run;
    none fails."""
    set_tenant_limits(settings, "default", training_runs=1)
    with running_workers(settings, 2, tmp_path), ServiceClient(settings) as service:
        recorder = Recorder()
        service.add_queue_state_observer(recorder)
        first = service.create_lora_training_client(BASE, rank=4)
        busy = [first.ping(i, delay_ms=300) for i in range(4)]
        waiting = service.create_lora_training_client(BASE, rank=4)  # blocks until it has a slot
        assert waiting.ping("second run").result(60)["data"] == "second run"
        assert [f.result(60)["data"] for f in busy] == [0, 1, 2, 3]
    [(_, first_done)] = timings(settings, [busy[-1].request_id])
    [(second_created, _)] = timings(settings, [job_of(settings, waiting.model_id, "create_model")])
    assert second_created >= first_done
    assert any(
        c.model_id == waiting.model_id
        and c.reason == "concurrent training clients rate limit hit (1 training runs at once)"
        for c in recorder.changes
        if c.state is QueueState.PAUSED_RATE_LIMIT
    )


def test_a_model_no_live_worker_serves_reports_paused_capacity(
    service: ServiceClient, caplog: pytest.LogCaptureFixture
) -> None:
    """No worker for the base model: the op waits, the observer hears paused_capacity with the
    reason, and the warning is logged once although the state is looked up every second."""
    caplog.set_level(logging.WARNING, logger=QUEUE_STATE_LOGGER)
    recorder = Recorder()
    service.add_queue_state_observer(recorder)
    future = service._loop.run(_create_model_without_waiting(service, "no-such-base"))
    time.sleep(3.5)
    assert not future.done()
    assert [(c.state, c.reason) for c in recorder.changes] == [
        (QueueState.PAUSED_CAPACITY, "no live worker serves base model no-such-base")
    ]
    [warning] = [r.getMessage() for r in caplog.records if r.name == QUEUE_STATE_LOGGER]
    assert warning.startswith("Training is paused for m-")
    assert warning.endswith("Reason: no live worker serves base model no-such-base")


async def _create_model_without_waiting(service: ServiceClient, base_model: str) -> Any:
    holder = service._holder
    model_id = "m-capacity-test"
    await holder.jobs.register_model(
        model_id, base_model=base_model, tenant_id="default", session_id=None, lora_config={}
    )
    _, future = await holder.submit(model_id, OpKind.PING, codec.encode({"delay_ms": 0}))
    return future


def test_the_warning_is_debounced_per_model() -> None:
    """Once a minute per model, whatever the flapping in between; models apart."""
    now = [0.0]
    logger = QueueStateLogger(interval_s=60, clock=lambda: now[0])
    paused = QueueStateChange("m-1", "training", QueueState.PAUSED_RATE_LIMIT, "limit hit")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("queue_tinker.queue_state")
    log.addHandler(handler)
    try:
        for t in (0, 10, 59):
            now[0] = t
            logger(paused)
            logger(QueueStateChange("m-1", "training", QueueState.ACTIVE, None))
        now[0] = 30
        logger(QueueStateChange("m-2", "sampling", QueueState.PAUSED_CAPACITY, "no worker"))
        now[0] = 61
        logger(paused)
    finally:
        log.removeHandler(handler)
    assert records == [
        "Training is paused for m-1. Reason: limit hit",
        "Sampling is paused for m-2. Reason: no worker",
        "Training is paused for m-1. Reason: limit hit",
    ]
