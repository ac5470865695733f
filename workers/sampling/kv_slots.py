"""The decode step's KV cache in fixed slots: per attention layer one (slots, columns, heads,
dim) buffer of keys and one of values, a row in flight owning one slot for its life and its
token at position p in column p, seen by transformers' layers head-major (a transposed view).
The family's fused step keeps its KV in pages instead (kv_pages.py).

A decode step writes each row's new key / value in place, at the row's own column (one scatter
per layer), and attends over the first `rows` slots' first `columns` columns under a mask of
the columns each row has filled: every shape is fixed by (rows, columns), and the buffers keep
their addresses, which is what a captured CUDA graph needs (slot_decode.py). Against the
left-padded cache of kv_cache.py, rows leaving cost a copy of the last rows into the holes they
leave (not a gather of every row), and rows joining a copy of their own columns only.

Columns that no row fills hold finite numbers (zeros at first, then what earlier rows wrote): a
masked column has weight 0 in attention, and 0 * inf would be nan.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from queue_tinker.workers.sampling.decode_rows import growing_layers
from queue_tinker.workers.sampling.host_reads import to_device

# Columns are allocated in multiples of this, so that a few tokens more do not re-make buffers.
COLUMN_QUANTUM = 64


Layout = list[tuple[int, int, int]]  # per attention layer (heads, key dim, value dim)


def cache_layout(cache: DynamicCache) -> tuple[Layout, torch.dtype, torch.device]:
    """A prefill's cache (plain per-layer keys and values, GrowingLayers): each layer's heads
    and key / value dims, their dtype and device (what slots or pages for its rows are made
    of)."""
    layers = growing_layers(cache)
    assert layers is not None, "slots and pages take plain per-layer key / value caches"
    states = [layer.states() for layer in layers]
    layout = [(k.shape[1], k.shape[3], v.shape[3]) for k, v in states]
    return layout, states[0][0].dtype, states[0][0].device


class SlotLayer(DynamicLayer):
    """One attention layer of the slots: `update` writes the step's column of each row at
    `store.write_at` and hands back the first `store.rows` slots' first `store.columns`
    columns."""

    def __init__(self, store: KvSlots, index: int) -> None:
        super().__init__()
        self.store, self.index = store, index
        self.is_initialized = True
        self.keys, self.values = store.head_major(index)
        self.dtype, self.device = self.keys.dtype, self.keys.device

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        store = self.store
        rows, columns = store.rows, store.columns
        keys, values = store.head_major(self.index)
        at = store.write_at[:rows].view(rows, 1, 1, 1).expand_as(key_states)
        keys[:rows].scatter_(2, at, key_states)
        values[:rows].scatter_(2, at, value_states)
        return keys[:rows, :, :columns], values[:rows, :, :columns]

    def get_seq_length(self) -> int:
        return self.store.columns


class KvSlots:
    """Every attention layer's slot buffers, and what the next step reads and writes."""

    def __init__(self, layout: Layout, dtype: torch.dtype, device: torch.device):
        self.layout = layout  # per layer (heads, key dim, value dim)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # Each row's position, the column its step writes (the decoder fills it every step).
        self.write_at = torch.zeros(0, dtype=torch.long, device=device)
        self.rows = 0  # slots the next step runs (a batch bucket: some may be empty)
        self.columns = 0  # columns the next step attends over
        self._allocate(0, 0)

    @classmethod
    def like(cls, cache: DynamicCache) -> KvSlots:
        """Empty slots for caches shaped like this one (a prefill's GrowingLayers)."""
        return cls(*cache_layout(cache))

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        """Columns a slot holds."""
        return self.keys[0].shape[1] if self.keys else 0

    def head_major(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values as transformers' caches hold them: (slots, heads, columns,
        dim), views of the (slots, columns, heads, dim) buffers."""
        return self.keys[layer].transpose(1, 2), self.values[layer].transpose(1, 2)

    def cache(self) -> DynamicCache:
        """A cache whose layers read and write these slots (made per step: cheap)."""
        cache = DynamicCache()
        cache.layers = [SlotLayer(self, index) for index in range(len(self.layout))]
        return cache

    @torch.inference_mode()  # the buffers are inference tensors; a cancel comes between steps
    def reserve(self, slots: int, columns: int, live: int, ends: list[int] | None = None) -> bool:
        """Room for `slots` slots of `columns` columns; the first `live` slots' contents kept.
        Whether the buffers were made anew (a captured graph of the old ones is stale). (The
        joiners' `ends` are kv_pages.py's: a slot is as wide as the widest.)"""
        if slots <= self.slots and columns <= self.capacity:
            return False
        columns = -(-max(columns, self.capacity) // COLUMN_QUANTUM) * COLUMN_QUANTUM
        old = list(zip(self.keys, self.values, strict=True))
        used = min(self.capacity, columns)
        self._allocate(max(slots, self.slots), columns)
        for (keys, values), (old_keys, old_values) in zip(
            zip(self.keys, self.values, strict=True), old, strict=True
        ):
            keys[:live, :used].copy_(old_keys[:live, :used])
            values[:live, :used].copy_(old_values[:live, :used])
        return True

    @torch.inference_mode()  # the buffers are inference tensors; a cancel comes between steps
    def place(
        self, at: int, cache: DynamicCache, lengths: list[int], ends: list[int] | None = None
    ) -> None:
        """Copy a left-padded cache's rows (kv_cache.py's GrowingLayers: row r's real tokens
        are its last lengths[r] columns) into slots at, at+1, ..., each from column 0."""
        layers = growing_layers(cache)
        assert layers is not None
        rows, widest = len(lengths), max(lengths)
        width = layers[0].states()[0].shape[2]
        # Column c of slot `at + r` takes column width - lengths[r] + c of row r (those past
        # the row's length take its last: finite, masked).
        shift = to_device([width - n for n in lengths], torch.long, self.device)
        source = (torch.arange(widest, device=self.device)[None, :] + shift[:, None]).clamp(
            max=width - 1
        )
        for number, layer in enumerate(layers):
            for buffer, states in zip(self.head_major(number), layer.states(), strict=True):
                heads, dim = states.shape[1], states.shape[3]
                index = source.view(rows, 1, widest, 1).expand(rows, heads, widest, dim)
                buffer[at : at + rows, :, :widest].copy_(states.gather(2, index))

    def release(self, slots: list[int]) -> None:
        """These slots' rows left (their columns are written over by the next to come)."""

    @torch.inference_mode()  # the buffers are inference tensors; a cancel comes between steps
    def move(self, sources: list[int], targets: list[int]) -> None:
        """Slot sources[i]'s contents to slot targets[i] (read all before writing any)."""
        if not sources:
            return
        source = to_device(sources, torch.long, self.device)
        target = to_device(targets, torch.long, self.device)
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer.index_copy_(0, target, buffer.index_select(0, source))

    def _allocate(self, slots: int, columns: int) -> None:
        def buffer(heads: int, dim: int) -> torch.Tensor:
            return torch.zeros((slots, columns, heads, dim), dtype=self.dtype, device=self.device)

        self.keys = [buffer(heads, dim) for heads, dim, _ in self.layout]
        self.values = [buffer(heads, dim) for heads, _, dim in self.layout]
        self.write_at = torch.zeros(slots, dtype=torch.long, device=self.device)
