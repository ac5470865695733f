"""Tensor parallelism of a Llama-class decoder over the ranks of a worker group (Megatron-style).

Each rank keeps a slice of every attention and MLP matrix: q/k/v/gate/up are column-parallel
(their output features, i.e. whole heads and a slice of the MLP's width, split across ranks),
o/down are row-parallel (their input features split), and one all-reduce after each attention
and each MLP sums the ranks' partial outputs. Embeddings, norms and the unembedding stay whole
on every rank (they are a few percent of a large model's weights, and whole logits let every
rank choose the same token without a gather). Attention heads and, with them, the KV cache are
split: a rank attends with its own heads only, and sampling never gathers a weight.

The all-reduces sit on the attention and MLP modules themselves (hooks on their input and
output), not in the linear layers: PEFT wraps the linear layers with LoRA, and the LoRA update of
a row-parallel layer is a partial sum too (its A is split on the input features), so one
all-reduce after o/down sums base and LoRA partials together. Autograd sees Megatron's pair of
operators: identity forward / all-reduce backward at a block's input, all-reduce forward /
identity backward at its output.

Hand-written rather than transformers' tp_plan (DTensor): PEFT's LoRA layers over DTensor
weights, on the CPU with gloo, are not a path either library tests, and a step's numbers must
equal one process's to 1e-5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from queue_tinker.errors import WorkerGroupError
from queue_tinker.workers.model.families import family_of, shardable_families

# A base model a worker group cannot shard; the message names the setting and why.
ShardingError = WorkerGroupError


@dataclass(frozen=True)
class Shards:
    """This process's place in the group: rank of world, and the process group they share."""

    rank: int
    world: int
    group: Any = None  # the ProcessGroup of the compute (nccl on CUDA); None: the default one
    # A gloo group for whole tensors moved through host memory (snapshots, checkpoints):
    # nccl moves device tensors only. None: `group` (gloo already, on the CPU).
    host_group: Any = None

    def span(self, size: int) -> slice:
        """This rank's contiguous part of a dimension of `size` (divisible by world)."""
        part = size // self.world
        return slice(self.rank * part, (self.rank + 1) * part)

    def least(self, values: Sequence[int]) -> list[int]:
        """Each value's smallest over the ranks (through host memory)."""
        if self.world == 1:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.host_group or self.group)
        return [int(v) for v in tensor.tolist()]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, into `tensor` (a no-op in a group of one)."""
        if self.world > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor


def check_shardable(config: PretrainedConfig, world: int) -> None:
    """Refuse, naming the setting and the reason, a base model this module cannot split."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "vision_config", None) is not None:
        raise ShardingError(
            f"base model type {model_type!r}: vision-language models are not served by a "
            "sharded worker group (its vision tower is not split); run it with --ranks 1"
        )
    if any(getattr(config, name, None) for name in ("num_experts", "num_local_experts")):
        raise ShardingError(
            f"base model type {model_type!r}: mixture-of-experts models are not served by a "
            "sharded worker group (experts are not split); run it with --ranks 1"
        )
    if not family_of(config).shards:
        raise ShardingError(
            f"base model type {model_type!r}: a sharded worker group splits only "
            f"{', '.join(shardable_families())} decoders"
        )
    heads = int(config.num_attention_heads)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "intermediate_size": int(config.intermediate_size),
    }
    for name, size in sizes.items():
        if size % world:
            raise ShardingError(
                f"{name}={size} is not divisible by the group's {world} ranks: each rank "
                "must hold an equal share of it"
            )


class _CopyToShards(torch.autograd.Function):
    """A block's input: the same on every rank; its gradient is the sum of the ranks'."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shards: Shards) -> torch.Tensor:
        ctx.shards = shards
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.shards.all_reduce(grad.contiguous().clone()), None


class _SumShards(torch.autograd.Function):
    """A block's output: the sum of the ranks' partial outputs; its gradient goes to each."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shards: Shards) -> torch.Tensor:
        return shards.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_shards(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    out: torch.Tensor = _CopyToShards.apply(x, shards)
    return out


def sum_shards(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    out: torch.Tensor = _SumShards.apply(x, shards)
    return out


def shard_decoder(model: torch.nn.Module, shards: Shards) -> None:
    """Split the model's decoder layers in place to this rank's share (before PEFT wraps them)
    and make its config say the per-rank sizes (heads, MLP width), which the KV cache and
    the memory budgets are sized from."""
    config: PretrainedConfig = model.config  # type: ignore[assignment]
    check_shardable(config, shards.world)
    head_dim = int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    plan = family_of(config).tensor_parallel
    for layer in _decoder_layers(model):
        attention, mlp = layer.self_attn, layer.mlp
        for name in plan.column:
            _keep_out_features(_child(attention, mlp, name), shards)
        for name in plan.row:
            _keep_in_features(_child(attention, mlp, name), shards)
        for block in (attention, mlp):
            block.register_forward_pre_hook(_input_hook(shards), with_kwargs=True)
            block.register_forward_hook(_output_hook(shards))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    config.head_dim = head_dim
    config.num_attention_heads = int(config.num_attention_heads) // shards.world
    config.num_key_value_heads = kv_heads // shards.world
    config.intermediate_size = int(config.intermediate_size) // shards.world


def _decoder_layers(model: torch.nn.Module) -> list[Any]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ShardingError(f"{type(model).__name__}: no decoder layers at model.layers")
    return list(layers)


def _child(attention: torch.nn.Module, mlp: torch.nn.Module, name: str) -> torch.nn.Linear:
    owner = attention if hasattr(attention, name) else mlp
    linear = getattr(owner, name)
    if not isinstance(linear, torch.nn.Linear):
        raise ShardingError(f"{name}: expected a linear layer, found {type(linear).__name__}")
    return linear


def _keep_out_features(linear: torch.nn.Linear, shards: Shards) -> None:
    rows = shards.span(linear.out_features)
    linear.weight = torch.nn.Parameter(
        linear.weight.data[rows].clone(), requires_grad=linear.weight.requires_grad
    )
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(
            linear.bias.data[rows].clone(), requires_grad=linear.bias.requires_grad
        )
    linear.out_features = rows.stop - rows.start


def _keep_in_features(linear: torch.nn.Linear, shards: Shards) -> None:
    columns = shards.span(linear.in_features)
    linear.weight = torch.nn.Parameter(
        linear.weight.data[:, columns].clone(), requires_grad=linear.weight.requires_grad
    )
    if linear.bias is not None and shards.rank != 0:
        # The all-reduce sums the ranks' outputs: the bias is added once, by rank 0.
        linear.bias.data.zero_()
    linear.in_features = columns.stop - columns.start


def _input_hook(shards: Shards) -> Any:
    def hook(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # Attention takes its input by keyword (hidden_states=), the MLP by position.
        if args:
            return (copy_to_shards(args[0], shards), *args[1:]), kwargs
        kwargs = {**kwargs, "hidden_states": copy_to_shards(kwargs["hidden_states"], shards)}
        return args, kwargs

    return hook


def _output_hook(shards: Shards) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        # Attention returns (output, weights), the MLP its output.
        if isinstance(output, tuple):
            return (sum_shards(output[0], shards), *output[1:])
        return sum_shards(output, shards)

    return hook
