"""One unit of work at a time, as the scheduler picks it: an op replayed on top of a restored
snapshot, a batch of inline ops, a batch of training steps, or an op alone; each started,
computed and published (runtime/fenced.py), then its models marked idle from now."""

from __future__ import annotations

import logging
import time

from queue_tinker.errors import LeaseLostError
from queue_tinker.queue.dispatch.dispatcher import Op, Outcome
from queue_tinker.types import JobStatus
from queue_tinker.types.service.records import Record
from queue_tinker.workers.interface import BatchCompute, OpCompute
from queue_tinker.workers.runtime.arrivals import Arrivals
from queue_tinker.workers.runtime.compute import ComputeThread, outcome_of
from queue_tinker.workers.runtime.fenced import Batch, FencedWrites
from queue_tinker.workers.runtime.owned import OwnedModel
from queue_tinker.workers.runtime.ownership import Ownership
from queue_tinker.workers.runtime.presence import Activity
from queue_tinker.workers.runtime.scheduling import Scheduler, Turn, TurnKind

log = logging.getLogger(__name__)


class Turns:
    def __init__(
        self,
        worker_id: str,
        schedule: Scheduler,
        compute: ComputeThread,
        engine: OpCompute,
        batches: BatchCompute,
        fenced: FencedWrites,
        ownership: Ownership,
        arrivals: Arrivals,
        activity: Activity,
    ) -> None:
        self.worker_id = worker_id
        self.schedule = schedule
        self.compute = compute
        self.engine = engine
        self.batches = batches
        self.fenced = fenced
        self.ownership = ownership
        self.arrivals = arrivals
        self.activity = activity

    async def run(self, turn: Turn) -> None:
        if turn.kind is TurnKind.REPLAY and turn.op is not None:
            await self._replay(turn.owned, turn.op)
        elif turn.kind is TurnKind.INLINE:
            await self._run_inline(self.schedule.take_inline_batch(time.monotonic()))
        elif turn.kind is TurnKind.BATCH:
            await self.arrivals.gather()
            await self._run_batch(self.schedule.take_engine_batch(time.monotonic()))
        elif turn.kind is TurnKind.ALONE and turn.op is not None:
            await self._run_alone(turn.owned, turn.op)

    async def _run_alone(self, owned: OwnedModel, op: Op) -> None:
        try:
            if not await self.fenced.start(owned, op):
                return  # over its tenant's limit (back in its backlog), finished, or lost
            self.activity.current = op
            outcome, records = await self._outcome(op, inline=False)
            # Computed once; only the writes are repeated after an outage.
            await self.fenced.publish(owned, op, outcome, records)
        except LeaseLostError:
            # Not a model claimed again meanwhile (after an outage, the heartbeat may have
            # dropped it and the claimer taken it back under a new epoch while this publish
            # waited for Redis): only this ownership ended.
            self.ownership.drop_lost([owned])
        finally:
            self.activity.current = None
            owned.idle_since = time.monotonic()

    async def _replay(self, owned: OwnedModel, op: Op) -> None:
        """Re-run an op an earlier owner published, to rebuild the model's state on top of its
        snapshot; the result was delivered then and is not published again."""
        outcome, _ = await self._outcome(op, inline=False)
        if outcome.status is JobStatus.FAILED and outcome.error_category != "user":
            log.warning(
                "%s: replay of %s (seq %d) failed: %s",
                self.worker_id,
                op.model_id,
                op.seq,
                outcome.error,
            )
        owned.idle_since = time.monotonic()

    async def _run_inline(self, batch: Batch) -> None:
        outcomes = [(await self._outcome(op, inline=True))[0] for _, op in batch]
        await self.fenced.publish_batch(batch, outcomes, started=False)
        for owned, _ in batch:
            owned.idle_since = time.monotonic()

    async def _run_batch(self, batch: Batch) -> None:
        # Only samples can be asked to stop, and they are stepped, never in this batch.
        runnable, _ = await self.fenced.start_batch(batch)
        if runnable:
            self.activity.current = runnable[0][1]
            ops = [op for _, op in runnable]
            try:
                results = await self.compute.run(self.batches.execute_batch, ops)
            except Exception as exc:  # the engine's own bug: fail the batch, keep the worker
                results = [exc] * len(ops)
            finally:
                self.activity.current = None
            outcomes = [
                outcome_of(op, r, self.worker_id) for op, r in zip(ops, results, strict=True)
            ]
            await self.fenced.publish_batch(runnable, outcomes, started=True)
        for owned, _ in batch:
            owned.idle_since = time.monotonic()

    async def _outcome(self, op: Op, *, inline: bool) -> tuple[Outcome, list[Record]]:
        """The op run by the engine (on the event loop when inline, else on the compute
        thread): its outcome and the records it produced."""
        try:
            if inline:
                result = self.engine.execute(op)
            else:
                result = await self.compute.run(self.engine.execute, op)
        except Exception as exc:
            return outcome_of(op, exc, self.worker_id), []
        return outcome_of(op, result, self.worker_id), result.records
