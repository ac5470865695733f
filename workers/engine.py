"""What a worker runs: an engine turns one op into one result. Engines know no Redis and no SQL.

The built-in engine handles the op kinds that need no model (create_model bookkeeping and
ping); the LoRA training engine plugs in behind the same interface.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from queue_tinker.errors import UserInputError
from queue_tinker.queue import codec
from queue_tinker.queue.dispatch import Op
from queue_tinker.types import OpKind

MAX_PING_DELAY_MS = 60_000


@dataclass
class OpResult:
    result: bytes
    metrics: dict[str, float] | None = None


class Engine(Protocol):
    def execute(self, op: Op) -> OpResult:
        """Run one op; raise UserInputError for bad input (fails only that op)."""
        ...

    def runs_inline(self, op: Op) -> bool:
        """True for ops so cheap (well under a millisecond, no model state) that they run on the
        worker's event loop: no thread hop, no separate 'running' mark."""
        ...

    def durable_seq(self, model_id: str) -> int | None:
        """The last seq whose effects are safe outside this process (log may be trimmed to it)."""
        ...

    def drop(self, model_id: str) -> None:
        """Forget a model's in-memory state (its lease is gone)."""
        ...


@dataclass
class BuiltinEngine:
    """Ops with no model state: enough to run the queue end to end without torch."""

    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    executed: dict[str, int] = field(default_factory=dict)  # model -> last seq executed

    def execute(self, op: Op) -> OpResult:
        last = self.executed.get(op.model_id)
        # Within one owner a model's ops must arrive in order and once: check it, loudly.
        if last is not None and op.seq <= last:
            raise RuntimeError(f"model {op.model_id}: op seq {op.seq} after {last}")
        body = codec.decode(op.payload) if op.payload else {}
        if op.kind is OpKind.CREATE_MODEL:
            self.models[op.model_id] = body
            result = {"model_id": op.model_id}
        elif op.kind is OpKind.PING:
            result = {"data": body.get("data"), "seq": op.seq}
            delay_ms = body.get("delay_ms", 0)
            if not isinstance(delay_ms, int) or not 0 <= delay_ms <= MAX_PING_DELAY_MS:
                raise UserInputError(
                    f"delay_ms: must be an integer from 0 to {MAX_PING_DELAY_MS}, got {delay_ms!r}"
                )
            if delay_ms:
                time.sleep(delay_ms / 1000)
        else:
            raise UserInputError(f"kind: {op.kind.value!r} is not supported by this worker")
        self.executed[op.model_id] = op.seq
        return OpResult(result=codec.encode(result))

    def runs_inline(self, op: Op) -> bool:
        if op.kind is not OpKind.PING:
            return False
        body = codec.decode(op.payload) if op.payload else {}
        return isinstance(body, dict) and body.get("delay_ms", 0) == 0

    def durable_seq(self, model_id: str) -> int | None:
        # Nothing here needs replay after a takeover, so everything executed is durable.
        return self.executed.get(model_id)

    def drop(self, model_id: str) -> None:
        self.executed.pop(model_id, None)
        self.models.pop(model_id, None)
