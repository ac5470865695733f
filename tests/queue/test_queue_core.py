"""The queue's scripts against real Redis: ordering, idempotency, leases and fencing."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from queue_tinker.errors import LeaseLostError, UnknownModelError, UserInputError
from queue_tinker.queue.control.actions import cancel_job
from queue_tinker.queue.dispatch.dispatcher import Dispatcher, Lease, Op, Outcome
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import parse_record
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.types import CheckpointKind, CheckpointRecord, JobStatus, OpKind

BASE = "tiny"


@pytest.fixture
def redis(aredis: Redis) -> Redis:
    return aredis


@pytest.fixture
def keys(key_prefix: str) -> Keys:
    return Keys(key_prefix)


@pytest.fixture
def jobs(redis: Redis, keys: Keys) -> JobQueue:
    return JobQueue(redis, keys, result_ttl_s=60)


def dispatcher(redis: Redis, keys: Keys, worker_id: str, lease_ttl_ms: int = 5_000) -> Dispatcher:
    return Dispatcher(
        redis,
        keys,
        worker_id=worker_id,
        base_model=BASE,
        lease_ttl_ms=lease_ttl_ms,
        result_ttl_s=60,
    )


async def new_model(jobs: JobQueue, model_id: str = "m1") -> str:
    await jobs.register_model(
        model_id, base_model=BASE, tenant_id="default", session_id=None, lora_config={"rank": 8}
    )
    return model_id


async def test_enqueue_assigns_consecutive_seqs_under_concurrency(
    jobs: JobQueue, keys: Keys
) -> None:
    """200 concurrent submits get seqs 1..200 with none skipped or reused."""
    model = await new_model(jobs)
    await asyncio.gather(
        *(jobs.enqueue(model, OpKind.PING, b"", job_id=f"j{i}") for i in range(200))
    )
    entries = await jobs.redis.xrange(keys.model_ops(model))
    assert [int(e[0].split(b"-")[0]) for e in entries] == list(range(1, 201))
    assert sorted(e[1][b"job"].decode() for e in entries) == sorted(f"j{i}" for i in range(200))


async def test_same_idempotency_key_returns_first_job(jobs: JobQueue, keys: Keys) -> None:
    """A resubmit under the same key queues nothing and returns the original job id."""
    model = await new_model(jobs)
    first = await jobs.enqueue(model, OpKind.PING, b"a", job_id="j1", idempotency_key="k")
    again = await jobs.enqueue(model, OpKind.PING, b"b", job_id="j2", idempotency_key="k")
    assert (first.job_id, first.created) == ("j1", True)
    assert (again.job_id, again.created) == ("j1", False)
    assert await jobs.redis.xlen(keys.model_ops(model)) == 1
    assert not await jobs.redis.exists(keys.job("j2"))


async def test_bad_submits_name_the_field(jobs: JobQueue) -> None:
    """Unknown models and malformed idempotency keys are user errors that say what is wrong."""
    with pytest.raises(UnknownModelError, match="model_id"):
        await jobs.enqueue("nope", OpKind.PING, b"", job_id="j")
    model = await new_model(jobs)
    with pytest.raises(UserInputError, match="idempotency_key"):
        await jobs.enqueue(model, OpKind.PING, b"", job_id="j", idempotency_key="x" * 500)


async def test_unowned_model_is_offered_once(jobs: JobQueue, redis: Redis, keys: Keys) -> None:
    """Pending ops put an unowned model on its base model's offers, once; a claim takes it off."""
    model = await new_model(jobs)
    for i in range(3):
        await jobs.enqueue(model, OpKind.PING, b"", job_id=f"j{i}")
    assert await redis.zrange(keys.offers(BASE), 0, -1) == [model.encode()]
    worker = dispatcher(redis, keys, "wA")
    assert await worker.take_offer() == model
    lease = await worker.claim(model)
    assert lease is not None and lease.done_seq == 0
    await jobs.enqueue(model, OpKind.PING, b"", job_id="j3")
    assert await redis.zcard(keys.offers(BASE)) == 0  # owned: the owner sees it on its stream


