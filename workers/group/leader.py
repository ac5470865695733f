"""Rank 0's engine: each call that changes state goes to the other ranks first, then runs here;
what only reads (rules, durability's seqs, the footprint) is answered by rank 0 alone.

Every call that changes an engine's state runs on the worker's one compute thread
(runtime/compute.py), so calls reach the channel one at a time and in the order they run; the
inline ops the runtime runs on its event loop (pings) change no state and are not sent.

After each call the ranks compare what they came out of it with. Where they differ (one rank
failed alone: out of memory, a checkpoint it could not read) their states no longer match, and
rank 0 ends its process at once, as a crash would: nothing of the call is published, the
launcher ends the group, and a new one replays the model's log and runs the op again
(QT_MAX_OP_ATTEMPTS bounds how often).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NoReturn

from queue_tinker.errors import RanksPartedError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.service.ops import Op
from queue_tinker.workers.group.channel import Call, Channel, collective_failed, outcome
from queue_tinker.workers.interface import Engine, OpResult, ResultOrError

log = logging.getLogger(__name__)

# Rank 0's exit status when the ranks parted or one is gone: the launcher reports it and ends
# the group.
PARTED_EXIT = 3


class LeaderEngine:
    def __init__(self, engine: Engine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel

    def as_engine(self) -> Engine:
        return Engine(
            rules=self.engine.rules,
            ops=self,
            batches=self,
            stepped=self,
            durability=self,
            footprint=self.engine.footprint,
            context_length=self.engine.context_length,
        )

    def _run(self, part: str, method: str, *args: Any) -> Any:
        """The call sent to the other ranks, run here, then agreed on."""
        call = Call(part, method, args)
        self.channel.call(call)
        try:
            value = getattr(getattr(self.engine, part), method)(*args)
        except Exception as error:
            if collective_failed(error):
                _end(f"{part}.{method}: a collective failed ({error}): another rank is gone")
            self._agree(call, error, failed=True)
            raise
        self._agree(call, value)
        return value

    def _agree(self, call: Call, came_to: object, failed: bool = False) -> None:
        try:
            self.channel.agree(call, outcome(came_to), failed=failed)
        except RanksPartedError as parted:
            _end(parted.message)

    # --- OpCompute, BatchCompute --------------------------------------------------------------
    def execute(self, op: Op) -> OpResult:
        if self.engine.rules.runs_inline(op):
            # Inline ops (a ping) touch no model state, and the runtime runs them on its event
            # loop, beside the compute thread's calls: rank 0 answers them alone.
            return self.engine.ops.execute(op)
        result: OpResult = self._run("ops", "execute", op)
        return result

    def execute_batch(self, ops: Sequence[Op]) -> list[ResultOrError]:
        results: list[ResultOrError] = self._run("batches", "execute_batch", list(ops))
        return results

    # --- SteppedCompute -----------------------------------------------------------------------
    def join(self, ops: Sequence[Op]) -> None:
        self._run("stepped", "join", [seeded(op) for op in ops])

    def step(self, budget_s: float) -> list[tuple[Op, ResultOrError]]:
        finished: list[tuple[Op, ResultOrError]] = self._run("stepped", "step", budget_s)
        return finished

    def stepping(self) -> bool:
        return self.engine.stepped.stepping()

    def stop(self, reasons: Mapping[str, str]) -> None:
        self._run("stepped", "stop", dict(reasons))

    def followed(self) -> set[str]:
        return self.engine.stepped.followed()

    def follow(self, newest: Mapping[str, str]) -> None:
        self._run("stepped", "follow", dict(newest))

    # --- Durability ---------------------------------------------------------------------------
    def durable_seq(self, model_id: str) -> int | None:
        return self.engine.durability.durable_seq(model_id)

    def restore_point(self, model_id: str) -> int | None:
        return self.engine.durability.restore_point(model_id)

    def persist(self, model_id: str) -> None:
        self._run("durability", "persist", model_id)

    def drop(self, model_id: str) -> None:
        self._run("durability", "drop", model_id)


def _end(why: str) -> NoReturn:
    """End rank 0 at once, as a crash would: nothing of the call in hand is published (its
    state is not the other ranks'), the launcher ends the group, the lease lapses, and a new
    group replays the model's log and runs the op again."""
    log.critical("rank 0: %s", why)
    sys.stderr.flush()
    os._exit(PARTED_EXIT)


def seeded(op: Op) -> Op:
    """A sample op without a seed gets one here: each rank would otherwise draw its own, and
    their samples (and with them the steps each row takes) would part."""
    if op.kind is not OpKind.SAMPLE or not op.payload:
        return op
    try:
        body = codec.decode(op.payload)
    except Exception:
        return op  # fails alike on every rank when the op runs
    params = body.get("sampling_params") if isinstance(body, dict) else None
    if not isinstance(params, dict) or params.get("seed") is not None:
        return op
    params["seed"] = int.from_bytes(os.urandom(8), "little") >> 1  # a non-negative int64
    return replace(op, payload=codec.encode(body))
