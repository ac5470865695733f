"""What a worker runs: an engine turns one op into one result. Engines know no Redis and no SQL.

Two engines implement the interface: `QueueOnlyEngine` (create_model bookkeeping and ping, no
torch: runs the queue end to end for tests and queue benchmarks) and the LoRA training engine
in workers/executor/lora.py.

An op runs one of four ways: inline on the event loop (`runs_inline`: a ping), alone
(`execute`), with other models' ops in one call (`batchable`, `execute_batch`: training steps),
or a step at a time among others that join and leave between steps (`stepped`, `join`, `step`:
sampling), so the worker can run other ops between the steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from queue_tinker.errors import UserInputError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.ops import Op
from queue_tinker.types.records import Record
from queue_tinker.types.validation import field_path

MAX_PING_DELAY_MS = 60_000
# Ops whose data one shared model pass runs, many adapters' at once (cross-adapter batching):
# they only add to .grad, so a model's consecutive ones are independent of each other.
PASS_KINDS = frozenset({OpKind.FORWARD, OpKind.FORWARD_BACKWARD})
# What cross-adapter batching takes from a model's queue: its passes, and the step after them.
TRAIN_BATCH_KINDS = PASS_KINDS | {OpKind.OPTIM_STEP}
B = TypeVar("B", bound=BaseModel)


def parse_body(model: type[B], payload: bytes) -> B:
    """An op's msgpack body as its request type; a bad field fails the op as user input."""
    try:
        return model.model_validate(codec.decode(payload) if payload else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UserInputError(f"{field_path('', first['loc'])}: {first['msg']}") from None


class BatchShare(NamedTuple):
    """What one model's backlog gives the next batch: its first `take` ops; `complete` when
    ops of this model arriving later could not join it (so a batch need not wait for them)."""

    take: int
    complete: bool


@dataclass
class OpResult:
    result: bytes
    metrics: dict[str, float] | None = None
    tokens: int = 0  # tokens the op processed: its tenant's tokens-per-second limit, /metrics
    # Durable-record events the op produced (checkpoints); the worker puts them on the
    # records stream before it publishes the result.
    records: list[Record] = field(default_factory=list)


class Engine(Protocol):
    def execute(self, op: Op) -> OpResult:
        """Run one op; raise UserInputError for bad input (fails only that op)."""
        ...

    def batchable(self, op: Op) -> bool:
        """True for ops the engine runs together, several models' at once, in one pass
        (sampling; training steps with cross-adapter batching): the worker hands them over in
        one execute_batch call."""
        ...

    def batch_share(self, backlog: Iterable[Op]) -> BatchShare:
        """How many ops from the head of one model's backlog (its next ops, in order) join
        the next batch: batchable ones only, as many as make one unit of work."""
        ...

    def execute_batch(self, ops: Sequence[Op]) -> list[OpResult | Exception]:
        """Run batchable ops together; one result or error per op, in order (each model's
        ops run in their order)."""
        ...

    def stepped(self, op: Op) -> bool:
        """True for ops that run a step at a time, many at once, joining and leaving between
        steps (sampling: the decode loop). The worker hands them over with join() and drives
        them with step(), running other models' ops between steps."""
        ...

    def join(self, ops: Sequence[Op]) -> None:
        """Take stepped ops (started, each model's in order); they join at the next step."""
        ...

    def step(self, budget_s: float) -> list[tuple[Op, OpResult | Exception]]:
        """One scheduling quantum of the joined ops: steps until one finishes or `budget_s`
        has passed (at least one step); the ops that finished in it, with their result or
        error, in any order (the worker publishes each model's in seq order)."""
        ...

    def stepping(self) -> bool:
        """True while joined ops are unfinished (or finished and not handed back yet)."""
        ...

    def stop(self, reasons: Mapping[str, str]) -> None:
        """Stop joined ops (job id -> why) before the next step: each leaves the loop and
        comes out of that step failed with OpCancelledError(why); the others go on as if it
        had never joined. Ids of ops not joined here (finished meanwhile) are ignored."""
        ...

    def runs_inline(self, op: Op) -> bool:
        """True for ops so cheap (well under a millisecond, no model state) that they run on the
        worker's event loop: no thread hop, no separate 'running' mark."""
        ...

    def durable_seq(self, model_id: str) -> int | None:
        """The last seq whose effects are safe outside this process (log may be trimmed to it)."""
        ...

    def restore_point(self, model_id: str) -> int | None:
        """The seq the model's state would cover if its next op ran now (resident state or the
        snapshot in storage); a new owner replays the logged ops after it. None: no replay."""
        ...

    def persist(self, model_id: str) -> None:
        """Write the model's state where another worker can pick it up (before a hand-over)."""
        ...

    def drop(self, model_id: str) -> None:
        """Forget a model's in-memory state (its lease is gone, or it was persisted)."""
        ...

    def resident(self) -> list[str]:
        """The models whose state is in memory now (the dashboard's resident adapters)."""
        ...

    def device_memory_bytes(self) -> int:
        """Accelerator memory in use (0 on the CPU)."""
        ...


def run_ping(op: Op) -> OpResult:
    body = codec.decode(op.payload) if op.payload else {}
    delay_ms = body.get("delay_ms", 0)
    if not isinstance(delay_ms, int) or not 0 <= delay_ms <= MAX_PING_DELAY_MS:
        raise UserInputError(
            f"delay_ms: must be an integer from 0 to {MAX_PING_DELAY_MS}, got {delay_ms!r}"
        )
    if delay_ms:
        time.sleep(delay_ms / 1000)
    return OpResult(result=codec.encode({"data": body.get("data"), "seq": op.seq}))


def is_inline_ping(op: Op) -> bool:
    if op.kind is not OpKind.PING:
        return False
    try:
        body = codec.decode(op.payload) if op.payload else {}
    except Exception:
        return False  # not inline: executing it fails the op with the decode error, not the loop
    return isinstance(body, dict) and body.get("delay_ms", 0) == 0


@dataclass
class QueueOnlyEngine:
    """Ops with no model state: enough to run the queue end to end without torch."""

    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    executed: dict[str, int] = field(default_factory=dict)  # model -> last seq executed
    joined: list[Op] = field(default_factory=list)

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

    def batchable(self, op: Op) -> bool:
        return False

    def batch_share(self, backlog: Iterable[Op]) -> BatchShare:
        return BatchShare(take=0, complete=True)

    def execute_batch(self, ops: Sequence[Op]) -> list[OpResult | Exception]:
        return [self.execute(op) for op in ops]

    def stepped(self, op: Op) -> bool:
        return False

    def join(self, ops: Sequence[Op]) -> None:
        self.joined.extend(ops)

    def step(self, budget_s: float) -> list[tuple[Op, OpResult | Exception]]:
        """Nothing is stepped here (stepped() is False): whatever is joined anyway fails as
        execute would fail it."""
        finished: list[tuple[Op, OpResult | Exception]] = []
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

    def runs_inline(self, op: Op) -> bool:
        return is_inline_ping(op)

    def durable_seq(self, model_id: str) -> int | None:
        # Nothing here needs replay after a takeover, so everything executed is durable.
        return self.executed.get(model_id)

    def restore_point(self, model_id: str) -> int | None:
        return None  # no state, nothing to replay

    def persist(self, model_id: str) -> None:
        pass  # nothing worth keeping

    def drop(self, model_id: str) -> None:
        self.executed.pop(model_id, None)
        self.models.pop(model_id, None)

    def resident(self) -> list[str]:
        return list(self.models)

    def device_memory_bytes(self) -> int:
        return 0


@dataclass(frozen=True)
class TrainingOpRules:
    """How the LoRA engine runs each op (workers/executor/lora.py delegates to this): pings
    inline, samples stepped, training steps batched across models (unless turned off), the
    rest alone. No torch here, so the worker's scheduling is tested with the real rules."""

    cross_adapter_batch: bool = True

    def runs_inline(self, op: Op) -> bool:
        return is_inline_ping(op)

    def batchable(self, op: Op) -> bool:
        return self.cross_adapter_batch and op.kind in TRAIN_BATCH_KINDS

    def stepped(self, op: Op) -> bool:
        return op.kind is OpKind.SAMPLE

    def batch_share(self, backlog: Iterable[Op]) -> BatchShare:
        """One training step: the leading forward / forward_backward ops and the optim_step
        after them (complete once that is there); a client that pipelines many steps then hears
        of each as it finishes, not of all of them once the last is done."""
        taken = 0
        for op in backlog:
            if not self.batchable(op):
                return BatchShare(taken, complete=True)
            taken += 1
            if op.kind is OpKind.OPTIM_STEP:
                return BatchShare(taken, complete=True)
        return BatchShare(taken, complete=False)
