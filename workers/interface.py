"""What the worker's runtime asks of whatever runs ops, split by concern. Engines know no Redis
and no SQL: ops in, results out.

- `OpRules`: how each op runs. Inline on the event loop (a ping), alone, in a batch of many
  models' ops in one call (training steps: cross-adapter batching), or stepped among others
  that join and leave between steps (samples: the decode loop), so the worker runs other
  models' ops between the steps. The scheduler reads them (runtime/scheduling.py).
- `OpCompute`: running an op alone.
- `BatchCompute`: running the batchable ops of many models in one call.
- `SteppedCompute`: stepped ops: join, a quantum of steps, stop, follow inflight weights.
- `Durability`: what of a model's state is safe outside the process, where a new owner starts
  from, writing it there, forgetting it.
- `Footprint`: what the worker reports about itself.

`Engine` holds one of each; executor/ builds them (executor/lora.py, executor/queue_only.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from queue_tinker.errors import UserInputError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.service.ops import Op
from queue_tinker.types.service.records import Record
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


# What running an op gave: its result, or the exception that failed it (that op alone).
ResultOrError = OpResult | Exception


class OpRules(Protocol):
    def runs_inline(self, op: Op) -> bool:
        """True for ops so cheap (well under a millisecond, no model state) that they run on
        the worker's event loop: no thread hop, no separate 'running' mark."""
        ...

    def batchable(self, op: Op) -> bool:
        """True for ops run together, several models' at once, in one execute_batch call."""
        ...

    def batch_share(self, backlog: Iterable[Op]) -> BatchShare:
        """How many ops from the head of one model's backlog (its next ops, in order) join
        the next batch: batchable ones only, as many as make one unit of work."""
        ...

    def stepped(self, op: Op) -> bool:
        """True for ops that run a step at a time among others (SteppedCompute)."""
        ...


class OpCompute(Protocol):
    def execute(self, op: Op) -> OpResult:
        """Run one op; raise UserInputError for bad input (fails only that op)."""
        ...


class BatchCompute(Protocol):
    def execute_batch(self, ops: Sequence[Op]) -> list[ResultOrError]:
        """Run batchable ops together; one result or error per op, in order (each model's
        ops run in their order)."""
        ...


class SteppedCompute(Protocol):
    def join(self, ops: Sequence[Op]) -> None:
        """Take stepped ops (started, each model's in order); they join at the next step."""
        ...

    def step(self, budget_s: float) -> list[tuple[Op, ResultOrError]]:
        """One scheduling quantum of the joined ops: steps until one finishes or `budget_s`
        has passed (at least one step); the ops that finished in it, with their result or
        error, in any order (the worker publishes each model's in seq order)."""
        ...

    def stepping(self) -> bool:
        """True while joined ops are unfinished (or finished and not handed back yet)."""
        ...

    def stop(self, reasons: Mapping[str, str]) -> None:
        """Stop joined ops (job id -> why) before the next step: each leaves and comes out of
        that step failed with OpCancelledError(why); the others go on as if it had never
        joined. Ids of ops not joined here (finished meanwhile) are ignored."""
        ...

    def followed(self) -> set[str]:
        """The training runs whose inflight weights joined ops follow (queue/ops/inflight.py)."""
        ...

    def follow(self, newest: Mapping[str, str]) -> None:
        """The newest inflight weights of followed runs (run -> tinker path), before the next
        step: joined ops move to them, keeping what they computed so far."""
        ...


class Durability(Protocol):
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


class Footprint(Protocol):
    def resident(self) -> list[str]:
        """The models whose state is in memory now (the dashboard's resident adapters)."""
        ...

    def device_memory_bytes(self) -> int:
        """Accelerator memory in use (0 on the CPU)."""
        ...


@dataclass(frozen=True)
class Engine:
    """What a worker runs, by concern (each may be the same object)."""

    rules: OpRules
    ops: OpCompute
    batches: BatchCompute
    stepped: SteppedCompute
    durability: Durability
    footprint: Footprint
    # The longest sequence its model holds (its :peft:<tokens> name, listed by the server's
    # capabilities); None where no model is loaded.
    context_length: int | None = None


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
