"""Training ops of many models in one engine call (cross-adapter batching), for LoraEngine.

In rounds: every model's leading forward / forward_backward ops share one model pass with the
other models' (TrainingRounds), then the optim_steps that follow go in one optimizer call. A
pass that runs out of device memory is split in halves and retried, and later passes stay
under what failed (MemoryGuard, which the engine's lone ops use too); an op that does not fit
even alone fails with a DeviceMemoryError that says what fits. Runs on the worker's compute
thread, like the engine.
"""

from __future__ import annotations

import logging
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from queue_tinker.errors import DeviceMemoryError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.ops import Op
from queue_tinker.types.tensors import Datum
from queue_tinker.types.training import ForwardBackwardOutput, OptimParams
from queue_tinker.workers.interface import PASS_KINDS, OpResult
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.memory import is_out_of_memory, release_cached_memory
from queue_tinker.workers.training.dimuon import parse_optim_params
from queue_tinker.workers.training.model_pass import PassPlan
from queue_tinker.workers.training.shared_pass import PassOp, padded_tokens, shared_pass

log = logging.getLogger(__name__)

Outcome = OpResult | Exception
T = TypeVar("T")


def pass_result(
    out: ForwardBackwardOutput, data: Sequence[Datum], extra_metrics: dict[str, float] | None = None
) -> OpResult:
    return OpResult(
        result=codec.encode(out.model_dump()),
        metrics={**out.metrics, **(extra_metrics or {})},
        tokens=sum(datum.model_input.length for datum in data),
    )


class MemoryGuard:
    """What fits in one model pass on the device: the budget of padded tokens per shared pass
    (lowered when a pass runs out of memory) and the largest pass that ran."""

    def __init__(self, device: torch.device, train_batch_tokens: int) -> None:
        self.device = device
        self.train_batch_tokens = train_batch_tokens
        self.largest_pass = 0  # padded tokens of the biggest pass that ran: what fits

    def unless_out_of_memory(self, what: str, run: Callable[[], T], tokens: int) -> T | None:
        """run(), or None if it ran out of memory (logged, the device's cache released); a
        run that fits raises largest_pass to its `tokens`. None is answered outside: an
        exception being handled keeps the failed pass's tensors alive through its traceback,
        and a retry inside the handler would need room for both."""
        try:
            result = run()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            log.warning("%s ran out of memory: %s", what, str(exc))
            # Its frames hold the failed pass's tensors, and whoever keeps the exception (a log
            # handler that keeps records, a debugger) would keep them from the retry: drop them.
            traceback.clear_frames(exc.__traceback__)
            result = None
        if result is None:
            release_cached_memory(self.device)
            return None
        self.largest_pass = max(self.largest_pass, tokens)
        return result

    def memory_error(self, data: Sequence[Datum]) -> DeviceMemoryError:
        """An op that does not fit even alone: say what it tried and what fits."""
        rows = len(data)
        width = max(d.model_input.length for d in data)
        fits = (
            f"the largest pass this worker has run held {self.largest_pass} padded tokens"
            if self.largest_pass
            else "no pass has run on this worker yet"
        )
        return DeviceMemoryError(
            f"data: {rows} rows x {width} tokens ({rows * width} padded tokens) do not fit in "
            f"{self.device.type} memory; {fits}: split the batch "
            "into smaller forward_backward calls"
        )


class TrainingHost(Protocol):
    """What the rounds need of the engine: its adapters, an op's checks (as execute makes
    them), and its optimizer step."""

    pool: AdapterPool

    def admit_batched(self, op: Op) -> Adapter | OpResult: ...

    def pass_op(self, op: Op) -> PassOp | OpResult: ...

    def optimizer_step(
        self, steps: Sequence[tuple[Adapter, Op, OptimParams]]
    ) -> list[OpResult]: ...


