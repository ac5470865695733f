"""optim_step: each adapter's gradients clipped to its own norm, then AdamW (torch's, one
multi-tensor call for all adapters that share hyperparameters) or Dimuon (below)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from queue_tinker.errors import UserInputError
from queue_tinker.types import codec
from queue_tinker.types.enums import Optimizer
from queue_tinker.types.requests.training import (
    AdamParams,
    DimuonParams,
    OptimParams,
)
from queue_tinker.workers.interface import parse_body
from queue_tinker.workers.model.adapters import Adapter

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
        if isinstance(params, DimuonParams):  # a run created with Dimuon: dimuon_step
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


# --- Dimuon ---------------------------------------------------------------------------------
# Dimuon: Tinker's second optimizer, for the LoRA matrices (Tinker's DimuonParams).
#
# For each LoRA matrix W (r x d or d x r, r = the LoRA rank), with gradient G already clipped to
# the adapter's global norm:
#
#     M <- beta1 * M + (1 - beta1) * G                       momentum (the saved state)
#     P  = R^-1/4 M C^-1/4                                   row / column preconditioner:
#          R = diag(mean_j M_ij^2 / s + damping),             mean squares of M's rows and
#          C = diag(mean_i M_ij^2 / s + damping),             columns, relative to M's own
#          s = mean M_ij^2                                     mean square, damped
#     O  = msign(P)                                          matrix sign (U V^T of P's SVD),
#                                                            by Newton-Schulz iteration
#     D  = sqrt(r) * O / ||O||_F                             a direction of Frobenius norm sqrt(r)
#     W <- W - lr * (32 / r) ** rank_lr_correction_exponent * D
#
# The preconditioner's statistics are taken relative to M's mean square, so the whole update is
# independent of the gradient's scale (as the matrix sign is) and `damping` is a fraction of it.
# Newton-Schulz runs a fixed number of steps (Muon's quintic; its result has singular values
# near but not at 1), and the rescaling makes the direction's norm exactly sqrt(r), as
# DimuonParams.learning_rate says. Tinker does not publish these internals: this is the update
# its field descriptions document, with the constants below as this service's choice.
NEWTON_SCHULZ_STEPS = 5
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's quintic iteration
NORM_EPS = 1e-7
REFERENCE_RANK = 32


def matrix_sign(x: torch.Tensor, steps: int = NEWTON_SCHULZ_STEPS) -> torch.Tensor:
    """An approximation of U V^T for x = U S V^T, by Newton-Schulz iteration on x scaled to
    spectral norm <= 1 (by its Frobenius norm), in fp32."""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    wide = x.shape[0] <= x.shape[1]
    y = x.float() if wide else x.float().T
    y = y / (y.norm() + NORM_EPS)
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y if wide else y.T


def preconditioned(m: torch.Tensor, damping: float) -> torch.Tensor:
    """m scaled by its rows' and columns' damped relative mean squares, to the power -1/4."""
    square = m.float().square()
    scale = square.mean() + NORM_EPS**2
    rows = square.mean(dim=1, keepdim=True) / scale + damping
    cols = square.mean(dim=0, keepdim=True) / scale + damping
    return m.float() * rows.pow(-0.25) * cols.pow(-0.25)


def direction(m: torch.Tensor, rank: int, damping: float) -> torch.Tensor:
    """The update direction of one matrix's momentum: Frobenius norm sqrt(rank)."""
    shape = m.shape
    matrix = m.reshape(shape[0], -1) if m.dim() != 2 else m
    sign = matrix_sign(preconditioned(matrix, damping))
    return (sign * (math.sqrt(rank) / (sign.norm() + NORM_EPS))).reshape(shape)


def learning_rate(params: DimuonParams, rank: int) -> float:
    """The learning rate corrected for the LoRA rank relative to rank 32."""
    return params.learning_rate * (REFERENCE_RANK / rank) ** params.rank_lr_correction_exponent


@torch.no_grad()
def dimuon_step(
    tensors: Sequence[torch.nn.Parameter],
    state: dict[torch.Tensor, dict],
    params: DimuonParams,
    rank: int,
) -> None:
    """One step of every tensor with a gradient. `state` is the adapter's optimizer state:
    per tensor its momentum (`exp_avg`, where AdamW keeps its first moment, so snapshots and
    checkpoints save and restore it the same way) and step count."""
    lr = learning_rate(params, rank)
    for p in tensors:
        if p.grad is None:
            continue
        moments = state.setdefault(p, {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p)})
        momentum = moments["exp_avg"]
        momentum.mul_(params.beta1).add_(p.grad, alpha=1 - params.beta1)
        p.add_(direction(momentum, rank, params.damping).to(p.dtype), alpha=-lr)
        moments["step"] += 1


def parse_optim_params(optimizer: Optimizer, payload: bytes) -> OptimParams:
    """An optim_step op's body, as the run's optimizer takes it; the other family's
    hyperparameters are the caller's error, named as such."""
    raw = codec.decode(payload) if payload else {}
    sent = (
        Optimizer.DIMUON
        if isinstance(raw, dict) and raw.get("type") == "dimuon"
        else Optimizer.ADAMW
    )
    if sent is not optimizer:
        wanted = "DimuonParams" if optimizer is Optimizer.DIMUON else "AdamParams"
        raise UserInputError(
            f"optimizer_params: this run was created with the {optimizer} "
            f"optimizer; send {wanted}, not {sent} hyperparameters"
        )
    if sent is Optimizer.DIMUON:
        return parse_body(DimuonParams, payload)
    return parse_body(AdamParams, payload)
