"""The math of forward / forward_backward / optim_step on the active adapter."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from queue_tinker.types.enums import LossFn
from queue_tinker.types.tensors import Datum, TensorData
from queue_tinker.types.training import (
    AdamParams,
    DimuonParams,
    ForwardBackwardOutput,
    OptimParams,
)
from queue_tinker.workers.model.adapters import Adapter
from queue_tinker.workers.training import model_pass
from queue_tinker.workers.training.custom_loss_graph import GraphLoss
from queue_tinker.workers.training.dimuon import dimuon_step
from queue_tinker.workers.training.losses import batch_loss
from queue_tinker.workers.training.model_pass import PassPlan
from queue_tinker.workers.training.packing import RowBatch, row_batch

log = logging.getLogger(__name__)


def rows_for(
    data: Sequence[Datum], device: torch.device, plan: PassPlan, groups: Sequence[int] | None = None
) -> RowBatch:
    """The data laid out in rows for one pass: a datum a row, or packed (plan.packs) within
    each group of consecutive datums (`groups`; default: all of them)."""
    tokens = [d.model_input.to_ints() for d in data]
    return row_batch(
        tokens, groups or [len(tokens)], device, pack=plan.packs([len(t) for t in tokens])
    )


def target_logprobs(
    model: torch.nn.Module, data: Sequence[Datum], rows: RowBatch, plan: PassPlan
) -> list[torch.Tensor]:
    """log p(target_i | tokens <= i) for every datum, as float32 tensors (T_i,)."""
    device = rows.ids.device
    targets = [
        torch.from_numpy(np.array(d.loss_fn_inputs["target_tokens"].data, copy=True)).to(device)
        for d in data
    ]
    return model_pass.target_logprobs(model, rows, targets, plan)


def loss_inputs(datum: Datum, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        k: torch.from_numpy(np.array(v.data, copy=True)).to(device)
        for k, v in datum.loss_fn_inputs.items()
    }


def op_loss(
    logprobs: Sequence[torch.Tensor],
    data: Sequence[Datum],
    loss_fn: LossFn | GraphLoss,
    config: dict[str, float],
    device: torch.device,
) -> tuple[torch.Tensor, ForwardBackwardOutput]:
    """One op's loss (the sum of its data's losses) and its output: per-datum logprobs and
    the loss metrics."""
    inputs = [loss_inputs(d, device) for d in data]
    loss, metrics = batch_loss(
        loss_fn if isinstance(loss_fn, GraphLoss) else loss_fn.value, logprobs, inputs, config
    )
    outputs = [
        {"logprobs": TensorData.from_numpy(lp.detach().float().cpu().numpy())} for lp in logprobs
    ]
    return loss, ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)


@contextmanager
def grads_kept_on_error(adapters: Sequence[Adapter]) -> Iterator[None]:
    """A backward that fails half-way (out of memory) has added to some tensors' .grad and not
    to others: put every adapter's gradients back as they were, so a failed op leaves its
    model (and, in a shared pass, every other model of the pass) as it found it. Only
    gradients pending from earlier ops are copied, and most steps have none."""
    kept = [
        (p, p.grad.clone() if p.grad is not None else None)
        for adapter in adapters
        for p in adapter.params.values()
    ]
    try:
        yield
    except BaseException:
        for p, grad in kept:
            p.grad = grad
        raise


def forward_backward(
    model: torch.nn.Module,
    data: Sequence[Datum],
    loss_fn: LossFn | GraphLoss,
    config: dict[str, float],
    device: torch.device,
    *,
    backward: bool,
    plan: PassPlan | None = None,
) -> ForwardBackwardOutput:
    """Loss and per-datum logprobs; with `backward`, gradients are added to the adapter's
    .grad (accumulating until optim_step, as in torch)."""
    plan = plan or PassPlan()
    with torch.set_grad_enabled(backward):
        logprobs = target_logprobs(model, data, rows_for(data, device, plan), plan)
        loss, out = op_loss(logprobs, data, loss_fn, config, device)
        if backward:
            loss.backward()
    return out


def optim_step(adapter: Adapter, params: OptimParams) -> dict[str, float]:
    """One optimizer step with this call's hyperparameters (torch.optim.AdamW's, or Dimuon's
    for DimuonParams), then clear the grads."""
    return optim_steps([(adapter, params)])[0]


def optim_steps(steps: Sequence[tuple[Adapter, OptimParams]]) -> list[dict[str, float]]:
    """optim_step for several adapters (each at most once), as if one after another.

    Each adapter's gradients are clipped to its own norm; then the adapters whose calls share
    hyperparameters step together, as one torch.optim.AdamW over all their tensors. AdamW is
    elementwise per tensor, with a step count per tensor, so that changes nothing but the number
    of multi-tensor kernel calls: one set for a whole cross-adapter batch instead of one per
    adapter (on the CPU most of an adapter's step is that per-call cost).

    An adapter whose gradients are not finite (a diverging loss, advantages of 1e30) is not
    stepped: one such step would turn its weights and moments to NaN for good. Its weights,
    moments and step count stay as they were, its gradients are cleared, and its metrics say
    so (`skipped_nonfinite:sum` 1, with the gradient norm that was found)."""
    norms = [_clip(adapter, params) for adapter, params in steps]
    together: dict[tuple[float, ...], tuple[AdamParams, list[Adapter]]] = {}
    for (adapter, params), norm in zip(steps, norms, strict=True):
        if not math.isfinite(norm):
            log.warning(
                "model %s: optim_step skipped: the gradient norm is %s; weights and "
                "optimizer state are unchanged, gradients cleared",
                adapter.model_id,
                norm,
            )
            continue
        if isinstance(
            params, DimuonParams
        ):  # a run created with Dimuon: workers/training/dimuon.py
            dimuon_step(
                list(adapter.params.values()), adapter.optimizer.state, params, adapter.config.rank
            )
            continue
        key = (params.learning_rate, params.beta1, params.beta2, params.eps, params.weight_decay)
        together.setdefault(key, (params, []))[1].append(adapter)
    for params, adapters in together.values():
        _adamw(adapters, params)
    metrics = []
    for (adapter, params), norm in zip(steps, norms, strict=True):
        for p in adapter.params.values():
            p.grad = None
        skipped = not math.isfinite(norm)
        adapter.step += 0 if skipped else 1
        metrics.append(
            {
                "grad_norm:mean": norm,
                "learning_rate:mean": params.learning_rate,
                "step:max": float(adapter.step),
                "skipped_nonfinite:sum": float(skipped),
            }
        )
    return metrics


def _clip(adapter: Adapter, params: OptimParams) -> float:
    """Clip the adapter's gradients to params.grad_clip_norm (<= 0: no clipping); their norm
    before clipping. A norm that is not finite leaves the gradients alone (the step is
    skipped; scaling by max_norm / inf would hide the divergence)."""
    trainable = [p for p in adapter.params.values() if p.grad is not None]
    if not trainable:
        return 0.0
    grads = [p.grad for p in trainable if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if params.grad_clip_norm > 0 and bool(torch.isfinite(norm)):
        torch.nn.utils.clip_grads_with_norm_(trainable, params.grad_clip_norm, norm)
    return float(norm)


def _adamw(adapters: Sequence[Adapter], params: AdamParams) -> None:
    """One AdamW step over the adapters' tensors with these hyperparameters. The moments live
    in each adapter's own optimizer state (what snapshots and checkpoints save); a combined
    optimizer borrows them for the step and hands new ones back."""
    if len(adapters) == 1:  # its own optimizer: nothing to borrow
        _own_step(adapters[0].optimizer, params)
    else:
        _combined_step(adapters, params)


def _own_step(optimizer: torch.optim.Optimizer, params: AdamParams) -> None:
    for group in optimizer.param_groups:
        group.update(
            lr=params.learning_rate,
            betas=(params.beta1, params.beta2),
            eps=params.eps,
            weight_decay=params.weight_decay,
        )
    optimizer.step()


def _combined_step(adapters: Sequence[Adapter], params: AdamParams) -> None:
    """One foreach AdamW over several adapters' tensors, with each adapter's moments lent to
    it and the new ones handed back."""
    tensors = [p for adapter in adapters for p in adapter.params.values()]
    combined = torch.optim.AdamW(
        tensors,
        lr=params.learning_rate,
        betas=(params.beta1, params.beta2),
        eps=params.eps,
        weight_decay=params.weight_decay,
        foreach=True,
    )
    for adapter in adapters:
        for p in adapter.params.values():
            if p in adapter.optimizer.state:
                combined.state[p] = adapter.optimizer.state[p]
    combined.step()
    for adapter in adapters:
        for p in adapter.params.values():
            if p in combined.state:  # a tensor's first step made its moments here
                adapter.optimizer.state[p] = combined.state[p]
