"""The worker's control loop: claim models, run their ops in order, publish, keep leases alive.

One asyncio loop, several tasks: the op reader (one blocking XREAD over every owned model's
log), the claimer (waits on the base model's offers), heartbeats (renew all leases in one
round trip, even while an op computes), the reaper (re-offers models of dead workers), the
recorder (Postgres write-behind). Compute runs on one dedicated thread, so none of those stall.

Every Redis call goes through the Reconnector: when Redis goes away (a restart), each task
waits for it and carries on where it was, so the worker survives the outage. The calls are
all safe to repeat (reads, fenced scripts, idempotent writes); fencing still decides what a
worker may write afterwards: a lease that lapsed meanwhile refuses the publish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from queue_tinker.errors import ErrorCategory, LeaseLostError, QueueTinkerError
from queue_tinker.queue.connection import Reconnector, describe
from queue_tinker.queue.dispatch import Dispatcher, Lease, Op, Outcome, Start
from queue_tinker.queue.records import RecordLog
from queue_tinker.queue.registry import WorkerRegistry
from queue_tinker.types import JobStatus
from queue_tinker.types.records import Record
from queue_tinker.workers.interface import Engine, OpResult
from queue_tinker.workers.runtime.owned import OwnedModel
from queue_tinker.workers.runtime.presence import Identity, registry_fields, worker_record
from queue_tinker.workers.runtime.scheduling import (
    QUANTUM_S,
    Scheduler,
    Turn,
    TurnKind,
    quantum_after,
)
from queue_tinker.workers.runtime.turns import SteppedTurns

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")

# Requests sent together reach the worker one enqueue round trip apart. Before a batch starts,
# wait while they keep arriving (each gap under GATHER_QUIET_S, GATHER_MAX_S in all), so they
# share one generation loop (or training pass) instead of the first one running alone and the
# rest after it. Training clients woken by one batch's results send their next steps as such a
# burst.
GATHER_QUIET_S = 0.005
GATHER_MAX_S = 0.05
# A busy worker still claims a waiting model once its offer is this old, so models owned by
# busy workers cannot starve the ones nobody has claimed yet; a model of a tenant with nothing
# running anywhere sooner, once idle workers (who wake at once) have had this long to take it.
CLAIM_WHEN_BUSY_AFTER_MS = 200
CLAIM_UNSERVED_WHEN_BUSY_AFTER_MS = 20
IDLE_OFFER_WAIT_MS = 1_000
READ_BLOCK_MS = 1_000
# An idle training run is handed back this soon (not after the whole linger time) when another
# run of its tenant waits for a slot of the tenant's training-runs limit.
PARKED_RELEASE_AFTER_S = 2.0


@dataclass
class WorkerConfig:
    base_model: str
    device: str
    lease_ttl_ms: int
    heartbeat_ms: int
    linger_ms: int
    worker_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:12]}")


class Worker(SteppedTurns):
    def __init__(
        self,
        config: WorkerConfig,
        engine: Engine,
        dispatcher: Dispatcher,
        registry: WorkerRegistry,
        records: RecordLog,
        on_records: Callable[[list[Record]], Awaitable[None]] | None = None,
        reconnect: Reconnector | None = None,
    ) -> None:
        self.config = config
        self.reconnect = reconnect or Reconnector(dispatcher.redis, config.worker_id)
        self.on_records = on_records  # e.g. schedule checkpoint expiry
        self.engine = engine
        self.dispatch = dispatcher
        self.registry = registry
        self.records = records
        # What runs next (fairness, order, batches): decided there, run here.
        self.schedule = Scheduler(engine)
        self.owned: dict[str, OwnedModel] = self.schedule.owned  # one dict, shared
        self.current: Op | None = None
        self.stopping = asyncio.Event()
        self._work = asyncio.Event()  # set when a backlog gained ops
        self._idle = asyncio.Event()
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qt-compute")
        self._control_cursor = b"$"
        self._stops: dict[str, str] = {}
        self.identity = Identity(
            config.worker_id, config.base_model, config.device, started_at=time.time()
        )
        self._ops_done = 0

    @property
    def id(self) -> str:
        return self.config.worker_id

    def stop(self) -> None:
        """Stop taking work; the op in progress finishes and is published. If Redis is away,
        wait for it no longer than a lease lives: by then the models are someone else's."""
        self.stopping.set()
        self._work.set()
        self.reconnect.give_up_after(self.config.lease_ttl_ms / 1000)

    async def run(self) -> None:
        await self._redis(self._beat)
        await self._redis(self.records.append, worker_record(self.identity))
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._heartbeat_loop(), name="heartbeat")
                group.create_task(self._read_loop(), name="reader")
                group.create_task(self._claim_loop(), name="claimer")
                group.create_task(self._reaper_loop(), name="reaper")
                await self._execute_loop()
                log.info("%s: stopping; handing back %d models", self.id, len(self.owned))
                # The loops end on `stopping` by themselves; this ends the reader's blocking
                # read. Cancelling them instead could catch a Redis call half-way, and
                # redis-py can then leave the task waiting forever (seen: a reader cancelled
                # in XREAD kept the worker from exiting).
                await self._redis(self.dispatch.wake)
        finally:
            await self._shutdown()
            await self.reconnect.close()

    async def _redis(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """A Redis call that rides out an outage: repeated once Redis answers again."""
        return await self.reconnect.call(fn, *args, **kwargs)

    # --- executing ops ---------------------------------------------------------------------
    async def _execute_loop(self) -> None:
        """Turns: one unit of work (an op, an inline batch, a training batch), then one quantum
        of the stepped ops in flight (decode steps for as long as that unit took, QUANTUM_S at
        least), and so on; stepped ops join at every turn. So an op waits behind a long sample
        for at most one quantum, and a sample behind a long queue of ops for at most one op
        per quantum. What each turn runs is the Scheduler's decision
        (workers/runtime/scheduling.py)."""
        while not self.stopping.is_set():
            await self._join_stepped()
            turn = self.schedule.next_turn(time.monotonic())
            if turn is None:
                await self._between_turns()
                continue
            self._idle.clear()
            if turn.kind is TurnKind.JOIN:
                continue  # arrived just now: it joins at the top of the next turn
            began = time.perf_counter()
            await self._run_turn(turn)
            if self._stepping():
                await self._run_quantum(quantum_after(time.perf_counter() - began))
        while self._stepping():  # stopping: what was started finishes and is published
            await self._run_quantum(QUANTUM_S)

    async def _between_turns(self) -> None:
        """Nothing runnable: a quantum of the stepped ops, or wait for work (and hand back
        models idle long enough)."""
        if self._stepping():
            self._idle.clear()
            await self._run_quantum(QUANTUM_S)
            return
        self._idle.set()
        self._work.clear()
        wait_s = self.schedule.idle_wait_s(time.monotonic(), self._linger_check_s())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._work.wait(), timeout=wait_s)
        await self._release_lingering()

    async def _run_turn(self, turn: Turn) -> None:
        if turn.kind is TurnKind.REPLAY and turn.op is not None:
            await self._replay(turn.owned, turn.op)
        elif turn.kind is TurnKind.INLINE:
            await self._run_inline_batch(self.schedule.take_inline_batch(time.monotonic()))
        elif turn.kind is TurnKind.BATCH:
            await self._gather()
            await self._run_engine_batch(self.schedule.take_engine_batch(time.monotonic()))
        elif turn.kind is TurnKind.ALONE and turn.op is not None:
            await self._run_op(turn.owned, turn.op)

    def _hold_back(self, owned: OwnedModel, ops: list[Op], start: Start) -> None:
        self.schedule.hold_back(owned, ops, start.retry_ms, time.monotonic())

    async def _run_op(self, owned: OwnedModel, op: Op) -> None:
        lease = owned.lease
        try:
            start = await self._redis(self.dispatch.start, lease, op)
            if start.limited:
                self._hold_back(owned, [op], start)
                return
            if not start.run:
                return  # already finished (by an earlier owner, or cancelled)
            self.current = op
            outcome, records = await self._compute_outcome(op, inline=False)
            for record in records:  # durable before the user hears of it
                await self._redis(self.records.append, record)
            if records and self.on_records is not None:
                await self._redis(self.on_records, records)
            # Computed once; only the publish is repeated after an outage (the script is
            # fenced, and finds a job it already published terminal).
            await self._redis(
                self.dispatch.publish,
                lease,
                op,
                outcome,
                trim_upto=self.engine.durable_seq(op.model_id),
            )
            self._ops_done += 1
        except LeaseLostError:
            # Not a model claimed again meanwhile (after an outage, the heartbeat may have
            # dropped it and the claimer taken it back under a new epoch while this publish
            # waited for Redis): only this ownership ended.
            self._drop_lost([owned])
        finally:
            self.current = None
            owned.idle_since = time.monotonic()

    async def _replay(self, owned: OwnedModel, op: Op) -> None:
        """Re-run an op an earlier owner published, to rebuild the model's state on top of its
        snapshot; the result was delivered then and is not published again."""
        outcome, _ = await self._compute_outcome(op, inline=False)
        if outcome.status is JobStatus.FAILED and outcome.error_category != "user":
            log.warning(
                "%s: replay of %s (seq %d) failed: %s", self.id, op.model_id, op.seq, outcome.error
            )
        owned.idle_since = time.monotonic()

    async def _run_inline_batch(self, batch: list[tuple[OwnedModel, Op]]) -> None:
        outcomes = [(await self._compute_outcome(op, inline=True))[0] for _, op in batch]
        await self._publish_batch(batch, outcomes, started=False)
        for owned, _ in batch:
            owned.idle_since = time.monotonic()

    async def _publish_batch(
        self, batch: list[tuple[OwnedModel, Op]], outcomes: list[Outcome], *, started: bool
    ) -> None:
        """Publish ops that ran as a batch in one round trip; drop the models whose lease was
        lost meanwhile."""
        publishes = [
            (owned.lease, op, outcome, self.engine.durable_seq(op.model_id))
            for (owned, op), outcome in zip(batch, outcomes, strict=True)
        ]
        published = await self._redis(self.dispatch.publish_batch, publishes, started=started)
        self._ops_done += sum(published)
        self._drop_lost([owned for (owned, _), ok in zip(batch, published, strict=True) if not ok])

    def _drop_lost(self, lost: list[OwnedModel]) -> None:
        for owned in lost:  # a model listed twice is dropped once
            model_id = owned.lease.model_id
            if self.owned.get(model_id) is owned:  # not already dropped, nor claimed anew
                log.warning("%s: lost the lease on %s; dropping it", self.id, model_id)
                self._drop(model_id)

    async def _gather(self) -> None:
        """Give ops that are on their way a few milliseconds to join the batch; no longer than
        until every owned model's share of it is complete (a lone training run's step has
        arrived whole: nothing else could join)."""
        deadline = time.monotonic() + GATHER_MAX_S
        while not self.stopping.is_set() and time.monotonic() < deadline:
            if self.schedule.batch_complete(time.monotonic()):
                return
            self._work.clear()
            try:
                await asyncio.wait_for(self._work.wait(), GATHER_QUIET_S)
            except TimeoutError:
                return  # nothing new within the quiet gap: the burst is over

    async def _start_batch(self, batch: list[tuple[OwnedModel, Op]]) -> list[tuple[OwnedModel, Op]]:
        """Mark the ops running (one round trip); the ones to run. Models whose lease was lost
        are dropped; ops over their tenant's limit go back to their backlog; ops already
        finished (cancelled) are skipped."""
        # One decision per op: a Start, or None where the model's lease was lost.
        starts: list[Start | None] = await self._redis(
            self.dispatch.start_batch, [(o.lease, op) for o, op in batch]
        )
        decided = list(zip(batch, starts, strict=True))
        self._drop_lost([owned for (owned, _), start in decided if start is None])
        for owned, ops, start in _limited_by_model(decided):
            self._hold_back(owned, ops, start)
        # A sample asked to stop while a dead owner ran it fails as asked: it leaves the
        # engine before its first step (turns.py _engine_step), as a stop from the control
        # stream would have made it leave on the first owner.
        self._stops.update(
            {
                op.job_id: start.stop_reason
                for (_, op), start in decided
                if start and start.stop_reason
            }
        )
        return [(owned, op) for (owned, op), start in decided if self._runs_now(owned, start)]

    def _runs_now(self, owned: OwnedModel, start: Start | None) -> bool:
        """Whether an op start_batch decided on runs now: told to run, and its model still
        this worker's (not dropped for a lost lease)."""
        return start is not None and start.run and self.owned.get(owned.lease.model_id) is owned

    async def _run_engine_batch(self, batch: list[tuple[OwnedModel, Op]]) -> None:
        runnable = await self._start_batch(batch)
        if runnable:
            self.current = runnable[0][1]
            ops = [op for _, op in runnable]
            try:
                results = await asyncio.get_running_loop().run_in_executor(
                    self._compute, self.engine.execute_batch, ops
                )
            except Exception as exc:  # the engine's own bug: fail the batch, keep the worker
                results = [exc] * len(ops)
            finally:
                self.current = None
            outcomes = [self._outcome(op, r) for op, r in zip(ops, results, strict=True)]
            await self._publish_batch(runnable, outcomes, started=True)
        for owned, _ in batch:
            owned.idle_since = time.monotonic()

    async def _compute_outcome(self, op: Op, *, inline: bool) -> tuple[Outcome, list[Record]]:
        loop = asyncio.get_running_loop()
        try:
            if inline:
                result = self.engine.execute(op)
            else:
                result = await loop.run_in_executor(self._compute, self.engine.execute, op)
        except Exception as exc:
            return self._outcome(op, exc), []
        return self._outcome(op, result), result.records

    def _outcome(self, op: Op, result: OpResult | Exception) -> Outcome:
        if isinstance(result, OpResult):
            return Outcome(
                status=JobStatus.DONE,
                result=result.result,
                metrics=result.metrics,
                tokens=result.tokens,
            )
        detail = "".join(traceback.format_exception(result))
        if isinstance(result, QueueTinkerError):
            user = result.category is ErrorCategory.USER
            return Outcome(
                status=JobStatus.FAILED,
                error=result.message,
                error_category=result.category.value,
                error_detail="" if user else detail,
            )
        log.error("%s: op %s (%s) failed\n%s", self.id, op.job_id, op.kind, detail)
        return Outcome(
            status=JobStatus.FAILED,
            error=f"{type(result).__name__}: {result}",
            error_category=ErrorCategory.SERVER.value,
            error_detail=detail,
        )

    # --- owning models ---------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        """Take models offered to this base: an idle worker the fairest offer at once, a busy
        one only offers nobody else took (lua/take_offer.lua)."""
        # An offer taken just before an outage whose claim never got through is not lost:
        # the model has pending ops and no lease, so a reaper offers it again.
        cursor = await self._redis(self.dispatch.offer_bell_cursor)
        while not self.stopping.is_set():
            busy = not self._idle.is_set()
            model_id = await self._redis(
                self.dispatch.take_offer,
                min_age_ms=CLAIM_WHEN_BUSY_AFTER_MS if busy else 0,
                unserved_min_age_ms=CLAIM_UNSERVED_WHEN_BUSY_AFTER_MS if busy else 0,
            )
            if model_id is None:
                if not busy:
                    cursor = await self._redis(
                        self.dispatch.wait_for_offer, cursor, IDLE_OFFER_WAIT_MS
                    )
                    continue
                # Busy: look again when the offers there come due, or soon after a new one
                # (idle workers, woken by the same bell, get a head start).
                new = await self._redis(
                    self.dispatch.wait_for_offer, cursor, CLAIM_WHEN_BUSY_AFTER_MS
                )
                if new != cursor:
                    await self._pause(CLAIM_UNSERVED_WHEN_BUSY_AFTER_MS / 1000)
                cursor = new
                continue
            if model_id in self.owned or self.stopping.is_set():
                continue
            lease = await self._redis(self.dispatch.claim, model_id)
            if lease is not None:
                self.owned[model_id] = await self._adopt(lease)
                # Busy from now on (its ops are on their way): the next offers go to the
                # workers that are still idle, so models spread over the fleet.
                self._idle.clear()
                await self._redis(self.dispatch.wake)

    async def _adopt(self, lease: Lease) -> OwnedModel:
        """A newly claimed model, with the logged ops between its saved state and the last
        published one queued for replay (an earlier owner died after its last snapshot)."""
        owned = OwnedModel(lease=lease, read_seq=lease.done_seq)
        restored = await self._on_compute(self.engine.restore_point, lease.model_id)
        if restored is not None and restored < lease.done_seq:
            replay = await self._redis(
                self.dispatch.read_range, lease.model_id, restored, lease.done_seq
            )
            log.info(
                "%s: %s resumes from seq %d; replaying %d ops",
                self.id,
                lease.model_id,
                restored,
                len(replay),
            )
            owned.backlog.extend(replay)
            owned.replay_upto = lease.done_seq
        return owned

    async def _release_lingering(self) -> None:
        """Hand back the models idle for the linger time, or for PARKED_RELEASE_AFTER_S when
        another run of their tenant waits for a slot of the tenant's limit."""
        linger_s = self.config.linger_ms / 1000
        now = time.monotonic()
        idle = self._idle_models(now, min(linger_s, PARKED_RELEASE_AFTER_S))
        if not idle:
            return
        waiting = await self._parked_tenants(idle, now, linger_s)
        for model_id, owned in idle:
            if not _should_release(now - owned.idle_since, linger_s, owned.tenant in waiting):
                continue
            if self.owned.get(model_id) is not owned:
                continue  # dropped while we asked
            await self._persist(model_id)
            released = await self._redis(self.dispatch.release, owned.lease)
            if released != 0:  # 0: ops arrived meanwhile, keep it
                self._drop(model_id)

    def _idle_models(self, now: float, idle_s: float) -> list[tuple[str, OwnedModel]]:
        """The owned models with nothing queued or running for at least `idle_s`."""
        return [
            (m, o)
            for m, o in self.owned.items()
            if not o.backlog and not o.inflight and now - o.idle_since >= idle_s
        ]

    async def _parked_tenants(
        self, idle: list[tuple[str, OwnedModel]], now: float, linger_s: float
    ) -> set[str]:
        """The tenants of `idle` with runs parked for a slot; Redis is asked only while some
        of them are still within the linger time (past it they go whatever the answer)."""
        if not any(now - o.idle_since < linger_s for _, o in idle):
            return set()
        return await self._redis(self.dispatch.parked_tenants, {o.tenant for _, o in idle})

    async def _persist(self, model_id: str) -> None:
        """Write the model's state to storage before letting it go: the next owner starts
        from there. A failure is logged and the lease is released all the same: nothing the
        user was told is lost, because the model's log is trimmed only up to the last
        snapshot written (engine.durable_seq), so the next owner replays every op after it,
        published ones included (docs/operations.md). Keeping the lease instead would hold
        the model on a worker that cannot write its state."""
        try:
            await self._on_compute(self.engine.persist, model_id)
        except Exception:
            log.exception(
                "%s: persisting %s failed; releasing it anyway: its next owner replays the "
                "ops after its last snapshot",
                self.id,
                model_id,
            )

    def _linger_check_s(self) -> float:
        return max(0.05, min(1.0, self.config.linger_ms / 1000))

    def _drop(self, model_id: str) -> None:
        owned = self.owned.pop(model_id, None)
        if owned is not None:
            self.schedule.forget(owned)
        # On the compute thread, queued behind the op in progress: an engine's state is only
        # ever touched from that one thread.
        self._compute.submit(self.engine.drop, model_id)

    async def _on_compute(self, fn: Callable[[str], T], model_id: str) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, model_id)

    # --- reading ---------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while not self.stopping.is_set():
            cursors = {m: o.read_seq for m, o in self.owned.items()}
            ops, self._control_cursor, control = await self._redis(
                self.dispatch.read, cursors, self._control_cursor, READ_BLOCK_MS
            )
            # Seen by the execute loop between two decode quanta (turns.py _engine_step).
            self._stops.update(control.stops)
            if "drain" in control.commands:
                log.info("%s: draining: finishing the op in progress, handing models back", self.id)
                self.stop()
            for op in ops:
                owned = self.owned.get(op.model_id)
                if owned is None or op.seq <= owned.read_seq:
                    continue  # dropped meanwhile, or already queued locally
                owned.backlog.append(op)
                owned.read_seq = op.seq
            if ops:
                self._work.set()

    # --- liveness --------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        beats = 0
        while not await self._pause(self.config.heartbeat_ms / 1000):
            owned = list(self.owned.values())
            # After an outage longer than a lease, the leases that lapsed come back False
            # here and their models are dropped (another worker may hold them by now).
            renewed = await self._redis(self.dispatch.renew, [o.lease for o in owned])
            for o, ok in zip(owned, renewed, strict=True):
                if not ok and self.owned.get(o.lease.model_id) is o:
                    log.warning("%s: lease on %s lapsed; dropping it", self.id, o.lease.model_id)
                    self._drop(o.lease.model_id)
            await self._redis(self._beat)
            beats += 1
            if beats % 10 == 0:
                await self._redis(self.records.append, worker_record(self.identity))

    async def _reaper_loop(self) -> None:
        period = self.config.lease_ttl_ms / 2000
        while not await self._pause(period * random.uniform(0.75, 1.25)):
            await self._redis(self.dispatch.offer_orphans)

    async def _pause(self, seconds: float) -> bool:
        """Sleep, ending early when the worker stops; True once it is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)
        return self.stopping.is_set()

    async def _beat(self) -> None:
        fields = registry_fields(
            self.identity,
            owned=len(self.owned),
            ops_done=self._ops_done,
            current=self.current,
            stopping=self.stopping.is_set(),
            device_memory_bytes=self.engine.device_memory_bytes(),
            resident=self.engine.resident(),
        )
        await self.registry.beat(self.id, fields, ttl_ms=self.config.lease_ttl_ms * 3)

    async def _shutdown(self) -> None:
        """Hand every model back (offering those with pending ops) and deregister."""
        for owned in list(self.owned.values()):
            await self._persist(owned.lease.model_id)
            try:
                await self.dispatch.release(owned.lease, force=True)
            except Exception as exc:  # Redis away: the lease lapses by itself within its TTL
                log.warning(
                    "%s: could not release %s (%s); its lease lapses in %d ms",
                    self.id,
                    owned.lease.model_id,
                    describe(exc),
                    self.config.lease_ttl_ms,
                )
        self.owned.clear()
        try:  # the registry entry expires by itself; the record is the dashboard's history
            await self.records.append(worker_record(self.identity, stopped=True))
            await self.registry.remove(self.id)
        except Exception as exc:
            log.warning("%s: could not deregister (%s)", self.id, describe(exc))
        self._compute.shutdown(wait=True)


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


def _should_release(idle_for: float, linger_s: float, parked: bool) -> bool:
    """An idle model goes after the linger time, or sooner when its tenant has a run parked."""
    return idle_for >= linger_s or (parked and idle_for >= PARKED_RELEASE_AFTER_S)
