"""Ops a client numbered itself (the Tinker protocol's seq_id) enter the model's log in that
order whatever order they arrive in, once each; real Redis, the real scripts."""

from __future__ import annotations

import asyncio
import random

import pytest
from redis.asyncio import Redis

from queue_tinker.errors import HeldOpsFullError, SeqIdUsedError, UserInputError
from queue_tinker.queue.control.actions import DASHBOARD_CANCEL_REASON, cancel_job
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import HeldLimits, JobQueue
from queue_tinker.types import JobStatus, OpKind


@pytest.fixture
def keys(key_prefix: str) -> Keys:
    return Keys(key_prefix)


@pytest.fixture
async def jobs(aredis: Redis, keys: Keys) -> JobQueue:
    queue = JobQueue(aredis, keys, result_ttl_s=60)
    await queue.register_model(
        "m", base_model="tiny", tenant_id="t", session_id=None, lora_config={"rank": 4}
    )
    return queue


async def log_of(jobs: JobQueue, keys: Keys) -> list[tuple[int, str, bytes]]:
    """(seq, job id, payload) of every op in the model's log."""
    entries = await jobs.redis.xrange(keys.model_ops("m"))
    return [(int(e[0].split(b"-")[0]), e[1][b"job"].decode(), e[1][b"payload"]) for e in entries]


async def test_ops_arriving_out_of_order_enter_the_log_in_seq_id_order(
    jobs: JobQueue, keys: Keys
) -> None:
    arrival = [3, 2, 5, 1, 4]
    for seq_id in arrival[:2]:
        held = await jobs.enqueue_in_order(
            "m", seq_id, OpKind.PING, b"%d" % seq_id, job_id=f"j{seq_id}"
        )
        assert held.created and held.waiting_for == 1
    assert await log_of(jobs, keys) == []  # nothing may run before seq_id 1
    assert (await jobs.redis.hget(keys.job("j3"), "status")) == b"queued"  # awaitable already
    await jobs.enqueue_in_order("m", 5, OpKind.PING, b"5", job_id="j5")
    first = await jobs.enqueue_in_order("m", 1, OpKind.PING, b"1", job_id="j1")
    assert first.waiting_for == 4
    assert [op[1] for op in await log_of(jobs, keys)] == ["j1", "j2", "j3"]
    await jobs.enqueue_in_order("m", 4, OpKind.PING, b"4", job_id="j4")
    assert await log_of(jobs, keys) == [(i, f"j{i}", b"%d" % i) for i in range(1, 6)]
    assert await jobs.redis.exists(keys.model_held("m")) == 0


async def test_a_retried_seq_id_returns_the_first_job_held_or_appended(
    jobs: JobQueue, keys: Keys
) -> None:
    await jobs.enqueue_in_order("m", 2, OpKind.PING, b"", job_id="first-2")
    again = await jobs.enqueue_in_order("m", 2, OpKind.PING, b"", job_id="retry-2")
    assert (again.job_id, again.created) == ("first-2", False)
    await jobs.enqueue_in_order("m", 1, OpKind.PING, b"", job_id="first-1")
    again = await jobs.enqueue_in_order("m", 1, OpKind.PING, b"", job_id="retry-1")
    assert (again.job_id, again.created) == ("first-1", False)
    assert [op[1] for op in await log_of(jobs, keys)] == ["first-1", "first-2"]
    assert await jobs.redis.exists(keys.job("retry-1"), keys.job("retry-2")) == 0


async def test_a_seq_id_consumed_without_an_op_lets_the_rest_through(
    jobs: JobQueue, keys: Keys
) -> None:
    """A request refused at the door (kind None) still takes its turn, so seq 3 is not held
    behind a seq 2 that will never come; consuming twice is harmless."""
    await jobs.enqueue_in_order("m", 3, OpKind.PING, b"", job_id="j3")
    await jobs.enqueue_in_order("m", 2, None, b"", job_id="refused")
    await jobs.enqueue_in_order("m", 2, None, b"", job_id="refused")
    await jobs.enqueue_in_order("m", 1, OpKind.PING, b"", job_id="j1")
    assert [op[:2] for op in await log_of(jobs, keys)] == [(1, "j1"), (2, "j3")]
    assert await jobs.redis.exists(keys.job("refused")) == 0


async def test_a_used_seq_id_whose_job_is_forgotten_is_refused(jobs: JobQueue, keys: Keys) -> None:
    await jobs.enqueue_in_order("m", 1, OpKind.PING, b"", job_id="j1")
    await jobs.redis.delete(keys.idempotency("m", "seq:1"))  # its TTL ran out
    with pytest.raises(SeqIdUsedError, match="seq_id: 1 of model m"):
        await jobs.enqueue_in_order("m", 1, OpKind.PING, b"", job_id="late")