class TrainingRounds:
    """execute_batch's training ops: each model's in order, as few passes as fit."""

    def __init__(self, host: TrainingHost, guard: MemoryGuard, plan: PassPlan) -> None:
        self.host = host
        self.guard = guard
        self.plan = plan
        # Outcomes of the ops run so far in the current batch, per model: the worker publishes
        # them only when the whole batch is done, so a snapshot written meanwhile keeps them
        # (LoraEngine._snapshot, _already_applied). Cleared by the engine after each batch.
        self.unpublished: dict[str, dict[int, Outcome]] = {}

    def run(self, ops: Sequence[tuple[int, Op]], outcomes: list[Outcome | None]) -> None:
        """Each model's ops in order, in rounds: every model's leading run of forward /
        forward_backward ops goes into one shared pass with all the others' (weights change
        only at optim_step, so a run's ops do not depend on each other); then every model's next
        op (its optim_step), the optim_steps together; and again, until every op has run."""
        queues: dict[str, deque[tuple[int, Op]]] = {}
        for index, op in ops:
            queues.setdefault(op.model_id, deque()).append((index, op))
        while queues:
            passes: list[tuple[int, Op]] = []
            for queue in queues.values():
                while queue and queue[0][1].kind in PASS_KINDS:
                    passes.append(queue.popleft())
            self._run_passes(passes, outcomes)
            self._run_steps([queue.popleft() for queue in queues.values() if queue], outcomes)
            queues = {model: queue for model, queue in queues.items() if queue}

    def _run_passes(self, ops: Sequence[tuple[int, Op]], outcomes: list[Outcome | None]) -> None:
        """The ops in as few shared passes as fit: each pass under train_batch_tokens padded
        tokens (one op always fits) and max_resident models, so that making one model resident
        never evicts another of the same pass."""
        chunk: list[tuple[int, Op, PassOp]] = []
        for index, op in ops:
            models = {o.model_id for _, o, _ in chunk}
            if op.model_id not in models and len(models) >= self.host.pool.max_resident:
                self._run_pass(chunk, outcomes)
                chunk = []
            try:
                prepared = self.host.pass_op(op)
            except Exception as exc:  # this op's failure, as execute would raise it
                self._record(outcomes, index, op, exc)
                continue
            if isinstance(prepared, OpResult):  # already applied: its kept result
                self._record(outcomes, index, op, prepared)
                continue
            if (
                chunk
                and padded_tokens([*(p for _, _, p in chunk), prepared])
                > self.guard.train_batch_tokens
            ):
                self._run_pass(chunk, outcomes)
                chunk = []
            chunk.append((index, op, prepared))
        self._run_pass(chunk, outcomes)

    def _run_pass(
        self, chunk: Sequence[tuple[int, Op, PassOp]], outcomes: list[Outcome | None]
    ) -> None:
        if not chunk:
            return
        prepared_ops = [p for _, _, p in chunk]
        outs = self._try_pass(prepared_ops)
        if outs is None:  # out of memory, with nothing of the failed pass still referenced
            if len(chunk) > 1:
                self._split_pass(chunk, outcomes)
                return
            outs = [self.guard.memory_error([d for p in prepared_ops for d in p.data])]
        models = float(len({op.model_id for _, op, _ in chunk}))
        for (index, op, prepared), out in zip(chunk, outs, strict=True):
            if isinstance(out, Exception):
                self._record(outcomes, index, op, out)
                continue
            prepared.adapter.last_seq = op.seq
            # batch_models: how many models shared the pass (the job record's metrics only;
            # the result is what the op returns alone).
            self._record(
                outcomes, index, op, pass_result(out, prepared.data, {"batch_models:max": models})
            )

    def _try_pass(self, ops: Sequence[PassOp]) -> list[ForwardBackwardOutput | Exception] | None:
        """The shared pass's outcomes, or every op's failure; None if it ran out of memory."""

        def run() -> list[ForwardBackwardOutput | Exception]:
            try:
                return shared_pass(self.host.pool, ops, self.guard.device, self.plan)
            except Exception as exc:  # the pass itself failed: so does every op in it
                if is_out_of_memory(exc):
                    raise
                log.exception("a shared pass of %d ops failed", len(ops))
                return [exc] * len(ops)

        return self.guard.unless_out_of_memory(
            f"a shared pass of {len(ops)} ops", run, padded_tokens(ops)
        )

    def _split_pass(
        self, chunk: Sequence[tuple[int, Op, PassOp]], outcomes: list[Outcome | None]
    ) -> None:
        """A pass ran out of device memory (its gradients are back as they were): run its
        halves, and keep later passes under what failed."""
        tokens = padded_tokens([p for _, _, p in chunk])
        self.guard.train_batch_tokens = max(1, min(self.guard.train_batch_tokens, tokens // 2))
        log.warning(
            "a shared pass of %d ops (%d padded tokens) ran out of memory: splitting "
            "it; passes now hold at most %d tokens",
            len(chunk),
            tokens,
            self.guard.train_batch_tokens,
        )
        half = len(chunk) // 2
        self._run_pass(chunk[:half], outcomes)
        self._run_pass(chunk[half:], outcomes)

    def _run_steps(self, ops: Sequence[tuple[int, Op]], outcomes: list[Outcome | None]) -> None:
        """Optim_steps of different models (what follows a round's passes: batch_share takes
        nothing else), in one optimizer call (_step)."""
        steps: list[tuple[int, Op, Adapter, OptimParams]] = []
        for index, op in ops:
            assert op.kind is OpKind.OPTIM_STEP, op.kind
            if len(steps) >= self.host.pool.max_resident:
                # Making one more model resident could evict one of these: step them first.
                self._run_step_call(steps, outcomes)
                steps = []
            try:
                adapter = self.host.admit_batched(op)
                if isinstance(adapter, OpResult):  # already applied: its kept result
                    self._record(outcomes, index, op, adapter)
                    continue
                steps.append(
                    (index, op, adapter, parse_optim_params(adapter.config.optimizer, op.payload))
                )
            except Exception as exc:
                self._record(outcomes, index, op, exc)
        self._run_step_call(steps, outcomes)

    def _run_step_call(
        self, steps: Sequence[tuple[int, Op, Adapter, OptimParams]], outcomes: list[Outcome | None]
    ) -> None:
        if not steps:
            return
        try:
            results: list[Outcome] = list(
                self.host.optimizer_step([(a, op, p) for _, op, a, p in steps])
            )
        except Exception as exc:  # the engine's own failure: every step in it fails
            log.exception("an optimizer step of %d models failed", len(steps))
            results = [exc] * len(steps)
        for (index, op, _, _), result in zip(steps, results, strict=True):
            self._record(outcomes, index, op, result)

    def _record(self, outcomes: list[Outcome | None], index: int, op: Op, outcome: Outcome) -> None:
        outcomes[index] = outcome
        self.unpublished.setdefault(op.model_id, {})[op.seq] = outcome
