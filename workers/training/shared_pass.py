"""forward / forward_backward ops, of one adapter or many, in one model pass.

Every op's data goes into one right-padded batch (or packed rows: packing.py), each op's rows
together (a model's ops side by side), and every LoRA layer adds to each block of rows its own
adapter's update (model/lora/row_blocks.py), so all ops share the base model's matmuls. Each op's
loss comes from its own rows alone, with its own loss function; the backward ops' losses are
summed and differentiated once. An adapter's parameters touch only its own ops' rows, so the
gradient each adapter receives is the sum of its own ops' gradients: what running them one at
a time accumulates in .grad. A single op runs the same code: it is a pass of one block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from peft.tuners.lora import Linear as LoraLinear

from queue_tinker.types.enums import LossFn
from queue_tinker.types.requests.training import ForwardBackwardOutput
from queue_tinker.types.tensors import Datum, TensorData
from queue_tinker.workers.model import vision_language
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.lora import grouped_lora
from queue_tinker.workers.model.lora.grouped_lora import grouped_blocks
from queue_tinker.workers.model.lora.row_blocks import (
    LoraLayer,
    blocks_of,
    row_blocks,
    stacked_blocks,
    stacks,
)
from queue_tinker.workers.model.vision_language import ImageInputs
from queue_tinker.workers.training import model_pass
from queue_tinker.workers.training.custom_loss_graph import GraphLoss
from queue_tinker.workers.training.losses import (
    Metric,
    Sequences,
    device_batch_loss,
    joined_batch_loss,
)
from queue_tinker.workers.training.model_pass import LoraForm, PassPlan
from queue_tinker.workers.training.packing import RowBatch, row_batch
from queue_tinker.workers.training.routing import Routing, recorded_routing, routing_metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassOp:
    """One forward / forward_backward op, checked, with its resident adapter."""

    adapter: Adapter
    data: Sequence[Datum]
    loss_fn: LossFn | GraphLoss
    config: dict[str, float]
    backward: bool
    # Per datum, its images as the model reads them (model/vision_language.py); empty: the
    # op has none.
    images: tuple[ImageInputs | None, ...] = ()

    @property
    def datum_images(self) -> list[ImageInputs | None]:
        return list(self.images) or [None] * len(self.data)

    @property
    def width(self) -> int:
        return max(d.model_input.length for d in self.data)


def padded_tokens(ops: Sequence[PassOp]) -> int:
    """Rows x width of the ops' shared batch: what its activations cost."""
    if not ops:
        return 0
    return sum(len(op.data) for op in ops) * max(op.width for op in ops)


def shared_pass(
    pool: AdapterPool, ops: Sequence[PassOp], device: torch.device, plan: PassPlan | None = None
) -> list[ForwardBackwardOutput | Exception]:
    """Run the ops in one forward (and at most one backward) pass of the pool's model; one
    output per op, in order, or the error of an op whose loss failed (that op alone adds no
    gradient). A failure of the pass itself raises."""
    plan = plan or PassPlan()
    layers = pool.lora_layers()
    form = lora_form(pool, ops, device, plan)
    if form != "grouped":
        return _pass(pool, ops, device, plan, form)
    # Grouped, the rows go in the order of the adapters' slots (grouped_lora.order).
    linears = cast(list[LoraLinear], layers)  # groups(): plain LoRA linears only
    names = [op.adapter.name for op in ops]
    permutation = grouped_lora.order(names, pool.lora_stacks.slots(linears, names))
    outcomes = _pass(pool, [ops[i] for i in permutation], device, plan, form)
    in_order: list[ForwardBackwardOutput | Exception] = list(outcomes)
    for outcome, index in zip(outcomes, permutation, strict=True):
        in_order[index] = outcome
    return in_order


def lora_form(
    pool: AdapterPool, ops: Sequence[PassOp], device: torch.device, plan: PassPlan
) -> LoraForm:
    """The form of the pass's LoRA (PassPlan.lora_form_for): one adapter runs its blocks;
    several, what the plan and the layers allow (each adapter's ops counted as one block, the
    grouped form putting them together)."""
    names = [op.adapter.name for op in ops]
    if len(set(names)) < 2:
        return "blocks"
    form, groups = lora_form_of(pool.lora_layers(), names, device, plan)
    _say_form(form, len(set(names)), groups, plan)
    return form


