"""What a worker runs next: the fair-scheduling decisions, apart from leases, Redis and compute.

Pure bookkeeping over the models a worker owns (their backlogs, what is in flight, which are
held back by a tenant limit): no Redis, no asyncio, no torch, so its rules are tested alone
(tests/workers/runtime/test_scheduling.py). workers/runtime/worker.py does the I/O and asks it.

The rules:
- A model's ops run strictly in seq order: only the head of its backlog is ever taken, and
  nothing of a model runs while its stepped ops (samples) are still in flight.
- Turns go round robin across tenants, then across each tenant's models: a tenant with many
  busy models gets no more turns than a tenant with one op.
- After an op that ran alone, a batch is due: any model whose head is batchable goes first
  (the batch serves everyone), so sampling or a batch waits behind at most one lone op.
- Between units of other work, the stepped ops get one quantum: as long as the unit took,
  QUANTUM_S at least.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from queue_tinker.types.service.ops import Op
from queue_tinker.workers.interface import OpRules
from queue_tinker.workers.runtime.owned import OwnedModel

# The scheduling quantum of stepped ops (sampling's decode loop): steps until one finishes or
# this long has passed, or as long as the unit of other work that ran before it took, whichever
# is longer. Under contention, sampling and the other ops then share the worker's time about
# equally; an op waits behind sampling for at most one quantum. A few steps per quantum keep
# the per-quantum cost (a thread hop, the scheduling, ~0.2 ms) small beside them.
QUANTUM_S = 0.02
# Inline ops (cheap, stateless) run back to back and are published in one pipeline, up to
# this many per round trip.
INLINE_BATCH = 64
# Batchable ops (training steps with cross-adapter batching) of all owned models run together
# in one engine call, up to this many.
ENGINE_BATCH = 256
# Stepped ops join the engine at most this many at a time.
JOIN_BATCH = 256
# An owned model idle this long is no part of the burst a batch gathers: its client is busy
# elsewhere, or gone (a model lingers for QT_LINGER_MS), so waiting for its next step only
# delays the others. Clients woken by one batch's results send their next steps within
# milliseconds of each other.
IDLE_PEER_S = 0.25


class TurnKind(Enum):
    REPLAY = "replay"  # re-run an op an earlier owner published (op: popped)
    JOIN = "join"  # a stepped op just arrived: it joins at the top of the next turn
    INLINE = "inline"  # take_inline_batch, then run it
    BATCH = "batch"  # gather, take_engine_batch, then run it
    ALONE = "alone"  # run the op (popped) by itself


@dataclass(frozen=True)
class Turn:
    kind: TurnKind
    owned: OwnedModel
    op: Op | None = None  # REPLAY and ALONE: the op taken off the model's backlog


def quantum_after(unit_s: float) -> float:
    """The stepped ops' quantum after a unit of other work that took `unit_s`."""
    return max(QUANTUM_S, unit_s)


