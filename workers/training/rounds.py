"""forward / forward_backward / optim_step ops, of one model or many, in rounds: every model's
leading forward / forward_backward ops share one model pass with the other models'
(cross-adapter batching; weights change only at optim_step, so a model's consecutive pass ops
do not depend on each other), then the optim_steps that follow go in one optimizer call; and
again until every op has run. One op alone runs the same code.

A pass that runs out of device memory is split in halves and retried, and later passes stay
under what failed (MemoryGuard); an op that does not fit even alone fails with a
DeviceMemoryError that says what fits. Runs on the worker's compute thread.
"""

from __future__ import annotations

import logging
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import torch

from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import DeviceMemoryError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.enums import LossFn
from queue_tinker.types.requests.loss_inputs import (
    ModelLimits,
    check_batch,
    check_batch_size,
    resolve_loss_config,
)
from queue_tinker.types.requests.request_limits import RequestLimits, check_request_bytes
from queue_tinker.types.requests.training import (
    ForwardBackwardInput,
    ForwardBackwardOutput,
    OptimParams,
    OptimStepResponse,
)
from queue_tinker.types.service.ops import Op
from queue_tinker.types.tensors import Datum
from queue_tinker.workers.interface import PASS_KINDS, OpResult, ResultOrError, parse_body
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.memory import (
    Recomputation,
    is_out_of_memory,
    release_cached_memory,
)
from queue_tinker.workers.model.vision_language import ImageSupport
from queue_tinker.workers.training.custom_loss_graph import GraphLoss
from queue_tinker.workers.training.micro_batches import (
    Piece,
    micro_batched_pass,
    planned_batches,
    recomputes_under,
)
from queue_tinker.workers.training.model_pass import PassPlan, decoder_layers
from queue_tinker.workers.training.optimizers import optim_steps, parse_optim_params
from queue_tinker.workers.training.residency import Residency
from queue_tinker.workers.training.saved_state import SavedState
from queue_tinker.workers.training.shared_pass import PassOp, padded_tokens

log = logging.getLogger(__name__)
T = TypeVar("T")
Outcomes = list[ResultOrError | None]


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


def prepare_pass(
    op: Op,
    adapter: Adapter,
    limits: ModelLimits,
    request_limits: RequestLimits,
    device: torch.device,
    images: ImageSupport | None = None,
) -> PassOp:
    """A forward / forward_backward op's body, checked (its size, then what only the model
    knows), with its loss: built in, or the uploaded loss it carries (rebuilt from the
    allow-list, custom_loss_graph.py). Images become the model's inputs here (each one's
    positions checked against what the processor makes of it), or are refused by a text-only
    model."""
    batch = parse_body(ForwardBackwardInput, op.payload)
    check_batch_size(batch, request_limits)
    expanded = [
        (images or ImageSupport()).expand(f"data[{i}].model_input", datum.model_input)
        for i, datum in enumerate(batch.data)
    ]
    if any(e.images is not None for e in expanded):
        data = [
            datum.model_copy(update={"model_input": e.model_input})
            for datum, e in zip(batch.data, expanded, strict=True)
        ]
        batch = batch.model_copy(update={"data": data})
    check_batch(batch, limits.with_cap(adapter.context_cap))
    loss_fn: LossFn | GraphLoss = (
        GraphLoss(batch.custom_loss, device) if batch.custom_loss is not None else batch.loss_fn
    )
    return PassOp(
        adapter=adapter,
        data=batch.data,
        loss_fn=loss_fn,
        config=resolve_loss_config(batch.loss_fn, batch.loss_fn_config),
        backward=op.kind is OpKind.FORWARD_BACKWARD,
        images=tuple(e.images for e in expanded) if any(e.images for e in expanded) else (),
    )


