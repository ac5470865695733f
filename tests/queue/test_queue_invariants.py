"""The queue's promise, checked against real Redis over random histories of a sampling
session's ops: enqueued, cancelled while they wait or stopped while they run, read, started
several at a time (as the decode loop starts samples), published in order, and their owner
lost and replaced at any point.

After every step: `done_seq` never passes an op that is not finished (a new owner reads the log
from there), the log still holds every op after it, and the model is pending exactly while
ops after it remain. At the end a fresh owner finishes the rest: every op is done, cancelled
or stopped as asked (by the owner it was asked of, or by the next one if that one died), none
published twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from test_queue_core import BASE, dispatcher

from queue_tinker.errors import UserInputError
from queue_tinker.queue.connection import connect
from queue_tinker.queue.control.actions import cancel_job
from queue_tinker.queue.dispatch.dispatcher import Dispatcher, Lease, Op, Outcome
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.types import JobStatus, OpKind

ACTIONS = ("enqueue", "enqueue", "cancel", "read", "start", "publish", "lose_owner")


@dataclass
class Owner:
    """What a worker holds of the model: its lease, the ops it read and has not started, the
    ops it started and has not published (in seq order), and the stops asked of them."""

    dispatch: Dispatcher
    lease: Lease
    read_seq: int
    backlog: list[Op] = field(default_factory=list)
    running: list[Op] = field(default_factory=list)
    control_cursor: bytes = b"0-0"
    stops: dict[str, str] = field(default_factory=dict)


class History:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.jobs = JobQueue(redis, keys, result_ttl_s=60)
        self.model = f"m-{uuid.uuid4().hex[:8]}"
        self.enqueued: list[str] = []  # job ids, in seq order
        self.published: dict[str, JobStatus] = {}
        self.stops_asked: dict[str, int] = {}  # job id -> the owner (number) it was asked of
        self.owner: Owner | None = None
        self.owners = 0

    async def begin(self) -> None:
        await self.jobs.register_model(
            self.model, base_model=BASE, tenant_id="default", session_id=None, lora_config={}
        )

    async def act(self, action: str, pick: int) -> None:
        if action == "enqueue":
            job_id = f"{self.model}-{len(self.enqueued)}"
            await self.jobs.enqueue(self.model, OpKind.SAMPLE, b"", job_id=job_id)
            self.enqueued.append(job_id)
        elif action == "cancel" and self.enqueued:
            # A waiting op fails at once; a running one is asked to stop (its owner's control
            # stream, and the job); a finished one is left as it is.
            job_id = self.enqueued[pick % len(self.enqueued)]
            with contextlib.suppress(UserInputError):
                if await cancel_job(self.redis, self.keys, job_id, None) == "running":
                    self.stops_asked.setdefault(job_id, self.owners)
        elif action == "lose_owner" and self.owner is not None:
            # Its lease lapses (a dead worker); the next owner claims the model afresh.
            await self.redis.delete(self.keys.model_lease(self.model))
            self.owner = None
        elif action in ("read", "start", "publish"):
            owner = await self._owner()
            if action == "read":
                await self._read(owner)
            elif action == "start" and owner.backlog:
                await self._start(owner, 1 + pick % len(owner.backlog))
            elif action == "publish" and owner.running:
                await self._publish(owner, owner.running.pop(0))

    async def _owner(self) -> Owner:
        if self.owner is None:
            self.owners += 1
            worker_id = f"{self.model}-w{self.owners}"
            dispatch = dispatcher(self.redis, self.keys, worker_id, lease_ttl_ms=60_000)
            lease = await dispatch.claim(self.model)
            assert lease is not None, "a lapsed lease is free to claim"
            self.owner = Owner(dispatch, lease, read_seq=lease.done_seq)
        return self.owner

    async def _read(self, owner: Owner) -> None:
        ops, owner.control_cursor, control = await owner.dispatch.read(
            {self.model: owner.read_seq}, owner.control_cursor, block_ms=1
        )
        owner.stops.update(control.stops)
        owner.backlog += ops
        if ops:
            owner.read_seq = ops[-1].seq

    async def _start(self, owner: Owner, count: int) -> None:
        taken, owner.backlog = owner.backlog[:count], owner.backlog[count:]
        starts = await owner.dispatch.start_batch([(owner.lease, op) for op in taken])
        for op, start in zip(taken, starts, strict=True):
            assert start is not None and not start.limited
            if start.stop_reason:  # asked of an owner that died before it read the stop
                owner.stops[op.job_id] = start.stop_reason
            if start.run:
                owner.running.append(op)

    async def _publish(self, owner: Owner, op: Op) -> None:
        # As the worker publishes a sample: in seq order, naming as durable every op it has
        # read (a sampling session has nothing to replay); the publish trims up to the op.
        stop = owner.stops.get(op.job_id)
        outcome = (
            Outcome(JobStatus.DONE)
            if stop is None
            else Outcome(JobStatus.FAILED, error=stop, error_category="user")
        )
        await owner.dispatch.publish(owner.lease, op, outcome, trim_upto=owner.read_seq)
        assert op.job_id not in self.published, f"{op.job_id} published twice"
        # An owner may finish an op before it reads the stop; a later owner must not.
        asked_of = self.stops_asked.get(op.job_id)
        assert stop is not None or asked_of is None or asked_of == self.owners, (
            f"{op.job_id}: the stop asked of owner {asked_of} was lost with it"
        )
        self.published[op.job_id] = outcome.status

    async def check(self) -> None:
        meta = await self.redis.hmget(self.keys.model_meta(self.model), "done_seq", "last_seq")
        done, last = int(meta[0] or 0), int(meta[1] or 0)
        statuses = [await self.redis.hget(self.keys.job(j), "status") for j in self.enqueued]
        unfinished = [seq for seq, s in enumerate(statuses, 1) if s not in (b"done", b"failed")]
        assert done <= (min(unfinished) - 1 if unfinished else last), (done, unfinished)
        logged = [
            int(entry_id.split(b"-")[0])
            for entry_id, _ in await self.redis.xrange(self.keys.model_ops(self.model))
        ]
        assert set(range(done + 1, last + 1)) <= set(logged), (done, last, logged)
        pending = await self.redis.sismember(self.keys.pending(BASE), self.model)
        assert bool(pending) == (done < last), (done, last, pending)

    async def finish(self) -> None:
        """A fresh owner runs what is left, as a worker would, one op at a time."""
        if self.owner is not None:
            await self.act("lose_owner", 0)
        owner = await self._owner()
        await self._read(owner)
        while owner.backlog:
            await self._start(owner, 1)
            while owner.running:
                await self._publish(owner, owner.running.pop(0))
        await self.check()
        done, last = await self.redis.hmget(
            self.keys.model_meta(self.model), "done_seq", "last_seq"
        )
        assert done == last
        for job_id in self.enqueued:
            fields = await self.jobs.job_fields(job_id)
            if self.published.get(job_id) is JobStatus.DONE:
                assert fields["status"] == "done", (job_id, fields)
            else:  # cancelled while it waited, or stopped as asked
                assert (fields["status"], fields["error_category"]) == ("failed", "user"), fields
                assert "cancelled from the dashboard" in fields["error"], fields


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 7)), max_size=40))
def test_random_histories_keep_the_queues_promise(
    redis_url: str, key_prefix: str, steps: list[tuple[str, int]]
) -> None:
    async def run() -> None:
        redis = connect(redis_url)
        try:
            history = History(redis, Keys(key_prefix))
            await history.begin()
            for action, pick in steps:
                await history.act(action, pick)
                await history.check()
            await history.finish()
        finally:
            await redis.aclose()

    asyncio.run(run())