async def test_skipping_a_gap_resumes_at_the_lowest_held_op(jobs: JobQueue, keys: Keys) -> None:
    assert await jobs.skip_seq_gap("m") is None
    for seq_id in (4, 3, 6):
        await jobs.enqueue_in_order("m", seq_id, OpKind.PING, b"", job_id=f"j{seq_id}")
    assert await jobs.skip_seq_gap("m") == (1, 3)
    assert [op[1] for op in await log_of(jobs, keys)] == ["j3", "j4"]
    await jobs.enqueue_in_order("m", 5, OpKind.PING, b"", job_id="j5")
    assert [op[1] for op in await log_of(jobs, keys)] == ["j3", "j4", "j5", "j6"]
    with pytest.raises(SeqIdUsedError):
        await jobs.enqueue_in_order("m", 2, OpKind.PING, b"", job_id="too-late")


async def test_an_op_cancelled_while_held_takes_its_turn_without_entering_the_log(
    jobs: JobQueue, keys: Keys
) -> None:
    """Ops 2 and 4 are cancelled while they wait for seq_ids 1 and 3: each fails as cancelled
    at once, and when its turn comes (the gap filled, or given up) it is consumed without an
    op, so it never runs and is not queued again."""
    for seq_id in (2, 4, 5):
        await jobs.enqueue_in_order("m", seq_id, OpKind.PING, b"", job_id=f"j{seq_id}")
    for job_id in ("j2", "j4"):
        assert await cancel_job(jobs.redis, keys, job_id, "t") == "queued"
        job, outcome = await jobs.job(job_id)
        assert outcome and outcome.status is JobStatus.FAILED, job
        assert outcome.error == f"{DASHBOARD_CANCEL_REASON} before it ran"
    await jobs.enqueue_in_order("m", 1, OpKind.PING, b"", job_id="j1")
    assert await log_of(jobs, keys) == [(1, "j1", b"")]
    assert await jobs.skip_seq_gap("m") == (3, 4)
    assert [op[:2] for op in await log_of(jobs, keys)] == [(1, "j1"), (2, "j5")]
    for job_id in ("j2", "j4"):
        assert (await jobs.job(job_id))[0]["status"] == "failed"
    retried = await jobs.enqueue_in_order("m", 2, OpKind.PING, b"", job_id="retry-2")
    assert (retried.job_id, retried.created) == ("j2", False)  # the SDK's retry: the same job


async def test_concurrent_shuffled_arrivals_keep_seq_id_order(jobs: JobQueue, keys: Keys) -> None:
    """200 ops sent concurrently in a random order, each twice: the log is 1..200, once each."""
    order = list(range(1, 201)) * 2
    random.Random(7).shuffle(order)
    results = await asyncio.gather(
        *(
            jobs.enqueue_in_order("m", s, OpKind.PING, b"%d" % s, job_id=f"j{s}-{i}")
            for i, s in enumerate(order)
        )
    )
    ops = await log_of(jobs, keys)
    assert [op[0] for op in ops] == list(range(1, 201))
    assert [op[2] for op in ops] == [b"%d" % s for s in range(1, 201)]
    first_job = {op[2]: op[1] for op in ops}
    for seq_id, result in zip(order, results, strict=True):
        assert result.job_id == first_job[b"%d" % seq_id]


async def test_held_ops_are_capped_by_window_count_and_bytes(aredis: Redis, keys: Keys) -> None:
    """A seq_id too far ahead is refused (400), and once a model holds its most early ops or
    bytes the next early one is refused (retry later) without a trace; the seq_id the model
    waits for still enters and frees them all (5 x 4 MiB at seq_id 1e6 were held for good)."""
    jobs = JobQueue(aredis, keys, result_ttl_s=60, held=HeldLimits(window=10, count=3, bytes=100))
    await jobs.register_model(
        "m", base_model="tiny", tenant_id="t", session_id=None, lora_config={"rank": 4}
    )
    with pytest.raises(UserInputError, match=r"^seq_id: 1000000 is more than 10 past 1"):
        await jobs.enqueue_in_order("m", 1_000_000, OpKind.PING, b"x" * 10, job_id="far")
    for seq_id in (2, 3, 4):
        await jobs.enqueue_in_order("m", seq_id, OpKind.PING, b"x" * 10, job_id=f"j{seq_id}")
    with pytest.raises(HeldOpsFullError, match=r"^seq_id: model m already holds 3 ops"):
        await jobs.enqueue_in_order("m", 5, OpKind.PING, b"x", job_id="j5")
    assert not await aredis.exists(keys.job("j5"), keys.job("far"))
    await jobs.enqueue_in_order("m", 1, OpKind.PING, b"x" * 10, job_id="j1")
    assert [op[1] for op in await log_of(jobs, keys)] == ["j1", "j2", "j3", "j4"]
    with pytest.raises(HeldOpsFullError, match=r"holds 100 bytes"):
        await jobs.enqueue_in_order("m", 7, OpKind.PING, b"x" * 101, job_id="j7")
    await jobs.enqueue_in_order("m", 7, OpKind.PING, b"x" * 100, job_id="j7")
    assert await aredis.hlen(keys.model_held("m")) == 1
