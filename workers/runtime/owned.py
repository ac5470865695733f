"""A model a worker owns: its lease, the ops read from its log and not yet run, and its
stepped ops (samples) in flight."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from queue_tinker.queue.dispatch.dispatcher import Lease, Op, Outcome


@dataclass
class OwnedModel:
    lease: Lease
    read_seq: int  # highest seq handed to the backlog
    replay_upto: int = 0  # ops up to here were published by an earlier owner: re-run only
    backlog: deque[Op] = field(default_factory=deque)
    idle_since: float = field(default_factory=time.monotonic)
    blocked_until: float = 0.0  # its tenant is over a limit: its next op waits till then
    # Stepped ops (samples) handed to the engine, by seq, with their outcome once finished:
    # published in seq order, so the model's done_seq never passes an op still running.
    inflight: dict[int, tuple[Op, Outcome | None]] = field(default_factory=dict)

    @property
    def tenant(self) -> str:
        return self.lease.tenant_id

    def runnable(self, now: float) -> bool:
        """Its next op may run now: not blocked by a limit, nor behind stepped ops of its own
        (ops of one model run in order)."""
        return bool(self.backlog) and self.blocked_until <= now and not self.inflight

    def stepping(self) -> bool:
        return any(outcome is None for _, outcome in self.inflight.values())
