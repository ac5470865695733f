"""Rank 0's engine: each call that changes state goes to the other ranks first, then runs here;
what only reads (rules, durability's seqs, the footprint) is answered by rank 0 alone.

Every call that changes an engine's state runs on the worker's one compute thread
(runtime/compute.py), so calls reach the channel one at a time and in the order they run; the
inline ops the runtime runs on its event loop (pings) change no state and are not sent.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace

from queue_tinker.types import OpKind, codec
from queue_tinker.types.ops import Op
from queue_tinker.workers.group.channel import Call, Channel
from queue_tinker.workers.interface import Engine, OpResult, ResultOrError


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
        )

    def _send(self, part: str, method: str, *args: object) -> None:
        self.channel.call(Call(part, method, args))

    # --- OpCompute, BatchCompute --------------------------------------------------------------
    def execute(self, op: Op) -> OpResult:
        if self.engine.rules.runs_inline(op):
            # Inline ops (a ping) touch no model state, and the runtime runs them on its event
            # loop, beside the compute thread's calls: rank 0 answers them alone.
            return self.engine.ops.execute(op)
        self._send("ops", "execute", op)
        return self.engine.ops.execute(op)

    def execute_batch(self, ops: Sequence[Op]) -> list[ResultOrError]:
        ops = list(ops)
        self._send("batches", "execute_batch", ops)
        return self.engine.batches.execute_batch(ops)

    # --- SteppedCompute -----------------------------------------------------------------------
    def join(self, ops: Sequence[Op]) -> None:
        ops = [seeded(op) for op in ops]
        self._send("stepped", "join", ops)
        self.engine.stepped.join(ops)

    def step(self, budget_s: float) -> list[tuple[Op, ResultOrError]]:
        self._send("stepped", "step", budget_s)
        return self.engine.stepped.step(budget_s)

    def stepping(self) -> bool:
        return self.engine.stepped.stepping()

    def stop(self, reasons: Mapping[str, str]) -> None:
        reasons = dict(reasons)
        self._send("stepped", "stop", reasons)
        self.engine.stepped.stop(reasons)

    def followed(self) -> set[str]:
        return self.engine.stepped.followed()

    def follow(self, newest: Mapping[str, str]) -> None:
        newest = dict(newest)
        self._send("stepped", "follow", newest)
        self.engine.stepped.follow(newest)

    # --- Durability ---------------------------------------------------------------------------
    def durable_seq(self, model_id: str) -> int | None:
        return self.engine.durability.durable_seq(model_id)

    def restore_point(self, model_id: str) -> int | None:
        return self.engine.durability.restore_point(model_id)

    def persist(self, model_id: str) -> None:
        self._send("durability", "persist", model_id)
        self.engine.durability.persist(model_id)

    def drop(self, model_id: str) -> None:
        self._send("durability", "drop", model_id)
        self.engine.durability.drop(model_id)


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
