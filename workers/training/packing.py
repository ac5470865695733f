"""How a pass lays its data out in rows: one datum a row, right-padded; or, when that would be
mostly padding, several datums packed into one row, each with its own position ids.

A packed row is read by the model as separate sequences: transformers sees position ids that
restart at 0 and no attention mask, and masks attention block-diagonally (each datum attends
causally to itself alone; flash-attention's varlen kernel where it is the implementation), so a
packed datum computes what it computes alone. Padding at a row's end is never attended to by a
real token (causal), and never scored.

Rows never mix groups: in a cross-adapter pass a group is one adapter's data, and each row
block is one adapter's (row_blocks.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowBatch:
    """Token ids laid out in rows, and where each datum sits."""

    ids: torch.Tensor  # (rows, width)
    mask: torch.Tensor | None  # (rows, width) padding mask; None when packed
    position_ids: torch.Tensor | None  # (rows, width), restarting per datum; None: 0..width-1
    places: list[tuple[int, int]]  # per datum, in order: (row, first position)
    group_rows: list[int]  # rows of each group, in order

    @property
    def padded_tokens(self) -> int:
        return self.ids.numel()


def padding_fraction(lengths: Sequence[int]) -> float:
    """Of one datum a row, right-padded to the longest: the share of positions that are padding."""
    if not lengths:
        return 0.0
    return 1 - sum(lengths) / (len(lengths) * max(lengths))


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Datum indices per row, first-fit by decreasing length, each row at most `width` tokens
    (a datum longer than that is a row of its own)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        row = next((r for r, room in enumerate(free) if room >= length), None)
        if row is None:
            rows.append([index])
            free.append(width - length)
        else:
            rows[row].append(index)
            free[row] -= length
    return rows


def row_batch(
    tokens: Sequence[Sequence[int]], groups: Sequence[int], device: torch.device, *, pack: bool
) -> RowBatch:
    """The data (`groups`: how many consecutive datums each group holds) one datum a row, or
    packed within each group when `pack`."""
    width = max((len(t) for t in tokens), default=0)
    layout, group_rows = _layout(tokens, groups, width, pack=pack)
    ids, mask, positions, places = _fill(tokens, layout, width)

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return RowBatch(
        ids=on_device(ids),
        mask=None if pack else on_device(mask),
        position_ids=on_device(positions) if pack else None,
        places=places,
        group_rows=group_rows,
    )


def _layout(
    tokens: Sequence[Sequence[int]], groups: Sequence[int], width: int, *, pack: bool
) -> tuple[list[list[int]], list[int]]:
    """Datum indices per row, group after group, and how many rows each group has."""
    layout: list[list[int]] = []
    group_rows: list[int] = []
    start = 0
    for count in groups:
        members = list(range(start, start + count))
        rows = (
            pack_rows([len(tokens[i]) for i in members], width)
            if pack
            else [[i - start] for i in members]
        )
        layout.extend([[start + i for i in row] for row in rows])
        group_rows.append(len(rows))
        start += count
    return layout, group_rows


def _fill(
    tokens: Sequence[Sequence[int]], layout: list[list[int]], width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """(ids, padding mask, position ids, each datum's (row, first position)) of the datums
    laid out in rows `layout`, each row `width` wide."""
    ids = np.zeros((len(layout), width), dtype=np.int64)
    mask = np.zeros((len(layout), width), dtype=np.int64)
    positions = np.zeros((len(layout), width), dtype=np.int64)
    places: list[tuple[int, int]] = [(0, 0)] * len(tokens)
    for r, row in enumerate(layout):
        offset = 0
        for index in row:
            seq = tokens[index]
            ids[r, offset : offset + len(seq)] = seq
            mask[r, offset : offset + len(seq)] = 1
            positions[r, offset : offset + len(seq)] = np.arange(len(seq))
            places[index] = (r, offset)
            offset += len(seq)
        positions[r, offset:] = np.arange(width - offset)  # the tail: a sequence of its own
    return ids, mask, positions, places