async def test_stale_owner_is_fenced_out(jobs: JobQueue, redis: Redis, keys: Keys) -> None:
    """After a takeover the old owner cannot start, publish, renew or release."""
    model = await new_model(jobs)
    await jobs.enqueue(model, OpKind.PING, b"", job_id="j1")
    worker_a, worker_b = dispatcher(redis, keys, "wA", 300), dispatcher(redis, keys, "wB")
    lease_a = await worker_a.claim(model)
    assert lease_a is not None
    ops, _, _ = await worker_a.read({model: 0}, b"0-0", block_ms=100)
    assert (await worker_a.start(lease_a, ops[0])).run
    assert await worker_b.claim(model) is None  # held
    await asyncio.sleep(0.45)  # A stalls past its lease
    lease_b = await worker_b.claim(model)
    assert lease_b is not None and lease_b.token != lease_a.token

    done = Outcome(status=JobStatus.DONE, result=b"from A")
    with pytest.raises(LeaseLostError):
        await worker_a.publish(lease_a, ops[0], done, trim_upto=None)
    with pytest.raises(LeaseLostError):
        await worker_a.start(lease_a, ops[0])
    assert await worker_a.renew([lease_a]) == [False]
    assert await worker_a.release(lease_a, force=True) == -1
    assert (await jobs.outcome("j1")) is None  # nothing A did after losing the lease landed

    assert (await worker_b.start(lease_b, ops[0])).run
    await worker_b.publish(lease_b, ops[0], Outcome(JobStatus.DONE, b"from B"), trim_upto=1)
    outcome = await jobs.outcome("j1")
    assert outcome is not None and outcome.result == b"from B"
    fields = await jobs.job_fields("j1")
    assert fields["worker_id"] == "wB" and fields["attempts"] == "2"
    assert await worker_b.renew([lease_b]) == [True]


def saved(model: str, name: str) -> CheckpointRecord:
    return CheckpointRecord(
        id=f"tinker://{model}/weights/{name}",
        model_id=model,
        tenant_id="default",
        name=name,
        kind=CheckpointKind.STATE,
        path=f"s3://bucket/{model}/weights/{name}",
        size_bytes=10,
        created_at=1.0,
    )


async def test_an_ops_records_land_with_its_publish_and_not_without_its_lease(
    jobs: JobQueue, redis: Redis, keys: Keys
) -> None:
    """A save's checkpoint record rides in the fenced publish: an owner cut off while it ran
    the save, back after a takeover, records nothing; the new owner's publish records it,
    before the request's own record."""
    model = await new_model(jobs)
    await jobs.enqueue(model, OpKind.SAVE_STATE, b"", job_id="j1")
    worker_a, worker_b = dispatcher(redis, keys, "wA", 300), dispatcher(redis, keys, "wB")
    lease_a = await worker_a.claim(model)
    assert lease_a is not None
    ops, _, _ = await worker_a.read({model: 0}, b"0-0", block_ms=100)
    assert (await worker_a.start(lease_a, ops[0])).run
    await asyncio.sleep(0.45)  # A is cut off past its lease; B takes the model over
    lease_b = await worker_b.claim(model)
    assert lease_b is not None
    before = await redis.xlen(keys.records())

    done = Outcome(status=JobStatus.DONE, result=b"from A")
    with pytest.raises(LeaseLostError):
        await worker_a.publish(lease_a, ops[0], done, trim_upto=None, records=[saved(model, "a")])
    assert await redis.xlen(keys.records()) == before

    assert (await worker_b.start(lease_b, ops[0])).run
    after_start = (await redis.xrevrange(keys.records(), count=1))[0][0]
    await worker_b.publish(
        lease_b,
        ops[0],
        Outcome(JobStatus.DONE, b"from B"),
        trim_upto=1,
        records=[saved(model, "b")],
    )
    added = [
        parse_record(fields)
        for _, fields in await redis.xrange(keys.records(), min=f"({after_start.decode()}")
    ]
    assert [type(r).__name__ for r in added] == ["CheckpointRecord", "RequestRecord"]
    assert added[0] == saved(model, "b")


async def test_release_keeps_a_model_with_pending_ops(
    jobs: JobQueue, redis: Redis, keys: Keys
) -> None:
    """A plain release refuses while ops are unpublished; a forced one re-offers the model."""
    model = await new_model(jobs)
    worker = dispatcher(redis, keys, "wA")
    lease = await worker.claim(model)
    assert lease is not None
    await jobs.enqueue(model, OpKind.PING, b"", job_id="j1")
    assert await worker.release(lease) == 0
    assert await worker.release(lease, force=True) == 1
    assert await redis.zrange(keys.offers(BASE), 0, -1) == [model.encode()]


async def test_reaper_offers_models_of_dead_workers(
    jobs: JobQueue, redis: Redis, keys: Keys
) -> None:
    """Pending ops whose owner's lease lapsed are offered again; owned ones are not."""
    dead, alive = await new_model(jobs, "dead"), await new_model(jobs, "alive")
    worker = dispatcher(redis, keys, "wA", lease_ttl_ms=200)
    for model in (dead, alive):
        assert await worker.claim(model) is not None
        await jobs.enqueue(model, OpKind.PING, b"", job_id=f"j-{model}")
    await asyncio.sleep(0.3)
    assert await worker.claim(alive) is not None  # re-claimed, so owned again
    assert await worker.offer_orphans() == 1
    assert await redis.zrange(keys.offers(BASE), 0, -1) == [b"dead"]


