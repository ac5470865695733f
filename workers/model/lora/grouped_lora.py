"""Grouped LoRA: a pass of many adapters' rows runs two grouped matmuls per LoRA linear (shrink
by the rows' A, expand by their B: kernels/grouped_matmul.py), forward and backward, however many
adapters share it, where row_blocks.py launches two matmuls per adapter and the stacked form
computes every adapter's columns for every row.

The adapter-stack layout: per LoRA linear, every stacked adapter's A in one tensor (slots, rank,
in) and its B in another (slots, out, rank), slot i the adapter `names[i]`. The stacks are the
adapters' storage, not copies: each adapter's `lora_A` / `lora_B` weight is a view of its slot
(`param.data`), so the optimizer's in-place steps, a checkpoint's loading (copy_) and the pass
all see one tensor, and nothing is concatenated per call. Gradients reach each adapter's own
parameters (`_SlotGrads`). A layer an adapter does not adapt keeps its slot zero there.

A pass's rows are in slot order (`order`: one block per adapter, slots ascending), so group i
of every grouped matmul is slot i's rows, an empty group for a stacked adapter the pass leaves
out. Stacks are made for the pass's adapters when one is missing or was loaded anew (its weight
is no longer a view of its slot), once per adapter's arrival, not per pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear

from queue_tinker.workers.kernels.grouped_matmul import grouped_matmul, torch_runs
from queue_tinker.workers.model.lora.row_blocks import (
    LoraLayer,
    blocks_forward,
    forwards_replaced,
    stacks,
)


@dataclass
class _LayerStack:
    a: torch.Tensor  # (slots, rank, in)
    b: torch.Tensor  # (slots, out, rank)
    held: tuple[int, ...]  # the slots of the adapters this layer adapts


@dataclass
class LoraStacks:
    """Every LoRA linear's stacks for the adapters `names` (slot order), the storage of those
    adapters' LoRA weights; made anew when a pass names an adapter they do not hold."""

    names: list[str] = field(default_factory=list)
    layers: dict[int, _LayerStack] = field(default_factory=dict)  # by id(layer)
    # Each stacked adapter's first LoRA A weight and the slot view it must be (a reload
    # gives the adapter new tensors).
    _tokens: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def slots(self, layers: Sequence[LoraLinear], names: Sequence[str]) -> dict[str, int]:
        """Each adapter's slot, stacking anew when one of `names` is not held as it is now."""
        if not all(self._holds(name) for name in names):
            wanted = list(dict.fromkeys(names))
            shapes = {id(x): _shape(x, n) for x in layers for n in wanted if n in x.lora_A}
            kept = []
            # Adapters held and still on the model keep a slot, if every layer they adapt can
            # stack them with the pass's (one rank and dtype a layer); a removed one's goes.
            for name in self.names:
                if name in wanted or not self._holds(name):
                    continue
                mine = {id(x): _shape(x, name) for x in layers if name in x.lora_A}
                if mine and all(shapes.get(k, v) == v for k, v in mine.items()):
                    shapes.update(mine)  # only a kept adapter's shapes bind the later ones
                    kept.append(name)
            self._stack(layers, [*kept, *wanted])
        return {name: slot for slot, name in enumerate(self.names)}

    def _holds(self, name: str) -> bool:
        token = self._tokens.get(name)
        return token is not None and token[0].data_ptr() == token[1]

    def _stack(self, layers: Sequence[LoraLinear], names: list[str]) -> None:
        self.layers, self._tokens = {}, {}
        for layer in layers:
            held = tuple(slot for slot, name in enumerate(names) if name in layer.lora_A)
            if not held:
                continue
            first = names[held[0]]
            a_one: torch.Tensor = layer.lora_A[first].weight  # type: ignore[assignment]
            b_one: torch.Tensor = layer.lora_B[first].weight  # type: ignore[assignment]
            a = a_one.new_zeros(len(names), *a_one.shape)
            b = b_one.new_zeros(len(names), *b_one.shape)
            for slot in held:
                for weights, stack in ((layer.lora_A, a), (layer.lora_B, b)):
                    param: torch.Tensor = weights[names[slot]].weight  # type: ignore[assignment]
                    stack[slot].copy_(param.detach())
                    param.data = stack[slot]
                    self._tokens.setdefault(names[slot], (param, param.data_ptr()))
            self.layers[id(layer)] = _LayerStack(a, b, held)
        self.names = names


