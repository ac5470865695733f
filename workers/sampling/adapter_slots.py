"""The decode step's LoRA: the adapters of the rows in flight stacked in slots, each row
selecting its own by index, so a step of rows on many adapters is one fixed sequence of kernels
(what a captured CUDA graph needs) with no per-adapter loop.

Per LoRA linear, every slot's A is one column block of `stacked_a` (in x slots*rank) and its B
(scaling folded in) one row block of `stacked_b` (slots*rank x out). A row's update is
((x @ stacked_a) * its columns' mask) @ stacked_b: the columns of other slots are zeroed, so it
gets lora_B(lora_A(x)) * scaling of its own adapter and nothing of the others; a row on the base
model (slot -1) selects no column. An adapter of a smaller rank, or one that does not adapt a
layer, leaves its unused columns zero.

The cost over the base model's step is reading every slot's A and B once per step (at 8B, rank
32 on every linear, ~170 MB an adapter in bf16 against 16 GB of base weights) and two thin
matmuls per linear, whatever mix of adapters the rows are on; row_blocks.py's per-block
updates cost a slice, two matmuls and a copy per block and layer instead, launched from Python.

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

from queue_tinker.workers.model.lora.row_blocks import LoraLayer, forwards_replaced, plain_lora

BASE_SLOT = -1  # a row on the base model: no slot, no update


def slots_support(layers: Sequence[LoraLayer]) -> bool:
    """Whether every LoRA layer is plain for every adapter it holds (row_blocks.plain_lora):
    a mixture of experts' wrappers, DoRA and LoRA biases take row_blocks.py's way. Dropout
    does not matter: the decode step runs in eval mode."""
    return all(plain_lora(layer) for layer in layers)


class AdapterSlots:
    """Every LoRA linear's A and B for up to `count` adapters, stacked; which adapter holds
    which slot."""

    def __init__(
        self, layers: Sequence[LoraLinear], count: int, rank: int, dtype: torch.dtype
    ) -> None:
        self.layers = list(layers)
        self.count, self.rank, self.dtype = count, rank, dtype
        self.names: list[str | None] = [None] * count  # the adapter in each slot
        # The weights each slot was filled from, known by one of its tensors (weakly: an evicted
        # adapter's go); an adapter loaded again has new tensors.
        self._weights: list[ref[torch.Tensor] | None] = [None] * count
        self.stacked_a: list[torch.Tensor] = []
        self.stacked_b: list[torch.Tensor] = []
        for layer in self.layers:
            weight: torch.Tensor = layer.base_layer.weight  # type: ignore[assignment]
            outputs, inputs = weight.shape
            width = count * rank
            self.stacked_a.append(torch.zeros(inputs, width, dtype=dtype, device=weight.device))
            self.stacked_b.append(torch.zeros(width, outputs, dtype=dtype, device=weight.device))
        device = self.stacked_a[0].device if self.stacked_a else torch.device("cpu")
        # The slot each stacked column belongs to, to build a row's column mask from its slot.
        self.column_slot = torch.arange(count * rank, device=device) // rank

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
        columns = slice(slot * self.rank, (slot + 1) * self.rank)
        for layer, a, b in zip(self.layers, self.stacked_a, self.stacked_b, strict=True):
            a[:, columns].zero_()
            b[columns].zero_()
            if name not in layer.lora_A:
                continue
            rank = layer.r[name]
            lora_a: torch.Tensor = layer.lora_A[name].weight  # type: ignore[assignment]
            lora_b: torch.Tensor = layer.lora_B[name].weight  # type: ignore[assignment]
            a[:, columns][:, :rank].copy_(lora_a.t())
            b[columns][:rank].copy_(lora_b.t() * layer.scaling[name])
        self.names[slot] = name
        self._weights[slot] = ref(token)

    def column_mask(self, row_slot: torch.Tensor) -> torch.Tensor:
        """(rows, slots*rank): 1 at the columns of each row's slot, 0 elsewhere."""
        return (self.column_slot[None, :] == row_slot[:, None]).to(self.dtype)


@contextmanager
def slotted_lora(slots: AdapterSlots, row_slot: torch.Tensor) -> Iterator[None]:
    """Meanwhile every stacked LoRA layer computes its base layer plus each row's own
    adapter's update, the row's adapter given by `row_slot` (rows,), dim 0 of the input."""
    mask = slots.column_mask(row_slot)

    def forward(
        a: torch.Tensor, b: torch.Tensor, layer: LoraLinear, x: torch.Tensor, *args: Any, **kw: Any
    ) -> torch.Tensor:
        result = layer.base_layer(x, *args, **kw)
        low_rank = torch.matmul(x.to(a.dtype), a)  # (rows, tokens, slots*rank)
        update = torch.matmul(low_rank * mask[:, None, :], b)
        return (result + update).to(result.dtype)

    stacks = zip(slots.layers, slots.stacked_a, slots.stacked_b, strict=True)
    with forwards_replaced((layer, partial(forward, a, b, layer)) for layer, a, b in stacks):
        yield