def lora_form_of(
    layers: Sequence[LoraLayer], names: Sequence[str], device: torch.device, plan: PassPlan
) -> tuple[LoraForm, bool]:
    """The form a pass of these adapters' rows takes on these LoRA layers, and whether the
    grouped form could stand in (grouped_lora.groups). Both questions ask only which adapters
    share the pass, so each is one block here."""
    if len(set(names)) < 2:
        return "blocks", False
    blocks = [(name, 1) for name in dict.fromkeys(names)]
    groups = grouped_lora.groups(layers, blocks)
    return plan.lora_form_for(device, groups=groups, stacks=stacks(layers, blocks)), groups


_said: list[str] = [""]  # the last LoRA form logged


def _say_form(form: LoraForm, adapters: int, groups: bool, plan: PassPlan) -> None:
    """Which form a pass of several adapters takes and why, at info when it changes (a
    training loop's passes take one form), at debug otherwise."""
    if form == "grouped":
        why = "one rank a layer, plain LoRA"
    elif plan.lora_form is not None and plan.lora_form != form:
        why = f"QT_LORA_FORM={plan.lora_form} does not apply to these adapters"
    elif not groups:
        why = "not groupable: mixed ranks in a layer, dropout, DoRA, a LoRA bias or experts"
    else:
        why = f"QT_LORA_FORM={form}"
    said = f"a pass of {adapters} adapters' ops runs their LoRA {form} ({why})"
    log.log(logging.INFO if said != _said[0] else logging.DEBUG, said)
    _said[0] = said


def _pass(
    pool: AdapterPool,
    ops: Sequence[PassOp],
    device: torch.device,
    plan: PassPlan,
    form: LoraForm,
) -> list[ForwardBackwardOutput | Exception]:
    # Every adapter with a backward op trains; a forward-only one does not (its rows then
    # build no graph of their own).
    adapters = {op.adapter.name: op.adapter for op in ops}  # each model once
    trainable = {op.adapter.name for op in ops if op.backward}
    data = [datum for op in ops for datum in op.data]
    images = [image for op in ops for image in op.datum_images]
    blocks = blocks_of((op.adapter.name, len(op.data)) for op in ops)  # (adapter, datums)
    rows = rows_for(data, device, plan, groups=[count for _, count in blocks], images=images)
    pass_blocks = [(name, n) for (name, _), n in zip(blocks, rows.group_rows, strict=True)]
    layers = pool.lora_layers()
    plan = plan.for_pass([a.config.rank for a in adapters.values()], form == "stacked")
    # Copied to the device before the forward is launched, so no copy waits for it.
    inputs = [op_loss_inputs(op.data, device) for op in ops]
    # The LoRA form stays in place through backward: checkpointed layers and logit chunks
    # recompute their forward there, through the same LoRA layers.
    with (
        pool.shared(adapters.values(), trainable),
        grads_kept_on_error([adapters[name] for name in trainable]),
        _lora(form, pool, layers, pass_blocks),
    ):
        with torch.set_grad_enabled(bool(trainable)), recorded_routing(pool.model) as routing:
            logprobs = data_logprobs(pool.model, data, rows, plan, images)
        outcomes = _losses_and_backward(ops, logprobs, inputs)
    _add_routing_metrics(ops, outcomes, routing, rows)
    return outcomes


def _lora(
    form: LoraForm,
    pool: AdapterPool,
    layers: Sequence[LoraLayer],
    blocks: Sequence[tuple[str, int]],
) -> AbstractContextManager[None]:
    if form == "grouped":
        return grouped_blocks(layers, blocks, pool.lora_stacks, pool.lora_compute)
    lora = stacked_blocks if form == "stacked" else row_blocks
    return lora(layers, blocks, pool.lora_compute)


def _add_routing_metrics(
    ops: Sequence[PassOp],
    outcomes: Sequence[ForwardBackwardOutput | Exception],
    routing: Routing,
    rows: RowBatch,
) -> None:
    """On a mixture-of-experts model, each op's routing metrics (routing.py), from its own
    datums' tokens."""
    if not routing.chosen:
        return
    batch_rows, width = rows.ids.shape
    start = 0
    for op, outcome in zip(ops, outcomes, strict=True):
        places = rows.places[start : start + len(op.data)]
        start += len(op.data)
        if isinstance(outcome, ForwardBackwardOutput):
            spans = [
                (row, first, d.model_input.length)
                for (row, first), d in zip(places, op.data, strict=True)
            ]
            outcome.metrics.update(
                routing_metrics(routing.chosen, batch_rows, width, spans, routing.experts)
            )