def _shape(layer: LoraLinear, name: str) -> tuple[int, torch.dtype]:
    """The adapter's rank and dtype in the layer: what sharing a stack there takes."""
    weight: torch.Tensor = layer.lora_A[name].weight  # type: ignore[assignment]
    return layer.r[name], weight.dtype


def groups(layers: Sequence[LoraLayer], blocks: Sequence[tuple[str, int]]) -> bool:
    """Whether `grouped_blocks` can stand in for `row_blocks` here: several adapters, each in
    one block, every layer plain LoRA without dropout for them (row_blocks.stacks), and in each
    layer one rank and one dtype among the adapters it adapts (they share a stack)."""
    names = [name for name, _ in blocks]
    if len(set(names)) < 2 or not stacks(layers, blocks):
        return False
    for layer in layers:
        assert isinstance(layer, LoraLinear)  # stacks(): plain LoRA linears
        if len({_shape(layer, n) for n in set(names) if n in layer.lora_A}) > 1:
            return False
    return True


def kernel_runs(layer: LoraLinear, device: torch.device, compute: torch.dtype | None) -> bool:
    """Whether a grouped matmul runs for the layer's shrink and expand on the device: the
    Triton segment GEMM on CUDA, torch's kernel elsewhere where the compute dtype and the
    layer's widths allow it (kernels.torch_runs; a 259-token vocabulary's fp32 rows do not)."""
    if device.type == "cuda":
        return True
    base: torch.Tensor = layer.base_layer.weight  # type: ignore[assignment]
    out_features, in_features = base.shape
    for name, rank in layer.r.items():
        weight: torch.Tensor = layer.lora_A[name].weight  # type: ignore[assignment]
        dtype = compute or weight.dtype
        shrink = torch_runs(device, dtype, in_features, rank)
        if not (shrink and torch_runs(device, dtype, rank, out_features)):
            return False
    return True


def order(names: Sequence[str], slots: dict[str, int]) -> list[int]:
    """Indices of the pass's parts (ops, each on adapter `names[i]`) in slot order; parts of
    one adapter keep their order."""
    return sorted(range(len(names)), key=lambda i: slots[names[i]])


class _SlotGrads(torch.autograd.Function):
    """The stack as it is (a view: no copy), whose gradient goes to the slots' own parameters:
    slot i's part of the stack's gradient to `params[i]`."""

    @staticmethod
    def forward(ctx: Any, stack: torch.Tensor, slots: tuple[int, ...], *params: torch.Tensor
                ) -> torch.Tensor:  # fmt: skip
        ctx.slots = slots
        return stack.view_as(stack)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *(grad[slot] for slot in ctx.slots))


