"""The decode loop's KV cache layers: each layer's keys and values live in a buffer with spare
columns after them, so a decode step writes its one new column in place.

transformers' DynamicLayer concatenates every step's states onto the cache: a copy of the whole
cache per layer per step, and twice its memory while the copy is made. At 16 rows x 768 new
tokens on the 100M model (CPU) that copying took half the loop's time, and it grows with the
square of the length: what long RL samples pay most.

A `GrowingLayer` is a DynamicLayer whose `keys` / `values` are views of the used columns of its
buffers. The spare room is bounded by `room`, the most columns its rows can still append (their
requests' max_tokens), so a short request never holds a long buffer; it grows by a quarter of
its length at a time. Rows leaving (`batch_select_indices`) cost one gather of the buffers,
leading columns no row uses any more (`drop_left`) nothing; rows joining (`joined`) one copy of
both.
Anything else that assigns `keys` / `values` (transformers' own cache methods) is noticed at the
next update, which then copies them into a fresh buffer.

A sliding-window layer (gpt-oss's every other layer) stays transformers' own: it keeps its rows'
last `sliding_window - 1` columns and counts the columns seen, which the model slices the
attention mask by. Rows are left-padded, so every row's newest columns are the layer's last:
rows join (`join_windows`) by left-padding each side's window to the joined rows' and stacking
them, and leading columns dropped (`drop_window_left`) leave the count, and at most the window,
to what is left. Its states never grow past the window, so nothing is kept in place there.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

# Spare columns at least, when the room allows: a buffer is not re-made every few steps.
MIN_SPARE = 64
# Past MIN_SPARE a buffer grows by a quarter of its length: at most a quarter of the cache
# unused (the worker sizes its rows for the cache it holds), re-made ~every length / 4 steps
# (one copy of the layer each time, against DynamicLayer's copy every step).
GROWTH_DIVISOR = 4


class GrowingLayer(DynamicLayer):
    """One attention layer's cache: (rows, heads, columns, dim) keys and values, views of the
    columns [start, end) of buffers with spare columns after `end`."""

    _key_buffer: torch.Tensor
    _value_buffer: torch.Tensor
    _views: tuple[torch.Tensor, torch.Tensor]
    _start: int
    _end: int

    def __init__(
        self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, end: int, room: int
    ) -> None:
        super().__init__()
        self.dtype, self.device = key_buffer.dtype, key_buffer.device
        self.is_initialized = True
        self.room = room  # columns this layer's rows may still append
        self._adopt(key_buffer, value_buffer, end)

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, room: int) -> GrowingLayer:
        """A layer holding a copy of these states, with up to `room` more columns."""
        layer = cls(keys, values, keys.shape[2], room)  # the states as buffers for a moment
        layer._place(keys, values)
        return layer

    @classmethod
    def joined(cls, first: GrowingLayer, second: GrowingLayer, width: int) -> GrowingLayer:
        """`first`'s rows then `second`'s, each left-padded with zeros to `width` columns
        (a padded column must hold finite numbers: the mask gives it weight 0, and 0 * inf is
        nan)."""
        room = max(first.room, second.room)
        parts = [first.states(), second.states()]
        rows = sum(keys.shape[0] for keys, _ in parts)
        columns = width + _spare(width, 0, room)
        buffers = [  # keys, then values: their widths may differ (see _place)
            states.new_zeros((rows, states.shape[1], columns, states.shape[3]))
            for states in parts[0]
        ]
        at = 0
        for states in parts:
            count, _, used, _ = states[0].shape
            for buffer, part in zip(buffers, states, strict=True):
                buffer[at : at + count, :, width - used : width].copy_(part)
            at += count
        return cls(buffers[0], buffers[1], width, room)

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values), in this layer's buffers (copied there first if someone replaced
        them)."""
        if not self._tracks_views():
            assert self.keys is not None and self.values is not None
            self._place(self.keys, self.values)
        return self._views

    @property
    def capacity(self) -> int:
        """Columns the buffers hold, used or not."""
        return self._key_buffer.shape[2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[2]
        keys, values = self.states()
        if self._end + new > self.capacity:
            self._place(keys, values, extra=new)
        end = self._end + new
        self._key_buffer[:, :, self._end : end].copy_(key_states)
        self._value_buffer[:, :, self._end : end].copy_(value_states)
        self._set_views(self._start, end)
        self.room = max(0, self.room - new)
        return self._views

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep these rows, in this order: one gather of the buffers."""
        self.states()
        index = indices.to(self.device)
        self._key_buffer = self._key_buffer.index_select(0, index)
        self._value_buffer = self._value_buffer.index_select(0, index)
        self._set_views(self._start, self._end)

    def drop_left(self, columns: int) -> None:
        """Forget the first `columns` used columns (no row attends to them any more)."""
        self.states()
        self._set_views(self._start + columns, self._end)

    # --- the buffers ---
    def _place(self, keys: torch.Tensor, values: torch.Tensor, extra: int = 0) -> None:
        """Copy `keys` / `values` into fresh buffers with room for `extra` columns at least."""
        used = keys.shape[2]
        columns = used + _spare(used, extra, self.room)
        # Keys and values may differ in width: DeepSeek-V3's cache holds its compressed latent
        # (512 wide) as keys and its RoPE key (64) as values, one head each.
        key_buffer = keys.new_empty((*keys.shape[:2], columns, keys.shape[3]))
        value_buffer = values.new_empty((*values.shape[:2], columns, values.shape[3]))
        key_buffer[:, :, :used].copy_(keys)
        value_buffer[:, :, :used].copy_(values)
        self._adopt(key_buffer, value_buffer, used)

    def _adopt(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, end: int) -> None:
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self._set_views(0, end)

    def _set_views(self, start: int, end: int) -> None:
        self._start, self._end = start, end
        self._views = (self._key_buffer[:, :, start:end], self._value_buffer[:, :, start:end])
        self.keys, self.values = self._views

    def _tracks_views(self) -> bool:
        """Whether `keys` / `values` are still the views this layer made (nobody replaced
        them)."""
        return self.keys is self._views[0] and self.values is self._views[1]


def _spare(used: int, extra: int, room: int) -> int:
    """Spare columns for a buffer of `used` columns that must take `extra` more now and was
    told it may take `room` more in all: a quarter of its length (MIN_SPARE at least), never
    past the room while the room holds."""
    grown = max(extra, MIN_SPARE, used // GROWTH_DIVISOR)
    return grown if extra > room else min(room, grown)


def stacked_states(layers: Sequence[LinearAttentionLayer]) -> LinearAttentionLayer:
    """The layers' rows one after another in a new linear-attention layer (Qwen3.5's): each
    row's recurrent and convolution states, which have no columns, so nothing is padded."""

    def stacked(states: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        held = [state for state in states if state is not None]
        return torch.cat(held) if len(held) == len(states) else None  # else not made yet

    return _with_states(
        layers[0],
        {i: stacked([layer.conv_states[i] for layer in layers]) for i in layers[0].conv_states},
        {
            i: stacked([layer.recurrent_states[i] for layer in layers])
            for i in layers[0].recurrent_states
        },
    )


def state_rows(layer: LinearAttentionLayer, rows: slice) -> LinearAttentionLayer:
    """A new linear-attention layer holding copies of these rows' states (a layer updates its
    states in place, so a kept prompt's must be its own)."""

    def taken(state: torch.Tensor | None) -> torch.Tensor | None:
        return None if state is None else state[rows].clone()

    return _with_states(
        layer,
        {i: taken(state) for i, state in layer.conv_states.items()},
        {i: taken(state) for i, state in layer.recurrent_states.items()},
    )


def _with_states(
    layer: LinearAttentionLayer,
    conv: dict[int, torch.Tensor | None],
    recurrent: dict[int, torch.Tensor | None],
) -> LinearAttentionLayer:
    """A copy of the layer (its kernel sizes, what is initialised) holding these states."""
    made = copy.copy(layer)
    made.conv_states, made.recurrent_states = conv, recurrent
    for name in ("is_conv_states_initialized", "is_recurrent_states_initialized"):
        setattr(made, name, dict(getattr(layer, name)))
    made.has_previous_state = dict(layer.has_previous_state)
    made.conv_kernel_size = dict(layer.conv_kernel_size)
    return made


def join_windows(
    layers: Sequence[DynamicSlidingWindowLayer], width: int
) -> DynamicSlidingWindowLayer:
    """The layers' rows one after another in a new sliding-window layer, their rows
    left-padded to `width` columns (the joined attention mask's): each layer's window,
    right-aligned as its rows are, left-padded with zeros to the joined rows' window; the new
    layer counts `width` columns seen, so the mask is sliced where the states begin."""
    sides = [(layer.keys, layer.values) for layer in layers]
    assert all(k is not None and v is not None for k, v in sides), "an empty sliding-window layer"
    states = cast(list[tuple[torch.Tensor, torch.Tensor]], sides)
    window = min(layers[0].sliding_window - 1, width)
    joined = DynamicSlidingWindowLayer(layers[0].sliding_window)
    joined.lazy_initialization(*states[0])
    joined.keys = torch.cat([pad_left(keys, window) for keys, _ in states])
    joined.values = torch.cat([pad_left(values, window) for _, values in states])
    joined.cumulative_length = width
    return joined


def window_rows(
    layer: DynamicSlidingWindowLayer, rows: slice, columns: int
) -> DynamicSlidingWindowLayer:
    """A new sliding-window layer holding copies of these rows' window of their last `columns`
    columns (a kept prompt's: its rows end at the layer's last column)."""
    assert layer.keys is not None and layer.values is not None, "an empty sliding-window layer"
    window = min(layer.sliding_window - 1, columns, layer.keys.shape[2])
    made = DynamicSlidingWindowLayer(layer.sliding_window)
    made.lazy_initialization(layer.keys, layer.values)
    made.keys = layer.keys[rows, :, layer.keys.shape[2] - window :].clone()
    made.values = layer.values[rows, :, layer.values.shape[2] - window :].clone()
    made.cumulative_length = columns
    return made


def drop_window_left(layer: DynamicSlidingWindowLayer, columns: int) -> None:
    """Forget the first `columns` columns a sliding-window layer counts (no row attends to
    them any more): the count goes down by as many, and the states keep at most the window of
    what is left."""
    assert layer.keys is not None and layer.values is not None, "an empty sliding-window layer"
    layer.cumulative_length -= columns
    window = min(layer.sliding_window - 1, layer.cumulative_length)
    layer.keys = layer.keys[:, :, layer.keys.shape[2] - window :]
    layer.values = layer.values[:, :, layer.values.shape[2] - window :]


def held_bytes(layer: DynamicLayer | LinearAttentionLayer) -> int:
    """What a layer's states hold, in bytes."""
    if isinstance(layer, LinearAttentionLayer):
        states = [*layer.conv_states.values(), *layer.recurrent_states.values()]
    else:
        states = [layer.keys, layer.values]
    return sum(state.nbytes for state in states if state is not None)


def cache_of(layers: list[DynamicLayer | LinearAttentionLayer]) -> DynamicCache:
    """A cache holding these layers (one per decoder layer, in order)."""
    cache = DynamicCache()
    cache.layers = list(layers)
    return cache


def keys_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A plain layer holding these states as they are (no copy)."""
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def pad_left(states: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, heads, positions, dim) key / value states zero-padded to `width` positions on the
    left (the attention mask hides them; a padded column must hold finite numbers: the mask
    gives it weight 0, and 0 * inf is nan)."""
    return F.pad(states, (0, 0, width - states.shape[-2], 0))
