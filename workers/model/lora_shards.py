"""Where each LoRA tensor of a tensor-parallel base model lives across the group's ranks.

On a column-parallel layer (q/k/v/gate/up: output features split) LoRA's A is whole on every
rank and B holds this rank's output features; on a row-parallel layer (o/down: input features
split) A holds this rank's input features and B is whole. PEFT gives the wrapped layers exactly
these shapes. Files, snapshots and the optimizer's state outside the process are always whole
(what a one-process worker writes): `gather` joins the shards, `split` cuts them again.

The whole tensors (A of a column-parallel layer, B of a row-parallel one) get a part of their
gradient on each rank: the ranks' parts are summed in backward (`partial_grad`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from queue_tinker.workers.model.families import TensorParallel
from queue_tinker.workers.model.tensor_parallel import Shards


def _layer_and_matrix(key: str) -> tuple[str, str] | None:
    """('q_proj', 'lora_B') for 'base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight'."""
    parts = key.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part in ("lora_A", "lora_B"):
            return parts[i - 1], part
    return None


def shard_dim(key: str, plan: TensorParallel) -> int | None:
    """The dimension a LoRA tensor is split on across ranks; None: whole on every rank."""
    found = _layer_and_matrix(key)
    if found is None:
        return None
    layer, matrix = found
    if layer in plan.column and matrix == "lora_B":
        return 0
    if layer in plan.row and matrix == "lora_A":
        return 1
    return None


def partial_grad(key: str, plan: TensorParallel) -> bool:
    """Whether a whole LoRA tensor's gradient is computed in parts, one a rank, to be summed."""
    found = _layer_and_matrix(key)
    if found is None:
        return False
    layer, matrix = found
    return (layer in plan.column and matrix == "lora_A") or (
        layer in plan.row and matrix == "lora_B"
    )


def split(
    tensors: Mapping[str, torch.Tensor], shards: Shards, plan: TensorParallel
) -> dict[str, torch.Tensor]:
    """This rank's part of whole tensors (keyed as the adapter's parameters are)."""
    out = {}
    for key, tensor in tensors.items():
        dim = shard_dim(key, plan)
        if dim is None:
            out[key] = tensor
        else:
            part = shards.span(tensor.shape[dim])
            out[key] = tensor.narrow(dim, part.start, part.stop - part.start).contiguous()
    return out


def gather(
    tensors: Mapping[str, torch.Tensor], shards: Shards, plan: TensorParallel
) -> dict[str, torch.Tensor]:
    """The whole tensors from every rank's part (a collective: every rank calls it with the
    same keys in the same order)."""
    out = {}
    for key, tensor in tensors.items():
        dim = shard_dim(key, plan)
        if dim is None or shards.world == 1:
            out[key] = tensor
            continue
        parts = [torch.empty_like(tensor) for _ in range(shards.world)]
        dist.all_gather(parts, tensor.contiguous(), group=shards.host_group or shards.group)
        out[key] = torch.cat(parts, dim=dim)
    return out


def grad_norm(
    params: Mapping[str, torch.nn.Parameter], shards: Shards, plan: TensorParallel
) -> torch.Tensor:
    """The 2-norm of the whole adapter's gradients: split tensors' squares summed over ranks,
    whole ones counted once."""
    device = next(iter(params.values())).device
    split_sq = torch.zeros((), dtype=torch.float32, device=device)
    whole_sq = torch.zeros((), dtype=torch.float32, device=device)
    for key, p in params.items():
        if p.grad is None:
            continue
        square = p.grad.detach().float().pow(2).sum()
        if shard_dim(key, plan) is None:
            whole_sq += square
        else:
            split_sq += square
    shards.all_reduce(split_sq)
    return (split_sq + whole_sq).sqrt()
