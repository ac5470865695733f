"""The stepped ops in flight (sampling's decode loop), as the worker drives them: started and
handed to the engine at every turn, run a quantum of steps at a time between other work, and
published in each model's seq order, so a model's done_seq never passes an op still running."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from queue_tinker.queue.dispatch.dispatcher import Op, Outcome
from queue_tinker.queue.ops.inflight import InflightWeights
from queue_tinker.queue.outage import REDIS_DOWN
from queue_tinker.workers.interface import ResultOrError, SteppedCompute
from queue_tinker.workers.runtime.arrivals import Arrivals
from queue_tinker.workers.runtime.compute import ComputeThread, outcome_of
from queue_tinker.workers.runtime.fenced import FencedWrites
from queue_tinker.workers.runtime.owned import OwnedModel
from queue_tinker.workers.runtime.presence import Activity
from queue_tinker.workers.runtime.scheduling import Scheduler


class SteppedOps:
    def __init__(
        self,
        worker_id: str,
        schedule: Scheduler,
        compute: ComputeThread,
        engine: SteppedCompute,
        fenced: FencedWrites,
        arrivals: Arrivals,
        activity: Activity,
        stopping: asyncio.Event,
        inflight: InflightWeights,
    ) -> None:
        self.worker_id = worker_id
        self.schedule = schedule
        self.owned: dict[str, OwnedModel] = schedule.owned
        self.compute = compute
        self.engine = engine
        self.fenced = fenced
        self.arrivals = arrivals
        self.activity = activity
        self.stopping = stopping
        self.inflight = inflight
        # The training runs whose inflight weights joined ops follow, as the engine said
        # after its last join or step: their newest weights are read before every step.
        self._followed: set[str] = set()
        # Running stepped ops to stop (job id -> why), from the worker's control stream or a
        # start that found a stop asked of a dead owner's op: handed to the engine before its
        # next step.
        self._stops: dict[str, str] = {}

    def busy(self) -> bool:
        return self.schedule.stepping()

    def stop_later(self, reasons: Mapping[str, str]) -> None:
        self._stops.update(reasons)

    async def join_heads(self) -> None:
        """Start every owned model's leading stepped ops (samples) and hand them to the engine:
        they join its loop at the next quantum. Nothing is computed here, so it happens at
        every turn, whoever's turn it is."""
        if not self.schedule.any_stepped_head(time.monotonic()):
            return
        if not self.busy():
            await self.arrivals.gather()  # a burst sent together starts the loop together
        batch = self.schedule.take_stepped(time.monotonic())
        if not batch:
            return
        runnable, stops = await self.fenced.start_batch(batch)
        # A sample asked to stop while a dead owner ran it fails as asked: it leaves the
        # engine before its first step, as a stop from the control stream would have made it
        # leave on the first owner.
        self.stop_later(stops)
        for owned, op in runnable:
            owned.inflight[op.seq] = (op, None)
        if runnable:
            self._followed = await self.compute.run(self._join, [op for _, op in runnable])

    async def quantum(self, budget_s: float) -> None:
        """One quantum of the engine's stepped ops. The engine hands back control whenever an
        op finishes, so results go out at once (each model's in seq order); the quantum then
        goes on, with any samples that arrived meanwhile joining, until its time is used."""
        deadline = time.perf_counter() + budget_s
        while True:
            await self._step(deadline - time.perf_counter())
            if self.stopping.is_set() or not self.busy() or time.perf_counter() >= deadline:
                return
            await self.join_heads()

    async def _step(self, budget_s: float) -> None:
        """The stops, then engine.step on the compute thread; publish the ops whose turn it
        is."""
        waiting = self._unfinished()
        self.activity.current = waiting[0] if waiting else None
        stops, self._stops = self._stops, {}
        newest = await self._newest_inflight()
        try:
            finished, stepping, self._followed = await self.compute.run(
                self._stops_and_step, budget_s, stops, newest
            )
            if not finished and not stepping:
                raise RuntimeError(
                    f"the engine has no stepped op in progress, but {len(waiting)} are unfinished"
                )
        except Exception as exc:  # the engine's own bug: fail what is in flight, keep going
            finished = [(op, exc) for op in waiting]
        finally:
            self.activity.current = None
        self._note_finished(finished)
        await self._publish_in_order()

    def _join(self, ops: list[Op]) -> set[str]:
        """On the compute thread: hand ops to the engine; the runs their weights follow."""
        self.engine.join(ops)
        return self.engine.followed()

    async def _newest_inflight(self) -> dict[str, str]:
        """The newest inflight weights of the runs joined ops follow (one round trip; none
        while Redis is away: the ops go on with the weights they have)."""
        if not self._followed:
            return {}
        try:
            return await self.inflight.paths(self._followed)
        except REDIS_DOWN:
            return {}

    def _stops_and_step(
        self, budget_s: float, stops: dict[str, str], newest: dict[str, str]
    ) -> tuple[list[tuple[Op, ResultOrError]], bool, set[str]]:
        """On the compute thread: the stops, the newest inflight weights, one engine step;
        whether stepped ops remain, and the runs they follow. A stopped op comes out of this
        step, so it is published at once (in its model's order) and its rows free up for
        the others."""
        if stops:
            self.engine.stop(stops)
        if newest:
            self.engine.follow(newest)
        finished = self.engine.step(budget_s)
        return finished, self.engine.stepping(), self.engine.followed()

    def _unfinished(self) -> list[Op]:
        """The stepped ops in flight without an outcome yet, model by model."""
        return [op for o in self.owned.values() for op, out in o.inflight.values() if out is None]

    def _note_finished(self, finished: list[tuple[Op, ResultOrError]]) -> None:
        """Each finished op's outcome, kept with it in flight until its turn to be published."""
        for op, result in finished:
            owned = self.owned.get(op.model_id)
            if owned is not None and op.seq in owned.inflight:  # else dropped meanwhile
                owned.inflight[op.seq] = (op, outcome_of(op, result, self.worker_id))

    async def _publish_in_order(self) -> None:
        """Publish every model's finished stepped ops up to its first unfinished one: a
        model's done_seq must never pass an op that is still running (a new owner reads the
        log after it)."""
        ready: list[tuple[OwnedModel, Op]] = []
        outcomes: list[Outcome] = []
        for owned in self.owned.values():
            while owned.inflight:
                seq, (op, outcome) = next(iter(owned.inflight.items()))
                if outcome is None:
                    break
                del owned.inflight[seq]
                ready.append((owned, op))
                outcomes.append(outcome)
                owned.idle_since = time.monotonic()
        if ready:
            await self.fenced.publish_batch(ready, outcomes, started=True)
