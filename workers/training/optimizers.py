"""optim_step: each adapter's gradients clipped to its own norm, then AdamW (torch's, one
multi-tensor call for all adapters that share hyperparameters) or Dimuon (dimuon.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from queue_tinker.types.requests.training import (
    AdamParams,
    DimuonParams,
    OptimParams,
)
from queue_tinker.workers.model.adapters import Adapter
from queue_tinker.workers.training.dimuon import dimuon_step

log = logging.getLogger(__name__)


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
    norms = _clip_all(steps)
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


def _clip_all(steps: Sequence[tuple[Adapter, OptimParams]]) -> list[float]:
    """Clip each adapter's gradients to its params.grad_clip_norm (<= 0: no clipping); their
    norms before clipping, read back in one device sync for all the adapters (a sync each
    would wait for every adapter's norm in turn). A norm that is not finite leaves the
    gradients alone (the step is skipped; scaling by max_norm / inf would hide the
    divergence)."""
    norms: list[tuple[list[torch.nn.Parameter], torch.Tensor] | None] = []
    for adapter, _ in steps:
        trainable = [p for p in adapter.params.values() if p.grad is not None]
        norms.append((trainable, adapter.grad_norm(adapter.params).float()) if trainable else None)
    computed = [norm for _, norm in filter(None, norms)]
    values = iter(torch.stack(computed).tolist() if computed else [])
    found = []
    for (_, params), norm in zip(steps, norms, strict=True):
        if norm is None:
            found.append(0.0)
            continue
        trainable, total = norm
        value = next(values)
        if params.grad_clip_norm > 0 and math.isfinite(value):
            torch.nn.utils.clip_grads_with_norm_(trainable, params.grad_clip_norm, total)
        found.append(value)
    return found


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
