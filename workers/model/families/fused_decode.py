"""What a family's fused decode step stands on (the sampler's slot step runs it where the
family has one, families/<family>.py): the layer code of that family on the model's own
weights, every kernel one of workers/kernels/decode_ops.py, the KV cache in pages, the LoRA
slots applied by BGMV kernels. An 8B step is ~9 kernels a decoder layer and 8 more with LoRA,
where transformers' modules launch ~37 and ~150 (bench.decode_step --count).

Fused GEMMs (q/k/v, gate/up) multiply one weight whose row blocks are the linears' weights:
`fused_rows` makes those weights views of one buffer (once, at the first fused step), never a
copy beside them, so training keeps using the same tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from queue_tinker.workers.kernels.decode_ops import lora_expand_, lora_shrink

# Programs an attention launch should have at least (a few per core of a large GPU) before
# long rows' pages are split: few rows would leave most cores idle.
ATTENTION_PROGRAMS = 256
MOST_SPLITS = 16


@dataclass(frozen=True)
class SlotLora:
    """The LoRA slots a fused step adds: each fused linear's stacks, A (slots, linears *
    rank, in), B (slots, out, rank) and the output ends between its linears, by the id of its
    first module; the slot rank; each row's slot (< 0: the base model)."""

    stacks: Mapping[int, tuple[torch.Tensor, torch.Tensor, list[int]]]
    rank: int
    row_slot: torch.Tensor


class FusedDecoder(Protocol):
    """A family's decode step: every row's logits (rows, vocab) for its next token, after its
    token is fed at its position and written to its pages."""

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pages: Sequence[tuple[torch.Tensor, torch.Tensor]],
        table: torch.Tensor,
        lora: SlotLora | None,
    ) -> torch.Tensor: ...


def base_weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear's weight (a LoRA wrapper's base layer's)."""
    linear: Any = getattr(module, "base_layer", module)
    weight: torch.Tensor = linear.weight
    return weight


def plain_linear(module: torch.nn.Module, bias: bool = False) -> bool:
    """A torch Linear (under its LoRA wrapper, if any) with a bias exactly where `bias`: what a
    fused GEMM takes."""
    linear = getattr(module, "base_layer", module)
    return type(linear) is torch.nn.Linear and (linear.bias is not None) == bias


def fused_rows(modules: Sequence[torch.nn.Module]) -> torch.Tensor:
    """One (sum of outputs, in) weight whose row blocks are these linears' weights, in order:
    made once, the weights becoming views of it (their Parameters kept); a view over them when
    they are already one buffer's consecutive blocks."""
    return _fused([base_weight(module) for module in modules])


def fused_bias(modules: Sequence[torch.nn.Module]) -> torch.Tensor | None:
    """The linears' biases as one (sum of outputs,) vector, as fused_rows makes weights; None
    where they have none."""
    linears: list[Any] = [getattr(module, "base_layer", module) for module in modules]
    biases: list[torch.Tensor | None] = [linear.bias for linear in linears]
    present = [b for b in biases if b is not None]
    return _fused(present) if len(present) == len(biases) else None


@torch.inference_mode(False)  # a normal tensor, as the Parameters' data must be (a step
@torch.no_grad()  # runs in inference mode)
def _fused(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    first = tensors[0]
    if all(t.is_contiguous() for t in tensors) and _consecutive(tensors):
        rows = sum(t.shape[0] for t in tensors)
        shape, strides = (rows, *first.shape[1:]), first.stride()
        return first.new_empty(0).set_(
            first.untyped_storage(), first.storage_offset(), shape, strides
        )
    fused = torch.cat([t.detach() for t in tensors])
    start = 0
    for tensor in tensors:
        tensor.data = fused[start : start + tensor.shape[0]]
        start += tensor.shape[0]
    return fused


def _consecutive(weights: Sequence[torch.Tensor]) -> bool:
    storage = weights[0].untyped_storage()._cdata
    offset = weights[0].storage_offset()
    for weight in weights:
        if weight.untyped_storage()._cdata != storage or weight.storage_offset() != offset:
            return False
        offset += weight.numel()
    return True


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    module: torch.nn.Module,
    lora: SlotLora | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x times a (fused) weight (plus its bias), plus each row's adapter's update where the
    linear has LoRA slots (keyed by its first module)."""
    y = F.linear(x, weight, bias)
    stack = lora.stacks.get(id(module)) if lora is not None else None
    if lora is not None and stack is not None:
        a, b, ends = stack
        lora_expand_(y, lora_shrink(x, a, lora.row_slot), b, lora.row_slot, lora.rank, ends)
    return y


def attention_splits(rows: int, kv_heads: int, pages: int) -> int:
    """How many splits of a row's pages one attention launch takes: enough programs for the
    device's cores (ATTENTION_PROGRAMS), never more than the pages."""
    programs = max(1, rows * kv_heads)
    return max(1, min(pages, MOST_SPLITS, -(-ATTENTION_PROGRAMS // programs)))