@dataclass(frozen=True)
class _Unread:
    """An op's loss taken, its numbers still on the device."""

    metrics: dict[str, Metric]
    logprobs: torch.Tensor  # its datums' target logprobs, datum after datum
    lengths: list[int]  # each datum's share of them


def _losses_and_backward(
    ops: Sequence[PassOp],
    logprobs: torch.Tensor,
    inputs: Sequence[LossInputs],
) -> list[ForwardBackwardOutput | Exception]:
    """Each op's loss on its own datums' logprobs (`logprobs`: every datum's, datum after
    datum), then one backward of the backward ops' sum, then every op's outputs and metrics
    read from the device at once. Nothing waits for the device before the backward is
    launched: on a GPU the host queues the losses and the backward while the forward still
    runs, and a pass waits for its device once, not once per datum and metric."""
    taken: list[_Unread | Exception] = []
    losses: list[torch.Tensor] = []
    start = 0
    for op, op_inputs in zip(ops, inputs, strict=True):
        lengths = op_inputs.lengths
        own = logprobs[start : start + sum(lengths)]
        start += sum(lengths)
        try:
            with torch.set_grad_enabled(op.backward):
                loss, metrics = _op_loss(op, own, op_inputs)
        except Exception as exc:  # this op's failure; the others go on
            taken.append(exc)
            continue
        taken.append(_Unread(metrics, own, lengths))
        if op.backward:
            losses.append(loss)
    if losses:
        # d(sum of the ops' losses)/d(adapter) is the sum over that adapter's own ops: the
        # other ops' rows never touch its parameters.
        torch.stack(losses).sum().backward()
    return _read(taken)


def _op_loss(
    op: PassOp, logprobs: torch.Tensor, inputs: LossInputs
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """The op's loss and metrics: over all its datums' tokens at once where its loss is a
    built-in one and every datum sent the same inputs (a few kernels however many datums),
    else datum by datum (a custom loss runs on each datum as the SDK runs it)."""
    if isinstance(op.loss_fn, LossFn) and inputs.joined is not None:
        assert inputs.sequences is not None  # made with joined
        return joined_batch_loss(
            op.loss_fn.value, logprobs, inputs.joined, op.config, inputs.sequences
        )
    loss_fn = op.loss_fn.value if isinstance(op.loss_fn, LossFn) else op.loss_fn
    per_datum = logprobs.split(inputs.lengths)
    return device_batch_loss(loss_fn, per_datum, inputs.per_datum, op.config)


def _read(taken: Sequence[_Unread | Exception]) -> list[ForwardBackwardOutput | Exception]:
    """Each op's output: its datums' logprobs and its metrics, copied from the device in one
    piece (fp32) and cut up here."""
    pieces = [
        t.detach().float().reshape(-1)
        for op in taken
        if isinstance(op, _Unread)
        for t in (
            op.logprobs,
            *(m for m in op.metrics.values() if isinstance(m, torch.Tensor)),
        )
    ]
    flat = torch.cat(pieces).cpu().numpy() if pieces else np.zeros(0, np.float32)
    at = 0

    def take(n: int) -> np.ndarray:
        nonlocal at
        at += n
        return flat[at - n : at]

    outcomes: list[ForwardBackwardOutput | Exception] = []
    for op in taken:
        if isinstance(op, Exception):
            outcomes.append(op)
            continue
        outputs = [{"logprobs": TensorData.from_numpy(take(n))} for n in op.lengths]
        metrics = {
            key: float(take(1)[0]) if isinstance(value, torch.Tensor) else float(value)
            for key, value in op.metrics.items()
        }
        outcomes.append(ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics))
    return outcomes


# --- the pieces of a pass ------------------------------------------------------------------
def rows_for(
    data: Sequence[Datum],
    device: torch.device,
    plan: PassPlan,
    groups: Sequence[int] | None = None,
    images: Sequence[ImageInputs | None] = (),
) -> RowBatch:
    """The data laid out in rows for one pass: a datum a row, or packed (plan.packs) within
    each group of consecutive datums (`groups`; default: all of them). A datum with images
    (`images`, per datum) takes its ids with their placeholders; a pass with images is not
    packed (the model's 3-D positions are computed per row), so rows are in datum order."""
    images = list(images) or [None] * len(data)
    tokens = [
        image.ids if image is not None else d.model_input.to_ints()
        for d, image in zip(data, images, strict=True)
    ]
    pack = plan.packs([len(t) for t in tokens]) and not any(images)
    return row_batch(tokens, groups or [len(tokens)], device, pack=pack)


