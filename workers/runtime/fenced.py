"""An op's writes to Redis, each fenced by its model's lease: marking it running (or leaving it
queued while its tenant is over a limit), and publishing its outcome with the records it
produced. A write the lease refuses drops the model: another worker owns it now. Each write
rides out a Redis outage (the Reconnector repeats it once Redis answers): every write here is
fenced, and a publish repeated finds its job already terminal."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import NamedTuple

from queue_tinker.errors import ErrorCategory
from queue_tinker.queue.dispatch.dispatcher import Dispatcher, Op, Outcome, Start
from queue_tinker.queue.outage import Reconnector
from queue_tinker.types import JobStatus
from queue_tinker.types.service.records import Record
from queue_tinker.workers.interface import Durability
from queue_tinker.workers.runtime.compute import ComputeThread
from queue_tinker.workers.runtime.owned import OwnedModel
from queue_tinker.workers.runtime.ownership import Ownership
from queue_tinker.workers.runtime.presence import Activity
from queue_tinker.workers.runtime.scheduling import Scheduler

Batch = list[tuple[OwnedModel, Op]]


class Started(NamedTuple):
    runnable: Batch  # the ops to run now
    stops: dict[str, str]  # job id -> why: samples asked to stop while a dead owner ran them


class FencedWrites:
    def __init__(
        self,
        dispatch: Dispatcher,
        reconnect: Reconnector,
        on_records: Callable[[list[Record]], Awaitable[None]] | None,
        ownership: Ownership,
        schedule: Scheduler,
        durability: Durability,
        activity: Activity,
        compute: ComputeThread,
    ) -> None:
        self.dispatch = dispatch
        self.reconnect = reconnect
        self.on_records = on_records  # e.g. schedule checkpoint expiry
        self.ownership = ownership
        self.schedule = schedule
        self.durability = durability
        self.activity = activity
        self.compute = compute

    async def start(self, owned: OwnedModel, op: Op) -> bool:
        """start_batch for one op: whether it runs now (its model's lease lost, over its
        tenant's limit, or finished already: not)."""
        runnable, _ = await self.start_batch([(owned, op)])
        return bool(runnable)

    async def start_batch(self, batch: Batch) -> Started:
        """Mark the ops running (one round trip). Models whose lease was lost are dropped; ops
        over their tenant's limit go back to their backlog; ops already finished (cancelled)
        are skipped."""
        # One decision per op: a Start, or None where the model's lease was lost.
        starts: list[Start | None] = await self.reconnect.call(
            self.dispatch.start_batch, [(o.lease, op) for o, op in batch]
        )
        decided = list(zip(batch, starts, strict=True))
        self.ownership.drop_lost([owned for (owned, _), start in decided if start is None])
        spent = [(pair, start) for pair, start in decided if start and start.spent]
        held = {op.job_id for (_, op), _ in spent if await self._holds(op)}
        decided = [
            (pair, replace(start, run=True) if start and pair[1].job_id in held else start)
            for pair, start in decided
        ]
        failed = [(pair, start.spent) for pair, start in spent if pair[1].job_id not in held]
        if failed:  # started too often: failed unrun (runs_now is False for them)
            await self.publish_batch(
                [pair for pair, _ in failed],
                [spent_outcome(error) for _, error in failed],
                started=True,
            )
        for owned, ops, start in _limited_by_model(decided):
            self.schedule.hold_back(owned, ops, start.retry_ms, time.monotonic())
        stops = {
            op.job_id: start.stop_reason
            for (_, op), start in decided
            if start and start.stop_reason
        }
        runnable = [(owned, op) for (owned, op), start in decided if self._runs_now(owned, start)]
        return Started(runnable, stops)

    async def publish(
        self, owned: OwnedModel, op: Op, outcome: Outcome, records: list[Record]
    ) -> None:
        """An op's outcome and the records it made (durable before the user hears of it), in
        one fenced script, trimming the model's log to what is durable; then what follows from
        the records (an expiry job). A lost lease raises LeaseLostError: a worker cut off
        while it ran a save records nothing when it comes back."""
        await self.reconnect.call(
            self.dispatch.publish,
            owned.lease,
            op,
            outcome,
            trim_upto=self.durability.durable_seq(op.model_id),
            records=records,
        )
        if records and self.on_records is not None:
            # After the publish: a worker that dies in between leaves the expiry to the
            # housekeeper's sweep of rows past their expires_at.
            await self.reconnect.call(self.on_records, records)
        self.activity.ops_done += 1

    async def publish_batch(self, batch: Batch, outcomes: list[Outcome], *, started: bool) -> None:
        """Publish ops that ran as a batch in one round trip; drop the models whose lease was
        lost meanwhile."""
        publishes = [
            (owned.lease, op, outcome, self.durability.durable_seq(op.model_id))
            for (owned, op), outcome in zip(batch, outcomes, strict=True)
        ]
        published = await self.reconnect.call(
            self.dispatch.publish_batch, publishes, started=started
        )
        self.activity.ops_done += sum(published)
        self.ownership.drop_lost(
            [owned for (owned, _), ok in zip(batch, published, strict=True) if not ok]
        )

    async def _holds(self, op: Op) -> bool:
        """Whether the model's state already holds the op: it wrote the snapshot the state
        was restored from, and its workers died before publishing. Run, it only publishes
        the result kept with the snapshot, so it runs however often it was started."""
        point = await self.compute.run(self.durability.restore_point, op.model_id)
        return point is not None and op.seq <= point

    def _runs_now(self, owned: OwnedModel, start: Start | None) -> bool:
        """Whether an op start_batch decided on runs now: told to run, and its model still
        this worker's (not dropped for a lost lease)."""
        return (
            start is not None
            and start.run
            and self.ownership.owned.get(owned.lease.model_id) is owned
        )


def spent_outcome(error: str) -> Outcome:
    """What an op started too often is published as, instead of running it again."""
    return Outcome(status=JobStatus.FAILED, error=error, error_category=ErrorCategory.SERVER.value)


def _limited_by_model(
    decided: list[tuple[tuple[OwnedModel, Op], Start | None]],
) -> list[tuple[OwnedModel, list[Op], Start]]:
    """The ops held back for their tenant's limit, gathered per model in the batch's order,
    with the first of their model's Starts."""
    held: dict[str, tuple[OwnedModel, list[Op], Start]] = {}
    for (owned, op), start in decided:
        if start is not None and start.limited:
            held.setdefault(owned.lease.model_id, (owned, [], start))[1].append(op)
    return list(held.values())
