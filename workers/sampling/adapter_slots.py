"""The decode step's LoRA: the adapters of the rows in flight stacked in slots, each row
selecting its own by index, so a step of rows on many adapters is one fixed sequence of kernels
(what a captured CUDA graph needs) with no per-adapter loop.

The stacks take the grouped kernels' layout (workers/kernels: (slots, out, in), as the training
pass's grouped LoRA): per group of LoRA linears that read one input (q/k/v, gate/up: the fused
step's GEMMs; any other linear alone) one A stack (slots, linears * rank, in) and one B stack
(slots, the linears' outputs, rank, scaling folded in). A row's update is two kernels a group,
whatever mix of adapters the rows are on (decode_ops.lora_shrink / lora_expand_: BGMV), each
reading only the slots rows use; a row on the base model (slot -1) reads none. An adapter of a
smaller rank, or one that does not adapt a linear, leaves its part zero.

The stacks are copies: adapter names stand for immutable weights (a checkpoint's), so a slot is
filled once, when its adapter first runs, and kept until its place is needed. The buffers keep
their addresses while the slot count holds, so a captured graph stays valid across fills.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any
from weakref import ref

import torch
from peft.tuners.lora import Linear as LoraLinear

from queue_tinker.workers.kernels.decode_ops import lora_expand_, lora_shrink
from queue_tinker.workers.model.lora.row_blocks import LoraLayer, forwards_replaced, plain_lora

BASE_SLOT = -1  # a row on the base model: no slot, no update


def slots_support(layers: Sequence[LoraLayer]) -> bool:
    """Whether every LoRA layer is plain for every adapter it holds (row_blocks.plain_lora):
    a mixture of experts' wrappers, DoRA and LoRA biases take row_blocks.py's way. Dropout
    does not matter: the decode step runs in eval mode."""
    return all(plain_lora(layer) for layer in layers)


# Linears that read one input and that the fused step computes in one GEMM, in its order.
SIBLINGS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
            "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1)}  # fmt: skip


def lora_groups(model: torch.nn.Module, layers: Sequence[LoraLinear]) -> list[list[LoraLinear]]:
    """The LoRA linears in groups of siblings (SIBLINGS, under one parent), the others alone."""
    wanted = {id(layer) for layer in layers}
    groups: dict[tuple[str, str], list[tuple[int, LoraLinear]]] = {}
    for name, module in model.named_modules():
        if id(module) not in wanted:
            continue
        parent, _, short = name.rpartition(".")
        group, order = SIBLINGS.get(short, (short, 0))
        groups.setdefault((parent, group), []).append((order, module))
    return [
        [layer for _, layer in sorted(members, key=lambda m: m[0])] for members in groups.values()
    ]


class AdapterSlots:
    """Every LoRA group's A and B stacks for up to `count` adapters; which adapter holds which
    slot."""

    def __init__(
        self, groups: Sequence[Sequence[LoraLinear]], count: int, rank: int, dtype: torch.dtype
    ) -> None:
        self.groups = [list(group) for group in groups]
        self.layers = [layer for group in self.groups for layer in group]
        self.count, self.rank, self.dtype = count, rank, dtype
        self.names: list[str | None] = [None] * count  # the adapter in each slot
        # The weights each slot was filled from, known by one of its tensors (weakly: an evicted
        # adapter's go); an adapter loaded again has new tensors.
        self._weights: list[ref[torch.Tensor] | None] = [None] * count
        self.a: list[torch.Tensor] = []  # per group (count, linears * rank, in)
        self.b: list[torch.Tensor] = []  # per group (count, outputs, rank)
        self.ends: list[list[int]] = []  # per group: each linear's output end but the last's
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: its A, B parts
        # A group's stacks by its first layer's id (the fused step's SlotLora.stacks).
        self.stacks: dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        for group in self.groups:
            weights: list[torch.Tensor] = [layer.base_layer.weight for layer in group]  # type: ignore[misc]
            outputs = [w.shape[0] for w in weights]
            inputs, device = weights[0].shape[1], weights[0].device
            a = torch.zeros(count, len(group) * rank, inputs, dtype=dtype, device=device)
            b = torch.zeros(count, sum(outputs), rank, dtype=dtype, device=device)
            ends = [sum(outputs[: i + 1]) for i in range(len(group))]
            self.a.append(a)
            self.b.append(b)
            self.ends.append(ends[:-1])
            self.stacks[id(group[0])] = (a, b, ends[:-1])
            for i, (start, end) in enumerate(zip([0, *ends], ends, strict=False)):
                self.views.append((a[:, i * rank : (i + 1) * rank], b[:, start:end]))

    @staticmethod
    def widest_rank(layers: Sequence[LoraLinear], names: Iterable[str]) -> int:
        """The largest rank of these adapters over the layers (a walk of every layer)."""
        ranks = [layer.r[name] for layer in layers for name in names if name in layer.lora_A]
        return max(ranks, default=1)

    def fits(self, names: Sequence[str], layers: Sequence[LoraLinear]) -> bool:
        """Whether these adapters fit the slots at once (count and rank), and the layers are the
        ones stacked. Called every decode step: the ranks of adapters held as they are were
        checked when they were filled, so only the others' are looked up."""
        if len(layers) != len(self.layers) or any(
            a is not b for a, b in zip(layers, self.layers, strict=True)
        ):
            return False
        distinct = set(names)
        if len(distinct) > self.count:
            return False
        held = {n for slot, n in enumerate(self.names) if n is not None and self._current(slot, n)}
        return self.widest_rank(self.layers, distinct - held) <= self.rank

    def slots_of(self, names: Sequence[str | None]) -> list[int]:
        """Each row's slot (BASE_SLOT for the base model), filling slots for adapters not held
        yet; every name of `names` must fit (`fits`). Slots held by adapters no row names are
        taken first by newcomers, the others only when those run out."""
        wanted = dict.fromkeys(name for name in names if name is not None)  # in row order
        for name in wanted:
            if name in self.names:
                slot = self.names.index(name)
                if not self._current(slot, name):  # its weights were loaded again
                    self._fill(slot, name)
            else:
                free = [i for i, held in enumerate(self.names) if held not in wanted]
                self._fill(free[0], name)
        where = {name: i for i, name in enumerate(self.names) if name is not None}
        return [BASE_SLOT if name is None else where[name] for name in names]

    def _current(self, slot: int, name: str) -> bool:
        """Whether the slot holds this adapter's weights as they are now (the same tensors)."""
        held = self._weights[slot]
        return held is not None and held() is self._token(name)

    def _token(self, name: str) -> torch.Tensor | None:
        """The adapter's first LoRA A weight: the tensor a slot knows its weights by."""
        for layer in self.layers:
            if name in layer.lora_A:
                weight: torch.Tensor = layer.lora_A[name].weight  # type: ignore[assignment]
                return weight
        return None

    def _fill(self, slot: int, name: str) -> None:
        token = self._token(name)
        if token is None:  # else its rows would get the base model's tokens, refilled each step
            raise ValueError(f"adapter {name!r} adapts none of the model's LoRA layers")
        for a, b in zip(self.a, self.b, strict=True):
            a[slot].zero_()
            b[slot].zero_()
        for layer, (a, b) in zip(self.layers, self.views, strict=True):
            if name not in layer.lora_A:
                continue
            rank = layer.r[name]
            lora_a: torch.Tensor = layer.lora_A[name].weight  # type: ignore[assignment]
            lora_b: torch.Tensor = layer.lora_B[name].weight  # type: ignore[assignment]
            a[slot, :rank].copy_(lora_a)
            b[slot, :, :rank].copy_(lora_b * layer.scaling[name])
        self.names[slot] = name
        self._weights[slot] = ref(token)


@contextmanager
def slotted_lora(slots: AdapterSlots, row_slot: torch.Tensor) -> Iterator[None]:
    """Meanwhile every stacked LoRA layer computes its base layer plus each row's own
    adapter's update, the row's adapter given by `row_slot` (rows,), dim 0 of the input."""

    def forward(
        a: torch.Tensor, b: torch.Tensor, layer: LoraLinear, x: torch.Tensor, *args: Any, **kw: Any
    ) -> torch.Tensor:
        result = layer.base_layer(x, *args, **kw)
        tokens = x[0].numel() // x.shape[-1]  # a decode step's 1; a whole prompt's in tests
        token_slot = row_slot if tokens == 1 else row_slot.repeat_interleave(tokens)
        low = lora_shrink(x.reshape(-1, x.shape[-1]), a, token_slot)
        lora_expand_(result.view(-1, result.shape[-1]), low, b, token_slot, slots.rank, [])
        return result

    stacks = zip(slots.layers, slots.views, strict=True)
    with forwards_replaced((layer, partial(forward, a, b, layer)) for layer, (a, b) in stacks):
        yield
