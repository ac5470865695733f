"""The worker's turns with stepped ops (sampling's decode loop): join them, run quanta of
decode steps between other work, publish them in each model's seq order.

A mixin of workers/runtime/worker.py's Worker, split out to keep that file readable: it uses the
worker's owned models, engine, compute thread, gather, start and publish.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from queue_tinker.queue.dispatch import Op, Outcome
from queue_tinker.workers.interface import Engine, OpResult
from queue_tinker.workers.runtime.owned import OwnedModel
from queue_tinker.workers.runtime.scheduling import Scheduler


class SteppedTurns:
    """Joining, quanta and in-order publication of stepped ops, for the Worker."""

    owned: dict[str, OwnedModel]
    schedule: Scheduler
    engine: Engine
    stopping: asyncio.Event
    current: Op | None
    _compute: ThreadPoolExecutor
    # Running stepped ops to stop (job id -> why), as the op reader got them from the
    # worker's control stream; handed to the engine before its next step.
    _stops: dict[str, str]

    if TYPE_CHECKING:  # the Worker's own, used here

        async def _gather(self) -> None: ...

        async def _start_batch(
            self, batch: list[tuple[OwnedModel, Op]]
        ) -> list[tuple[OwnedModel, Op]]: ...

        def _outcome(self, op: Op, result: OpResult | Exception) -> Outcome: ...

        async def _publish_batch(
            self, batch: list[tuple[OwnedModel, Op]], outcomes: list[Outcome], *, started: bool
        ) -> None: ...

    def _stepping(self) -> bool:
        return self.schedule.stepping()

    async def _join_stepped(self) -> None:
        """Start every owned model's leading stepped ops (samples) and hand them to the engine:
        they join its loop at the next quantum. Nothing is computed here, so it happens at
        every turn, whoever's turn it is."""
        if not self.schedule.any_stepped_head(time.monotonic()):
            return
        if not self._stepping():
            await self._gather()  # a burst sent together starts the loop together
        batch = self.schedule.take_stepped(time.monotonic())
        if not batch:
            return
        runnable = await self._start_batch(batch)
        for owned, op in runnable:
            owned.inflight[op.seq] = (op, None)
        if runnable:
            await asyncio.get_running_loop().run_in_executor(
                self._compute, self.engine.join, [op for _, op in runnable]
            )

    async def _run_quantum(self, budget_s: float) -> None:
        """One quantum of the engine's stepped ops. The engine hands back control whenever an
        op finishes, so results go out at once (each model's in seq order); the quantum then
        goes on, with any samples that arrived meanwhile joining, until its time is used."""
        deadline = time.perf_counter() + budget_s
        while True:
            await self._engine_step(deadline - time.perf_counter())
            if self.stopping.is_set() or not self._stepping() or time.perf_counter() >= deadline:
                return
            await self._join_stepped()

    async def _engine_step(self, budget_s: float) -> None:
        """engine.step on the compute thread; publish the ops whose turn it is."""
        waiting = self._unfinished_stepped()
        self.current = waiting[0] if waiting else None
        stops, self._stops = self._stops, {}
        try:
            finished, stepping = await asyncio.get_running_loop().run_in_executor(
                self._compute, self._quantum, budget_s, stops
            )
            if not finished and not stepping:
                raise RuntimeError(
                    f"the engine has no stepped op in progress, but {len(waiting)} are unfinished"
                )
        except Exception as exc:  # the engine's own bug: fail what is in flight, keep going
            finished = [(op, exc) for op in waiting]
        finally:
            self.current = None
        self._note_finished(finished)
        await self._publish_in_order()

    def _unfinished_stepped(self) -> list[Op]:
        """The stepped ops in flight without an outcome yet, model by model."""
        return [op for o in self.owned.values() for op, out in o.inflight.values() if out is None]

    def _note_finished(self, finished: list[tuple[Op, OpResult | Exception]]) -> None:
        """Each finished op's outcome, kept with it in flight until its turn to be published."""
        for op, result in finished:
            owned = self.owned.get(op.model_id)
            if owned is not None and op.seq in owned.inflight:  # else dropped meanwhile
                owned.inflight[op.seq] = (op, self._outcome(op, result))

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
            await self._publish_batch(ready, outcomes, started=True)

    def _quantum(
        self, budget_s: float, stops: dict[str, str]
    ) -> tuple[list[tuple[Op, OpResult | Exception]], bool]:
        """On the compute thread: the stops, one engine step, and whether stepped ops remain.
        A stopped op comes out of this step, so it is published at once (in its model's
        order) and its rows free up for the others."""
        if stops:
            self.engine.stop(stops)
        return self.engine.step(budget_s), self.engine.stepping()