class TrainingRounds:
    def __init__(
        self,
        pool: AdapterPool,
        residency: Residency,
        saved: SavedState,
        guard: MemoryGuard,
        plan: PassPlan,
        limits: ModelLimits,
        config: EngineConfig,
        images: ImageSupport | None = None,
    ) -> None:
        """`config`: the engine's settings (the request limits it checks, how often a run
        snapshots)."""
        self.pool = pool
        self.residency = residency
        self.saved = saved
        self.guard = guard
        self.plan = plan
        self.limits = limits
        self.request_limits = RequestLimits.of(config)
        self.snapshot_every = config.snapshot_every_steps
        self.images = images or ImageSupport()
        self.layers = len(decoder_layers(pool.base))  # what a pass's checkpointing plan counts
        self._said = ""  # the last micro-batch split logged

    def execute_batch(self, ops: Sequence[Op]) -> list[ResultOrError]:
        """Many models' steps, as the worker batches them (cross-adapter batching); each op's
        job record says how many models shared its pass (`batch_models:max`)."""
        return self.run(ops, batched=True)

    def run(self, ops: Sequence[Op], *, batched: bool = False) -> list[ResultOrError]:
        """One outcome per op, in order; an op with bad input fails alone. Each model's ops run
        in order, in rounds: every model's leading run of forward / forward_backward ops goes
        into one shared pass with all the others'; then every model's next op (its
        optim_step), the optim_steps together; and again, until every op has run."""
        outcomes: Outcomes = [None] * len(ops)
        queues: dict[str, deque[tuple[int, Op]]] = {}
        for index, op in enumerate(ops):
            queues.setdefault(op.model_id, deque()).append((index, op))
        try:
            while queues:
                passes: list[tuple[int, Op]] = []
                for queue in queues.values():
                    while queue and queue[0][1].kind in PASS_KINDS:
                        passes.append(queue.popleft())
                self._run_passes(passes, outcomes, batched)
                self._run_steps([queue.popleft() for queue in queues.values() if queue], outcomes)
                queues = {model: queue for model, queue in queues.items() if queue}
        finally:
            # Published together once the batch ends: a snapshot written inside it kept them.
            self.saved.unpublished.clear()
        done = [o for o in outcomes if o is not None]  # every op got a result or its error
        assert len(done) == len(ops)
        return done

    def _admit(self, op: Op) -> Adapter | OpResult:
        """execute's checks of a training op, in its order: its size, then its model (or, for
        an op the state already holds, its kept result)."""
        check_request_bytes(len(op.payload), self.request_limits)
        return self.residency.admit(op)

    def _prepare(self, op: Op) -> PassOp | OpResult:
        """execute's checks, in its order, and the op ready for a shared pass; or, for an op
        the state already holds, its kept result."""
        adapter = self._admit(op)
        if isinstance(adapter, OpResult):
            return adapter
        return prepare_pass(
            op, adapter, self.limits, self.request_limits, self.guard.device, self.images
        )

    def _run_passes(self, ops: Sequence[tuple[int, Op]], outcomes: Outcomes, batched: bool) -> None:
        """The ops in as few shared passes as fit and pay: each pass under train_batch_tokens
        padded tokens (one op always fits) and max_resident models, so that making one model
        resident never evicts another of the same pass, and none grown to where it recomputes
        more layers than its ops would apart (_shares)."""
        chunk: list[tuple[int, Op, PassOp]] = []
        for index, op in ops:
            models = {o.model_id for _, o, _ in chunk}
            if op.model_id not in models and len(models) >= self.pool.max_resident:
                self._run_pass(chunk, outcomes, batched)
                chunk = []
            try:
                prepared = self._prepare(op)
            except Exception as exc:  # this op's failure, as execute would raise it
                self._record(outcomes, index, op, exc)
                continue
            if isinstance(prepared, OpResult):
                self._record(outcomes, index, op, prepared)
                continue
            if chunk and not self._shares([p for _, _, p in chunk], prepared):
                self._run_pass(chunk, outcomes, batched)
                chunk = []
            chunk.append((index, op, prepared))
        self._run_pass(chunk, outcomes, batched)

    def _shares(self, chunk: Sequence[PassOp], op: PassOp) -> bool:
        """Whether `op` joins the pass of `chunk`: within the token budget, and without making
        the pass checkpoint more decoder layers than either would alone. Sharing saves passes,
        but recomputing layers costs more than it saves: on an H100, 8 adapters' 4 x 512-token
        ops at the Llama-3.1-8B shape ran 0.51x one at a time in one pass, which recomputed 26
        of 32 layers where each alone recomputed none."""
        if padded_tokens([*chunk, op]) > self.guard.train_batch_tokens:
            return False

        lora = self.pool.lora_layers()
        recomputes = recomputes_under(self.plan, self.guard.device, self.layers, lora)

        def recomputed(ops: Sequence[PassOp]) -> Recomputation:
            return recomputes(padded_tokens(ops), any(o.backward for o in ops), _ranks(ops))

        return recomputed([*chunk, op]) <= max(recomputed(chunk), recomputed([op]))

    def _micro_batches(self, ops: Sequence[PassOp]) -> list[list[Piece]]:
        """The pass's micro-batches (micro_batches.planned_batches), said in the log."""
        device, layers = self.guard.device, self.layers
        routed = bool(self.pool.expert_parameters)
        lora = self.pool.lora_layers()
        batches = planned_batches(ops, self.plan, device, layers, routed=routed, lora=lora)
        if len(batches) > 1:
            fixed = replace(self.plan, spare_activations=None)
            recomputes = recomputes_under(fixed, device, layers, lora)
            recomputed = recomputes(padded_tokens(ops), True, _ranks(ops))
            said = (
                f"a pass of {sum(len(op.data) for op in ops)} datums ({padded_tokens(ops)} "
                f"padded tokens) that would have {recomputed.described(layers)} runs as "
                f"{len(batches)} micro-batches recomputing none"
            )
            # At info when the split changes (a training loop's steps split alike).
            log.log(logging.INFO if said != self._said else logging.DEBUG, said)
            self._said = said
        return batches

    def _run_pass(
        self, chunk: Sequence[tuple[int, Op, PassOp]], outcomes: Outcomes, batched: bool
    ) -> None:
        if not chunk:
            return
        prepared_ops = [p for _, _, p in chunk]
        outs = self._try_pass(prepared_ops)
        if outs is None:  # out of memory, with nothing of the failed pass still referenced
            if len(chunk) > 1:
                self._split_pass(chunk, outcomes, batched)
                return
            outs = [self.guard.memory_error([d for p in prepared_ops for d in p.data])]
        # batch_models: how many models shared the pass (the job record's metrics only; the
        # result is what the op returns alone).
        shared = {"batch_models:max": float(len({op.model_id for _, op, _ in chunk}))}
        for (index, op, prepared), out in zip(chunk, outs, strict=True):
            if isinstance(out, Exception):
                self._record(outcomes, index, op, out)
                continue
            prepared.adapter.last_seq = op.seq
            result = pass_result(out, prepared.data, shared if batched else None)
            self._record(outcomes, index, op, result)

    def _try_pass(self, ops: Sequence[PassOp]) -> list[ForwardBackwardOutput | Exception] | None:
        """The shared pass's outcomes, or every op's failure; None if it ran out of memory."""

        def run() -> list[ForwardBackwardOutput | Exception]:
            try:
                batches = self._micro_batches(ops)
                return micro_batched_pass(self.pool, ops, batches, self.guard.device, self.plan)
            except Exception as exc:  # the pass itself failed: so does every op in it
                if is_out_of_memory(exc):
                    raise
                log.exception("a shared pass of %d ops failed", len(ops))
                return [exc] * len(ops)

        return self.guard.unless_out_of_memory(
            f"a shared pass of {len(ops)} ops", run, padded_tokens(ops)
        )

    def _split_pass(
        self, chunk: Sequence[tuple[int, Op, PassOp]], outcomes: Outcomes, batched: bool
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
        self._run_pass(chunk[:half], outcomes, batched)
        self._run_pass(chunk[half:], outcomes, batched)

    def _run_steps(self, ops: Sequence[tuple[int, Op]], outcomes: Outcomes) -> None:
        """Optim_steps of different models (what follows a round's passes), in one optimizer
        call."""
        steps: list[tuple[int, Op, Adapter, OptimParams]] = []
        for index, op in ops:
            assert op.kind is OpKind.OPTIM_STEP, op.kind
            if len(steps) >= self.pool.max_resident:
                # Making one more model resident could evict one of these: step them first.
                self._run_step_call(steps, outcomes)
                steps = []
            try:
                adapter = self._admit(op)
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
        self, steps: Sequence[tuple[int, Op, Adapter, OptimParams]], outcomes: Outcomes
    ) -> None:
        if not steps:
            return
        try:
            results: list[ResultOrError] = list(
                self._optimizer_step([(a, op, p) for _, op, a, p in steps])
            )
        except Exception as exc:  # the engine's own failure: every step in it fails
            log.exception("an optimizer step of %d models failed", len(steps))
            results = [exc] * len(steps)
        for (index, op, _, _), result in zip(steps, results, strict=True):
            self._record(outcomes, index, op, result)

    def _optimizer_step(self, steps: Sequence[tuple[Adapter, Op, OptimParams]]) -> list[OpResult]:
        """optim_step ops of different models in one optimizer call; each model snapshots
        every snapshot_every steps."""
        all_metrics = optim_steps([(adapter, params) for adapter, _, params in steps])
        results = []
        for (adapter, op, _), metrics in zip(steps, all_metrics, strict=True):
            adapter.last_seq = op.seq
            result = OpResult(
                result=codec.encode(OptimStepResponse(metrics=metrics).model_dump()),
                metrics=metrics,
            )
            if adapter.step % self.snapshot_every == 0:
                self.saved.snapshot(adapter, result)
            results.append(result)
        return results

    def _record(self, outcomes: Outcomes, index: int, op: Op, outcome: ResultOrError) -> None:
        outcomes[index] = outcome
        self.saved.unpublished.setdefault(op.model_id, {})[op.seq] = outcome


def _ranks(ops: Sequence[PassOp]) -> dict[str, int]:
    return {op.adapter.name: op.adapter.config.rank for op in ops}
