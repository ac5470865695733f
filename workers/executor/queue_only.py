"""The queue-only engine: create_model bookkeeping and ping, no torch. It runs the queue end to
end for tests and the queue benchmarks (`queue-tinker worker --engine queue-only`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from queue_tinker.errors import UserInputError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.service.ops import Op
from queue_tinker.workers.interface import (
    BatchShare,
    Engine,
    OpResult,
    ResultOrError,
    is_inline_ping,
    run_ping,
)


class QueueOnlyRules:
    """Pings inline; everything else alone: nothing is batched or stepped."""

    def runs_inline(self, op: Op) -> bool:
        return is_inline_ping(op)

    def batchable(self, op: Op) -> bool:
        return False

    def batch_share(self, backlog: Iterable[Op]) -> BatchShare:
        return BatchShare(take=0, complete=True)

    def stepped(self, op: Op) -> bool:
        return False


@dataclass
class QueueOnlyEngine:
    """Ops with no model state: its compute, its (trivial) stepped ops, durability and
    footprint in one small object."""

    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    executed: dict[str, int] = field(default_factory=dict)  # model -> last seq executed
    joined: list[Op] = field(default_factory=list)

    def engine(self) -> Engine:
        return Engine(
            rules=QueueOnlyRules(),
            ops=self,
            batches=self,
            stepped=self,
            durability=self,
            footprint=self,
        )

    # --- OpCompute, BatchCompute ---
    def execute(self, op: Op) -> OpResult:
        last = self.executed.get(op.model_id)
        # Within one owner a model's ops must arrive in order and once: check it, loudly.
        if last is not None and op.seq <= last:
            raise RuntimeError(f"model {op.model_id}: op seq {op.seq} after {last}")
        if op.kind is OpKind.CREATE_MODEL:
            self.models[op.model_id] = codec.decode(op.payload) if op.payload else {}
            result = OpResult(result=codec.encode({"model_id": op.model_id}))
        elif op.kind is OpKind.PING:
            result = run_ping(op)
        else:
            raise UserInputError(
                f"kind: {op.kind.value!r} needs a training worker; this one runs the queue-only "
                "engine (start workers with --engine lora)"
            )
        self.executed[op.model_id] = op.seq
        return result

    def execute_batch(self, ops: Sequence[Op]) -> list[ResultOrError]:
        return [self.execute(op) for op in ops]

    # --- SteppedCompute: nothing is stepped here (the rules say so) ---
    def join(self, ops: Sequence[Op]) -> None:
        self.joined.extend(ops)

    def step(self, budget_s: float) -> list[tuple[Op, ResultOrError]]:
        """Whatever is joined anyway fails as execute would fail it."""
        finished: list[tuple[Op, ResultOrError]] = []
        for op in self.joined:
            try:
                finished.append((op, self.execute(op)))
            except Exception as exc:
                finished.append((op, exc))
        self.joined.clear()
        return finished

    def stepping(self) -> bool:
        return bool(self.joined)

    def stop(self, reasons: Mapping[str, str]) -> None:
        """Nothing runs a step at a time here: an op is never half-way when asked."""

    def followed(self) -> set[str]:
        return set()

    def follow(self, newest: Mapping[str, str]) -> None:
        pass

    # --- Durability: nothing needs replay after a takeover ---
    def durable_seq(self, model_id: str) -> int | None:
        return self.executed.get(model_id)

    def restore_point(self, model_id: str) -> int | None:
        return None

    def persist(self, model_id: str) -> None:
        pass  # nothing worth keeping

    def drop(self, model_id: str) -> None:
        self.executed.pop(model_id, None)
        self.models.pop(model_id, None)

    # --- Footprint ---
    def resident(self) -> list[str]:
        return list(self.models)

    def device_memory_bytes(self) -> int:
        return 0