def _stack_weights(
    layer: LoraLinear,
    stack: _LayerStack,
    names: Sequence[str],
    present: tuple[int, ...],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's A and B stacks in the matmuls' dtype, their gradients bound for the present
    slots' parameters. grouped_blocks makes them once a pass (and grad mode), however many
    times the layer is called in it (the unembedding once a chunk of positions, a checkpointed
    layer again in backward): one cast and one share-out of the slots' gradients a pass, not a
    call (at the 8B shape 8 adapters' pass of 4 x 512 tokens each launched 622 fewer kernels)."""
    params_a = [layer.lora_A[names[s]].weight for s in present]
    params_b = [layer.lora_B[names[s]].weight for s in present]
    a = _SlotGrads.apply(stack.a, present, *params_a).to(dtype)
    b = _SlotGrads.apply(stack.b, present, *params_b).to(dtype)
    return a, b


@contextmanager
def grouped_blocks(
    layers: Sequence[LoraLayer],
    blocks: Sequence[tuple[str, int]],
    stacks_: LoraStacks,
    compute: torch.dtype | None = None,
) -> Iterator[None]:
    """`row_blocks` in grouped form (where `groups`): meanwhile each LoRA linear computes its
    base layer plus, for each block of rows (dim 0), that block's adapter's update
    lora_B(lora_A(x)) * scaling, in two grouped matmuls over the stacks. `blocks` must be in
    slot order, one per adapter (`order`); the stacks hold them (`LoraStacks.slots`)."""
    linears = [layer for layer in layers if isinstance(layer, LoraLinear)]  # groups(): all
    slot_of = stacks_.slots(linears, [name for name, _ in blocks])
    rows = {name: count for name, count in blocks}
    in_order = [slot_of[name] for name, _ in blocks]
    if in_order != sorted(set(in_order)):
        raise ValueError(f"grouped_blocks: blocks {list(rows)} are not one per slot in order")
    slot_rows = [rows.get(name, 0) for name in stacks_.names]
    cached: dict[tuple[Any, ...], Any] = {}
    runs: dict[int, bool] = {}  # by id(layer): kernel_runs

    def ends(width: int, device: torch.device) -> torch.Tensor:
        """Each slot's last token + 1, the pass's rows being `width` tokens each (the LoRA
        unembedding sees a chunk of positions): one small copy a width, not a layer."""
        key = ("ends", width, device)
        if key not in cached:
            counts = [r * width for r in slot_rows]
            cached[key] = torch.tensor(list(accumulate(counts)), dtype=torch.int32).to(
                device, non_blocking=True
            )
        return cached[key]

    def row_scaling(layer: LoraLinear, width: int, like: torch.Tensor) -> torch.Tensor:
        """(tokens, 1): each token's adapter's scaling in this layer (alpha / rank); layers
        of one scaling share it."""
        scalings = tuple(float(layer.scaling.get(name, 0.0)) for name in stacks_.names)
        key = ("scaling", width, like.device, like.dtype, scalings)
        if key not in cached:
            per_token = [value for value, r in zip(scalings, slot_rows, strict=True)
                         for _ in range(r * width)]  # fmt: skip
            cached[key] = torch.tensor(per_token, dtype=like.dtype)[:, None].to(
                like.device, non_blocking=True
            )
        return cached[key]

    def forward(layer: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        stack = stacks_.layers.get(id(layer))
        if id(layer) not in runs:
            runs[id(layer)] = kernel_runs(layer, x.device, compute)
        if stack is None or not runs[id(layer)]:
            # No adapter of the pass adapts it, or no grouped kernel runs for its widths here.
            return blocks_forward(layer, blocks, compute, x, *args, **kwargs)
        result = layer.base_layer(x, *args, **kwargs)
        present = [slot for slot in stack.held if stacks_.names[slot] in rows]
        if not present:
            return result
        if x.shape[0] != sum(slot_rows):
            raise ValueError(f"grouped_blocks: {x.shape[0]} rows, the blocks {sum(slot_rows)}")
        dtype = compute or stack.a.dtype
        key = ("weights", id(layer), dtype, torch.is_grad_enabled())
        if key not in cached:
            cached[key] = _stack_weights(layer, stack, stacks_.names, tuple(present), dtype)
        a, b = cached[key]
        tokens = x.reshape(-1, x.shape[-1]).to(dtype)
        width = tokens.shape[0] // x.shape[0] if x.shape[0] else 1
        group_ends = ends(width, x.device)
        low = grouped_matmul(tokens, a, group_ends)
        low = low * row_scaling(layer, width, low)
        update = grouped_matmul(low, b, group_ends)
        return (result + update.view(result.shape)).to(result.dtype)

    with forwards_replaced((linear, partial(forward, linear)) for linear in linears):
        yield