def data_logprobs(
    model: torch.nn.Module,
    data: Sequence[Datum],
    rows: RowBatch,
    plan: PassPlan,
    images: Sequence[ImageInputs | None] = (),
) -> torch.Tensor:
    """log p(target_i | tokens <= i) of every datum, datum after datum: one float32 tensor of
    all their target tokens."""
    device = rows.ids.device
    targets = [np.asarray(d.loss_fn_inputs["target_tokens"].data) for d in data]
    dtype = model_pass.causal_lm(model).dtype
    return model_pass.target_logprobs(
        model,
        rows,
        model_pass.padded_targets(rows, targets),
        model_pass.scored_positions(rows, [len(t) for t in targets]),
        plan,
        vision_language.joined(images, device, dtype),
    )


@dataclass(frozen=True)
class LossInputs:
    """One op's loss inputs on the device: each datum's as it sent them, and, where every
    datum sent the same 1-D names in the same dtypes, each name's values of all its datums
    joined, datum after datum (what a loss over all the op's tokens at once reads), with
    which datum each of their values is from."""

    per_datum: list[dict[str, torch.Tensor]]
    lengths: list[int]  # each datum's target tokens
    joined: dict[str, torch.Tensor] | None
    sequences: Sequences | None = None


def op_loss_inputs(data: Sequence[Datum], device: torch.device) -> LossInputs:
    """Each datum's loss inputs on the device, as it sent them (dtype and all): the datums'
    1-D inputs of one name and dtype go over in one copy and are cut into views there (a
    copy waits for the device: an RL op of 64 datums made 192 of them)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in data]
    groups: dict[tuple[str, np.dtype[Any]], list[tuple[int, np.ndarray]]] = {}
    for i, datum in enumerate(data):
        for key, value in datum.loss_fn_inputs.items():
            array = np.asarray(value.data)
            if array.ndim == 1:
                groups.setdefault((key, array.dtype), []).append((i, array))
            else:
                out[i][key] = torch.from_numpy(np.array(array, copy=True)).to(device)
    joined: dict[str, torch.Tensor] | None = {}
    for (key, _), members in groups.items():
        values = torch.from_numpy(np.concatenate([array for _, array in members])).to(device)
        pieces = values.split([len(array) for _, array in members])
        for (i, _), piece in zip(members, pieces, strict=True):
            out[i][key] = piece
        if joined is not None and len(members) == len(data) and key not in joined:
            joined[key] = values
        else:  # a datum lacks it, sent it 2-D, or sent another dtype
            joined = None
    lengths = [len(d.loss_fn_inputs["target_tokens"].data) for d in data]
    if joined is None or any(len(inputs) != len(joined) for inputs in out):
        return LossInputs(out, lengths, joined=None)
    return LossInputs(out, lengths, joined=joined, sequences=Sequences.of(lengths, device))


@contextmanager
def grads_kept_on_error(adapters: Sequence[Adapter]) -> Iterator[None]:
    """A backward that fails half-way (out of memory) would have added to some tensors' .grad
    and not to others: the gradients pending from earlier ops are set aside (not copied), the
    pass makes its own, and they are put back as they were if it fails, so a failed op leaves
    its model (and every other model of the pass) as it found it. Once the pass is through,
    the pending ones are added to its own in one multi-tensor add (a + b is b + a: the sums
    are those autograd's accumulation makes, to the bit); a clone of each pending gradient was
    a kernel per LoRA tensor (~900 at the 8B shape: bench.mfu --count)."""
    params = [p for adapter in adapters for p in adapter.params.values()]
    pending = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    except BaseException:
        for p, grad in zip(params, pending, strict=True):
            p.grad = grad
        raise
    sums: list[torch.Tensor] = []
    earlier: list[torch.Tensor] = []
    for p, grad in zip(params, pending, strict=True):
        if grad is None:
            continue
        if p.grad is None:  # the pass gave it none (its op's loss failed)
            p.grad = grad
        else:
            sums.append(p.grad)
            earlier.append(grad)
    if sums:
        torch._foreach_add_(sums, earlier)


def kept_grads(adapters: Iterable[Adapter]) -> Callable[[], None]:
    """What puts the adapters' gradients back as they are now. Only gradients pending from
    earlier ops are copied, and most steps have none."""
    kept = [
        (p, p.grad.clone() if p.grad is not None else None)
        for adapter in adapters
        for p in adapter.params.values()
    ]

    def restore() -> None:
        for p, grad in kept:
            p.grad = grad

    return restore
