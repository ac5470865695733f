"""Micro-batches before recomputation: a pass that would checkpoint decoder layers is split at
datum boundaries into passes that each fit without, and their gradients add up in `.grad`.

Every loss the server computes is a sum over datums (docs/losses.md; an uploaded loss runs per
datum too), so the gradient of a pass is the sum of its micro-batches' and each op's loss the
sum of its pieces'. With a frozen base the forward is about half a step's work, and
recomputing 26 of 32 layers (an 8B pass of 16k tokens on an 80 GiB card) costs ~40% of a
step; passes that fit whole cost nothing extra. Only a datum that does not fit alone
recomputes, in a micro-batch of its own.

The split is made against the device's fixed training budget, not what a pass may borrow from
the sampler's share at the moment (PassPlan.spare_activations), so the same ops split the same
way every time they run (a replay included). A mixture-of-experts pass is not split: its
routing metrics count the experts an op's tokens chose over all of them at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache

import torch

from queue_tinker.types.requests.training import ForwardBackwardOutput
from queue_tinker.types.tensors import TensorData
from queue_tinker.workers.model.adapters import AdapterPool
from queue_tinker.workers.model.lora.row_blocks import LoraLayer
from queue_tinker.workers.model.memory import Recomputation
from queue_tinker.workers.training.custom_loss_graph import GraphLoss
from queue_tinker.workers.training.model_pass import PassPlan
from queue_tinker.workers.training.shared_pass import (
    PassOp,
    kept_grads,
    lora_form_of,
    shared_pass,
)

log = logging.getLogger(__name__)

# The layers a pass of (padded tokens, backward, each adapter's LoRA rank) recomputes.
Recomputes = Callable[[int, bool, dict[str, int]], Recomputation]
PassOutcome = ForwardBackwardOutput | Exception


@dataclass(frozen=True)
class Piece:
    """Datums [start, end) of op `index`, in one micro-batch."""

    index: int
    start: int
    end: int

    def of(self, ops: Sequence[PassOp]) -> PassOp:
        op = ops[self.index]
        if (self.start, self.end) == (0, len(op.data)):
            return op
        images = op.images[self.start : self.end] if op.images else ()
        return replace(op, data=op.data[self.start : self.end], images=images)


def recomputes_under(
    plan: PassPlan, device: torch.device, layers: int, lora: Sequence[LoraLayer] = ()
) -> Recomputes:
    """The layers a pass checkpoints under `plan`. Its adapters' LoRA counts as stacked (every
    token computing every adapter's columns) where the pass would stack it: given the model's
    LoRA layers `lora`, where shared_pass.lora_form picks stacked for those adapters (a grouped
    pass computes a row's own columns only); without them, wherever the plan may stack (an
    upper bound)."""

    @cache
    def stacked(names: tuple[str, ...]) -> bool:
        if len(names) < 2:
            return False
        if not lora:
            return plan.lora_form_for(device, groups=False, stacks=True) == "stacked"
        return lora_form_of(lora, names, device, plan)[0] == "stacked"

    def recomputes(tokens: int, backward: bool, ranks: dict[str, int]) -> Recomputation:
        pass_plan = plan.for_pass(list(ranks.values()), stacked(tuple(sorted(ranks))))
        return pass_plan.recomputation(tokens, backward, layers)

    return recomputes


def planned_batches(
    ops: Sequence[PassOp],
    plan: PassPlan,
    device: torch.device,
    layers: int,
    *,
    routed: bool,
    lora: Sequence[LoraLayer] = (),
) -> list[list[Piece]]:
    """The pass's micro-batches as a worker plans them: under auto checkpointing (and
    plan.micro_batches), against the fixed budget (nothing borrowed), on a model without routed
    experts (`routed`); else the pass whole. `lora`: the model's LoRA layers
    (recomputes_under)."""
    if plan.activation_checkpointing != "auto" or not plan.micro_batches or routed:
        return [[Piece(i, 0, len(op.data)) for i, op in enumerate(ops)]]
    fixed = replace(plan, spare_activations=None)
    return micro_batches(ops, recomputes_under(fixed, device, layers, lora))


def micro_batches(ops: Sequence[PassOp], recomputes: Recomputes) -> list[list[Piece]]:
    """The ops' datums, in order, in the fewest consecutive micro-batches that recompute no
    layer (a datum that recomputes even alone is a micro-batch of its own); one micro-batch,
    the ops whole, when the pass recomputes nothing as it is."""
    whole = [Piece(i, 0, len(op.data)) for i, op in enumerate(ops)]
    everything = _Shape.of(ops)
    if not recomputes(everything.tokens, everything.backward, everything.ranks):
        return [whole]
    batches: list[list[Piece]] = []
    current: list[Piece] = []
    shape = _Shape()
    for index, op in enumerate(ops):
        for datum in range(len(op.data)):
            grown = shape.with_datum(op, datum)
            if current and recomputes(grown.tokens, grown.backward, grown.ranks):
                batches.append(current)
                current, grown = [], _Shape().with_datum(op, datum)
            current = _extended(current, index, datum)
            shape = grown
    batches.append(current)
    return batches


@dataclass(frozen=True)
class _Shape:
    """What a micro-batch's checkpointing depends on: its rows, its widest datum, whether it
    runs backward, its adapters' ranks."""

    rows: int = 0
    width: int = 0
    backward: bool = False
    ranks: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.rows * self.width

    def with_datum(self, op: PassOp, datum: int) -> _Shape:
        return _Shape(
            self.rows + 1,
            max(self.width, op.data[datum].model_input.length),
            self.backward or op.backward,
            {**self.ranks, op.adapter.name: op.adapter.config.rank},
        )

    @classmethod
    def of(cls, ops: Sequence[PassOp]) -> _Shape:
        return cls(
            sum(len(op.data) for op in ops),
            max(op.width for op in ops),
            any(op.backward for op in ops),
            {op.adapter.name: op.adapter.config.rank for op in ops},
        )