@dataclass
class Scheduler:
    """The worker's owned models and the decision of what runs next. `owned` is the worker's
    own dict (it adds claimed models and drops lost ones); the order of its entries is the
    round robin among a tenant's models."""

    rules: OpRules
    owned: dict[str, OwnedModel] = field(default_factory=dict)
    # After a single op, batchable ops waiting anywhere go next: sampling waits behind at
    # most one training op, and training behind at most one batch.
    batch_due: bool = True
    # Round robin across tenants: the turn each tenant last had (a counter, not a time).
    _turns: int = field(default=0, init=False)
    _tenant_turn: dict[str, int] = field(default_factory=dict, init=False)

    # --- the next turn -----------------------------------------------------------------------
    def next_turn(self, now: float) -> Turn | None:
        """The next unit of work (None: nothing runnable now). Takes the op off its model's
        backlog for REPLAY and ALONE; the batches are taken by take_inline_batch and
        take_engine_batch."""
        owned = self.next_runnable(now)
        if owned is None:
            return None
        head = owned.backlog[0]
        if head.seq <= owned.replay_upto:
            return Turn(TurnKind.REPLAY, owned, owned.backlog.popleft())
        if self.rules.stepped(head):
            return Turn(TurnKind.JOIN, owned)
        if self.rules.runs_inline(head):
            return Turn(TurnKind.INLINE, owned)
        if self.rules.batchable(head):
            self.batch_due = False
            return Turn(TurnKind.BATCH, owned)
        self.batch_due = True
        return Turn(TurnKind.ALONE, owned, owned.backlog.popleft())

    def next_runnable(self, now: float) -> OwnedModel | None:
        """Round robin across tenants, then across each tenant's models: the tenant whose
        last turn is oldest goes next, with its model that waited longest for a turn, so a
        tenant with many busy models gets no more turns than one with a single op. When a
        batch is due, any model with a batchable op goes first (the batch serves everyone)."""
        if self.batch_due:
            for owned in self.owned.values():
                if self.batchable_head(owned, now):
                    return owned
        chosen: OwnedModel | None = None
        for owned in self.owned.values():
            if owned.runnable(now) and (
                chosen is None
                or self._tenant_turn.get(owned.tenant, 0) < self._tenant_turn.get(chosen.tenant, 0)
            ):
                chosen = owned
        if chosen is None:
            return None
        model_id = chosen.lease.model_id
        self.owned[model_id] = self.owned.pop(model_id)  # to the back of its tenant's models
        self._turns += 1
        self._tenant_turn[chosen.tenant] = self._turns
        return chosen

    def forget(self, owned: OwnedModel) -> None:
        """A model was dropped (already out of `owned`): a tenant with no model left starts
        afresh, as the tenant that waited longest, when it comes back."""
        if all(o.tenant != owned.tenant for o in self.owned.values()):
            self._tenant_turn.pop(owned.tenant, None)

    def idle_wait_s(self, now: float, longest_s: float) -> float:
        """How long to wait for new ops: until the first model over a limit may try again."""
        wait = longest_s
        for owned in self.owned.values():
            if owned.backlog and owned.blocked_until > now:
                wait = min(wait, owned.blocked_until - now)
        return max(wait, 0.001)

    @staticmethod
    def hold_back(owned: OwnedModel, ops: list[Op], retry_ms: int, now: float) -> None:
        """Ops refused for their tenant's limit go back to the front of their model's backlog,
        in order; the model sits out until the limit may let them through."""
        owned.backlog.extendleft(reversed(ops))
        owned.blocked_until = now + retry_ms / 1000

    # --- taking batches ----------------------------------------------------------------------
    def batchable_head(self, owned: OwnedModel, now: float) -> bool:
        head = owned.backlog[0] if owned.runnable(now) else None
        return head is not None and head.seq > owned.replay_upto and self.rules.batchable(head)

    def take_inline_batch(self, now: float) -> list[tuple[OwnedModel, Op]]:
        """Inline ops from the heads of the owned models' backlogs, round robin; each model's
        ops stay in order and the batch stops at its first op that is not inline."""
        batch: list[tuple[OwnedModel, Op]] = []
        progress = True
        while progress and len(batch) < INLINE_BATCH:
            progress = False
            for owned in self.owned.values():
                head = owned.backlog[0] if owned.runnable(now) else None
                if head and head.seq > owned.replay_upto and self.rules.runs_inline(head):
                    batch.append((owned, owned.backlog.popleft()))
                    progress = True
                    if len(batch) == INLINE_BATCH:
                        break
        return batch

    def take_engine_batch(self, now: float) -> list[tuple[OwnedModel, Op]]:
        """The batchable ops at the head of every owned model's backlog, each model's in order:
        as many as the engine takes in one go (all its samples, one training step), so a
        model that queued many steps does not hold every other model's results back."""
        batch: list[tuple[OwnedModel, Op]] = []
        for owned in self.owned.values():
            if not self.batchable_head(owned, now):
                continue  # blocked, idle, replaying, or its next op runs alone
            take = min(self.rules.batch_share(owned.backlog).take, ENGINE_BATCH - len(batch))
            batch += [(owned, owned.backlog.popleft()) for _ in range(take)]
        return batch

    def share_complete(self, owned: OwnedModel, now: float) -> bool:
        """No op of this model arriving now could join the next batch."""
        if owned.blocked_until > now:
            return True
        if not owned.backlog:  # its next step may be on its way, if it ran just now
            return now - owned.idle_since >= IDLE_PEER_S
        if owned.backlog[0].seq <= owned.replay_upto:
            return True
        if self.rules.stepped(owned.backlog[0]):
            return False  # more samples of a burst may be on their way
        return self.rules.batch_share(owned.backlog).complete

    def batch_complete(self, now: float) -> bool:
        """Every owned model's share of the next batch is in: gathering longer gains nothing."""
        return all(self.share_complete(owned, now) for owned in self.owned.values())

    # --- stepped ops (samples) ---------------------------------------------------------------
    def stepping(self) -> bool:
        return any(owned.stepping() for owned in self.owned.values())

    def stepped_head(self, owned: OwnedModel, now: float) -> bool:
        head = owned.backlog[0] if owned.backlog and owned.blocked_until <= now else None
        return head is not None and head.seq > owned.replay_upto and self.rules.stepped(head)

    def any_stepped_head(self, now: float) -> bool:
        return any(self.stepped_head(owned, now) for owned in self.owned.values())

    def take_stepped(self, now: float) -> list[tuple[OwnedModel, Op]]:
        """The stepped ops at the head of every owned model's backlog, each model's in order."""
        batch: list[tuple[OwnedModel, Op]] = []
        for owned in self.owned.values():
            while len(batch) < JOIN_BATCH and self.stepped_head(owned, now):
                batch.append((owned, owned.backlog.popleft()))
        return batch
