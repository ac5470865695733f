"""The worker: claim models, run their ops in order, publish, keep leases alive.

One asyncio loop, several tasks: the execute loop (turns of work and quanta of the decode loop),
the op reader (one blocking XREAD over every owned model's log and the worker's control
stream), the claimer (waits on the base model's offers), heartbeats (renew all leases in one
round trip, even while an op computes) and the reaper (re-offers models of dead workers).
Compute runs on one dedicated thread, so none of them stall. The parts, each in its module:
what runs next (scheduling.py), one unit of work (turns.py), the decode loop's ops
(stepped.py), the fenced writes of both (fenced.py), the models held (ownership.py).

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
import uuid
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from queue_tinker.config.queue import QueueConfig
from queue_tinker.health import HealthFile
from queue_tinker.queue.outage import describe
from queue_tinker.workers.interface import Engine
from queue_tinker.workers.runtime.arrivals import Arrivals
from queue_tinker.workers.runtime.compute import ComputeThread
from queue_tinker.workers.runtime.fenced import FencedWrites
from queue_tinker.workers.runtime.ownership import Ownership
from queue_tinker.workers.runtime.presence import Activity, Identity, registry_fields, worker_record
from queue_tinker.workers.runtime.queue_link import QueueLink
from queue_tinker.workers.runtime.scheduling import QUANTUM_S, Scheduler, TurnKind, quantum_after
from queue_tinker.workers.runtime.stepped import SteppedOps
from queue_tinker.workers.runtime.turns import Turns

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")

# A busy worker still claims a waiting model once its offer is this old, so models owned by
# busy workers cannot starve the ones nobody has claimed yet; a model of a tenant with nothing
# running anywhere sooner, once idle workers (who wake at once) have had this long to take it.
CLAIM_WHEN_BUSY_AFTER_MS = 200
CLAIM_UNSERVED_WHEN_BUSY_AFTER_MS = 20
IDLE_OFFER_WAIT_MS = 1_000
OP_READ_BLOCK_MS = 1_000


def new_worker_id() -> str:
    return f"w-{uuid.uuid4().hex[:12]}"


class Worker:
    def __init__(
        self, config: QueueConfig, identity: Identity, engine: Engine, link: QueueLink
    ) -> None:
        """`config`: the queue's settings (leases, heartbeats, lingering), handed over whole;
        `link`: the worker's one connection to Redis and the queue's parts over it."""
        self.config = config
        self.identity = identity
        self.reconnect = link.reconnect
        self.engine = engine
        self.dispatch = dispatcher = link.dispatcher
        self.registry = link.registry
        self.records = link.records
        self.stopping = asyncio.Event()
        self._idle = asyncio.Event()
        self._control_cursor = b"$"
        self.activity = Activity()
        self.health = HealthFile(config.health_file)
        # What runs next (fairness, order, batches) is decided there, run by the parts below.
        self.schedule = Scheduler(engine.rules)
        self.compute = ComputeThread()
        self.arrivals = Arrivals(self.schedule, self.stopping)
        self.ownership = Ownership(
            self.id,
            config.linger_ms,
            config.lease_ttl_ms,
            dispatcher,
            self.reconnect,
            self.schedule,
            self.compute,
            engine.durability,
        )
        self.fenced = FencedWrites(
            dispatcher,
            self.reconnect,
            link.expiry,
            self.ownership,
            self.schedule,
            engine.durability,
            self.activity,
            self.compute,
        )
        self.turns = Turns(
            self.id,
            self.schedule,
            self.compute,
            engine.ops,
            engine.batches,
            self.fenced,
            self.ownership,
            self.arrivals,
            self.activity,
        )
        self.stepped = SteppedOps(
            self.id,
            self.schedule,
            self.compute,
            engine.stepped,
            self.fenced,
            self.arrivals,
            self.activity,
            self.stopping,
            link.inflight,
        )

    @property
    def id(self) -> str:
        return self.identity.worker_id

    def stop(self) -> None:
        """Stop taking work; the op in progress finishes and is published. If Redis is away,
        wait for it no longer than a lease lives: by then the models are someone else's."""
        self.stopping.set()
        self.arrivals.ring()
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
                log.info("%s: stopping; handing back %d models", self.id, len(self.schedule.owned))
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

    # --- the main step ---------------------------------------------------------------------
    async def _execute_loop(self) -> None:
        """Decide, run, publish: one unit of work (an op, an inline batch, a training batch)
        as the scheduler picks it, then one quantum of the stepped ops in flight (decode steps
        for as long as that unit took, QUANTUM_S at least); stepped ops join at every turn.
        So an op waits behind a long sample for at most one quantum, and a sample behind a
        long queue of ops for at most one op per quantum."""
        while not self.stopping.is_set():
            await self.stepped.join_heads()
            turn = self.schedule.next_turn(time.monotonic())
            if turn is None:
                await self._between_turns()
                continue
            self._idle.clear()
            if turn.kind is TurnKind.JOIN:
                continue  # arrived just now: it joins at the top of the next turn
            began = time.perf_counter()
            await self.turns.run(turn)
            if self.stepped.busy():
                await self.stepped.quantum(quantum_after(time.perf_counter() - began))
        while self.stepped.busy():  # stopping: what was started finishes and is published
            await self.stepped.quantum(QUANTUM_S)

    async def _between_turns(self) -> None:
        """Nothing runnable: a quantum of the stepped ops, or wait for work (and hand back
        models idle long enough)."""
        if self.stepped.busy():
            self._idle.clear()
            await self.stepped.quantum(QUANTUM_S)
            return
        self._idle.set()
        linger_check_s = self.ownership.linger_check_s()
        await self.arrivals.wait(self.schedule.idle_wait_s(time.monotonic(), linger_check_s))
        await self.ownership.release_lingering()

    # --- reading ---------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while not self.stopping.is_set():
            cursors = {m: o.read_seq for m, o in self.schedule.owned.items()}
            ops, self._control_cursor, control = await self._redis(
                self.dispatch.read, cursors, self._control_cursor, OP_READ_BLOCK_MS
            )
            # Handed to the engine before its next decode step (stepped.py).
            self.stepped.stop_later(control.stops)
            if "drain" in control.commands:
                log.info("%s: draining: finishing the op in progress, handing models back", self.id)
                self.stop()
            for op in ops:
                owned = self.schedule.owned.get(op.model_id)
                if owned is None or op.seq <= owned.read_seq:
                    continue  # dropped meanwhile, or already queued locally
                owned.backlog.append(op)
                owned.read_seq = op.seq
            if ops:
                self.arrivals.ring()

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
                cursor = await self._wait_for_offer(cursor, busy)
                continue
            if model_id in self.schedule.owned or self.stopping.is_set():
                continue
            lease = await self._redis(self.dispatch.claim, model_id)
            if lease is not None:
                await self.ownership.adopt(lease)
                # Busy from now on (its ops are on their way): the next offers go to the
                # workers that are still idle, so models spread over the fleet.
                self._idle.clear()
                await self._redis(self.dispatch.wake)

    async def _wait_for_offer(self, cursor: bytes, busy: bool) -> bytes:
        """Idle: until the bell rings. Busy: until the offers there come due, or soon after a
        new one (idle workers, woken by the same bell, get a head start)."""
        if not busy:
            return await self._redis(self.dispatch.wait_for_offer, cursor, IDLE_OFFER_WAIT_MS)
        new = await self._redis(self.dispatch.wait_for_offer, cursor, CLAIM_WHEN_BUSY_AFTER_MS)
        if new != cursor:
            await self._pause(CLAIM_UNSERVED_WHEN_BUSY_AFTER_MS / 1000)
        return new

    # --- liveness --------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        beats = 0
        while not await self._pause(self.config.heartbeat_ms / 1000):
            owned = list(self.schedule.owned.values())
            renewed = await self._redis(self.dispatch.renew, [o.lease for o in owned])
            self.ownership.drop_lapsed(owned, renewed)
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
            self.activity,
            owned=len(self.schedule.owned),
            stopping=self.stopping.is_set(),
            device_memory_bytes=self.engine.footprint.device_memory_bytes(),
            resident=self.engine.footprint.resident(),
            context_length=self.engine.context_length,
        )
        await self.registry.beat(self.id, fields, ttl_ms=self.config.lease_ttl_ms * 3)
        self.health.touch()  # registered and talking to Redis: what `queue-tinker probe` asks

    async def _shutdown(self) -> None:
        """Hand every model back (offering those with pending ops) and deregister."""
        await self.ownership.release_all()
        try:  # the registry entry expires by itself; the record is the dashboard's history
            await self.records.append(worker_record(self.identity, stopped=True))
            await self.registry.remove(self.id)
        except Exception as exc:
            log.warning("%s: could not deregister (%s)", self.id, describe(exc))
        self.compute.close()