def _extended(pieces: list[Piece], index: int, datum: int) -> list[Piece]:
    """`pieces` with datum `datum` of op `index` (the next one in order) added."""
    if pieces and pieces[-1].index == index:
        last = pieces[-1]
        return [*pieces[:-1], Piece(index, last.start, datum + 1)]
    return [*pieces, Piece(index, datum, datum + 1)]


def micro_batched_pass(
    pool: AdapterPool,
    ops: Sequence[PassOp],
    batches: Sequence[Sequence[Piece]],
    device: torch.device,
    plan: PassPlan,
) -> list[PassOutcome]:
    """The ops' outcomes, their micro-batches each run as one shared pass of the pool's model
    (run_micro_batches), the trainable adapters' gradients kept to put back."""

    def one_pass(pieces: Sequence[PassOp]) -> list[PassOutcome]:
        return shared_pass(pool, pieces, device, plan)

    def kept(pieces: Sequence[PassOp]) -> Callable[[], None]:
        return kept_grads({p.adapter.name: p.adapter for p in pieces if p.backward}.values())

    return run_micro_batches(ops, batches, one_pass, kept)


def run_micro_batches(
    ops: Sequence[PassOp],
    batches: Sequence[Sequence[Piece]],
    run_pass: Callable[[Sequence[PassOp]], list[PassOutcome]],
    keep_grads: Callable[[Sequence[PassOp]], Callable[[], None]],
) -> list[PassOutcome]:
    """Each op's outcome, its pieces' outputs joined (joined_output). An op whose piece fails
    fails whole; if an earlier piece of it had added gradients, every adapter's are put back
    as they were (`keep_grads` returns what restores them) and the pass runs again without it,
    so a failed op adds no gradient, as in one pass. A micro-batch that raises (out of
    memory) puts them back too before the error goes on: the caller retries the whole."""
    if len(batches) == 1:
        return run_pass([piece.of(ops) for piece in batches[0]])
    restore = keep_grads(ops)
    outputs: list[list[ForwardBackwardOutput]] = [[] for _ in ops]
    failed: dict[int, Exception] = {}
    try:
        for batch in batches:
            pieces = [p for p in batch if p.index not in failed]
            outs = run_pass([p.of(ops) for p in pieces]) if pieces else []
            for piece, out in zip(pieces, outs, strict=True):
                if isinstance(out, Exception):
                    failed[piece.index] = out
                else:
                    outputs[piece.index].append(out)
    except BaseException:
        restore()
        raise
    if not any(ops[i].backward and outputs[i] for i in failed):
        return [
            failed[i] if i in failed else joined_output(ops[i], outputs[i]) for i in range(len(ops))
        ]
    restore()
    rest = [i for i in range(len(ops)) if i not in failed]
    again = iter(
        run_micro_batches([ops[i] for i in rest], without(batches, rest), run_pass, keep_grads)
    )
    return [failed[i] if i in failed else next(again) for i in range(len(ops))]


def without(batches: Sequence[Sequence[Piece]], rest: Sequence[int]) -> list[list[Piece]]:
    """The same split of only the ops in `rest` (renumbered as `rest` orders them)."""
    renumbered = {old: new for new, old in enumerate(rest)}
    kept = [
        [replace(p, index=renumbered[p.index]) for p in batch if p.index in renumbered]
        for batch in batches
    ]
    return [batch for batch in kept if batch]


def joined_output(op: PassOp, pieces: Sequence[ForwardBackwardOutput]) -> ForwardBackwardOutput:
    """One op's output from its pieces', as one pass would have given it: the datums' outputs
    in order; each metric summed, but a ':mean' one weighted by its piece's share (of the
    target tokens for a built-in loss, whose means are over tokens; of the datums for an
    uploaded loss, whose means are over datums)."""
    if len(pieces) == 1:
        return pieces[0]
    outputs: list[dict[str, TensorData]] = [o for piece in pieces for o in piece.loss_fn_outputs]
    by_datum = isinstance(op.loss_fn, GraphLoss)
    weights = [
        float(len(piece.loss_fn_outputs))
        if by_datum
        else float(sum(o["logprobs"].data.size for o in piece.loss_fn_outputs))
        for piece in pieces
    ]
    metrics: dict[str, float] = {}
    for key in pieces[0].metrics:
        values = [piece.metrics[key] for piece in pieces]
        if key.endswith(":mean"):
            metrics[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
        else:
            metrics[key] = sum(values)
    return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)
