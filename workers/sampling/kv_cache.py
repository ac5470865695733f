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

from typing import Any, cast

import torch
import torch.nn.functional as F
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


def join_states(first: LinearAttentionLayer, second: LinearAttentionLayer) -> None:
    """`second`'s rows after `first`'s in a linear-attention layer (Qwen3.5's): each row's
    recurrent and convolution states, which have no columns, so nothing is padded."""
    for ours, theirs in (
        (first.conv_states, second.conv_states),
        (first.recurrent_states, second.recurrent_states),
    ):
        for index, state in ours.items():  # by state index (a layer may keep several)
            other = theirs[index]
            if state is not None and other is not None:  # else not made yet
                ours[index] = torch.cat([state, other])


def join_windows(
    first: DynamicSlidingWindowLayer, second: DynamicSlidingWindowLayer, width: int
) -> DynamicSlidingWindowLayer:
    """`first`'s rows then `second`'s in a sliding-window layer, their rows left-padded to
    `width` columns (the joined attention mask's): each side's window, right-aligned as its
    rows are, left-padded with zeros to the joined rows' window and stacked; the layer counts
    `width` columns seen, so the mask is sliced where the states begin."""
    sides = [(layer.keys, layer.values) for layer in (first, second)]
    assert all(k is not None and v is not None for k, v in sides), "an empty sliding-window layer"
    (keys, values), (other_keys, other_values) = cast(
        list[tuple[torch.Tensor, torch.Tensor]], sides
    )
    window = min(first.sliding_window - 1, width)
    joined = DynamicSlidingWindowLayer(first.sliding_window)
    joined.lazy_initialization(keys, values)
    joined.keys = torch.cat([_pad_left(keys, window), _pad_left(other_keys, window)])
    joined.values = torch.cat([_pad_left(values, window), _pad_left(other_values, window)])
    joined.cumulative_length = width
    return joined


def drop_window_left(layer: DynamicSlidingWindowLayer, columns: int) -> None:
    """Forget the first `columns` columns a sliding-window layer counts (no row attends to
    them any more): the count goes down by as many, and the states keep at most the window of
    what is left."""
    assert layer.keys is not None and layer.values is not None, "an empty sliding-window layer"
    layer.cumulative_length -= columns
    window = min(layer.sliding_window - 1, layer.cumulative_length)
    layer.keys = layer.keys[:, :, layer.keys.shape[2] - window :]
    layer.values = layer.values[:, :, layer.values.shape[2] - window :]


def _pad_left(states: torch.Tensor, columns: int) -> torch.Tensor:
    """(rows, heads, used, dim) states zero-padded on the left to `columns` (a padded column
    must hold finite numbers: the mask gives it weight 0, and 0 * inf is nan)."""
    return F.pad(states, (0, 0, columns - states.shape[2], 0))