async def owned_pings(
    jobs: JobQueue, redis: Redis, keys: Keys, count: int
) -> tuple[str, Dispatcher, Lease, list[Op]]:
    """A new model with `count` pings, claimed by worker wA, its ops read: (model, worker,
    lease, ops)."""
    model = await new_model(jobs)
    for i in range(count):
        await jobs.enqueue(model, OpKind.PING, b"", job_id=f"j{i}")
    worker = dispatcher(redis, keys, "wA")
    lease = await worker.claim(model)
    assert lease is not None
    ops, _, _ = await worker.read({model: 0}, b"0-0", block_ms=100)
    return model, worker, lease, ops


async def test_publish_advances_the_model_and_trims_its_log(
    jobs: JobQueue, redis: Redis, keys: Keys
) -> None:
    """Publishing seq k marks k done, trims the log through k, and clears pending at the end."""
    model, worker, lease, ops = await owned_pings(jobs, redis, keys, 3)
    assert [op.seq for op in ops] == [1, 2, 3]
    for op in ops:
        await worker.start(lease, op)
        await worker.publish(lease, op, Outcome(JobStatus.DONE), trim_upto=op.seq)
        remaining = await redis.xrange(keys.model_ops(model))
        assert [int(e[0].split(b"-")[0]) for e in remaining] == list(range(op.seq + 1, 4))
    assert await redis.hget(keys.model_meta(model), "done_seq") == b"3"
    assert not await redis.sismember(keys.pending(BASE), model)


async def test_an_op_cancelled_behind_a_running_one_is_settled_by_its_publish(
    jobs: JobQueue, redis: Redis, keys: Keys
) -> None:
    """Ops 2 and 3 are cancelled while op 1 runs (samples start together): their starts find
    them finished but leave done_seq behind op 1, which a new owner must still read; op 1's
    publish then settles all three, and the model leaves the pending set."""
    model, worker, lease, ops = await owned_pings(jobs, redis, keys, 3)
    assert (await worker.start(lease, ops[0])).run
    for job_id in ("j1", "j2"):
        assert await cancel_job(redis, keys, job_id, None) == "queued"
    assert [s.run for s in await worker.start_batch([(lease, op) for op in ops[1:]])] == [False] * 2
    assert await redis.hget(keys.model_meta(model), "done_seq") == b"0"
    assert await redis.sismember(keys.pending(BASE), model)
    await worker.publish(lease, ops[0], Outcome(JobStatus.DONE), trim_upto=None)
    assert await redis.hget(keys.model_meta(model), "done_seq") == b"3"
    assert not await redis.sismember(keys.pending(BASE), model)


async def test_inline_publish_starts_and_finishes_once(
    jobs: JobQueue, redis: Redis, keys: Keys
) -> None:
    """An op published without start() is marked started by this worker, attempt 1; a second
    publish of a finished job changes nothing."""
    model = await new_model(jobs)
    await jobs.enqueue(model, OpKind.PING, b"", job_id="j1")
    worker = dispatcher(redis, keys, "wA")
    lease = await worker.claim(model)
    assert lease is not None
    ops, _, _ = await worker.read({model: 0}, b"0-0", block_ms=100)
    assert await worker.publish_batch(
        [(lease, ops[0], Outcome(JobStatus.DONE, b"first"), None)], started=False
    ) == [True]
    fields = await jobs.job_fields("j1")
    assert (fields["status"], fields["worker_id"], fields["attempts"]) == ("done", "wA", "1")
    assert fields["started_at"] == fields["finished_at"]
    await worker.publish(lease, ops[0], Outcome(JobStatus.FAILED, b"again"), trim_upto=None)
    outcome = await jobs.outcome("j1")
    assert outcome is not None and (outcome.status, outcome.result) == (JobStatus.DONE, b"first")


async def test_inline_batch_reports_lost_leases_per_op(
    jobs: JobQueue, redis: Redis, keys: Keys
) -> None:
    """In one pipelined batch, ops of a model whose lease was taken over are refused and
    reported, while another model's ops publish."""
    kept, lost = await new_model(jobs, "kept"), await new_model(jobs, "lost")
    for model in (kept, lost):
        await jobs.enqueue(model, OpKind.PING, b"", job_id=f"j-{model}")
    worker = dispatcher(redis, keys, "wA", lease_ttl_ms=300)
    lease_kept, lease_lost = await worker.claim(kept), await worker.claim(lost)
    assert lease_kept is not None and lease_lost is not None
    ops, _, _ = await worker.read({kept: 0, lost: 0}, b"0-0", block_ms=100)
    await asyncio.sleep(0.4)
    assert await dispatcher(redis, keys, "wB").claim(lost) is not None  # taken over
    assert await worker.renew([lease_kept]) == [False]  # lapsed too, but nobody took it
    lease_kept = await worker.claim(kept)
    assert lease_kept is not None
    leases = {kept: lease_kept, lost: lease_lost}
    batch = [(leases[op.model_id], op, Outcome(JobStatus.DONE, b"r"), None) for op in ops]
    published = await worker.publish_batch(batch, started=False)
    assert dict(zip([op.model_id for op in ops], published, strict=True)) == {
        kept: True,
        lost: False,
    }
    assert (await jobs.outcome("j-lost")) is None
