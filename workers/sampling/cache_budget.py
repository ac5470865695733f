"""How many KV-cache tokens the decode loop's rows may come to hold, so that admission can keep
the cache within a budget (DecodeLoop's `max_cache_tokens`).

The loop's cache is one rectangle per layer: a column per position, a row per sample, the rows
right-aligned (shorter ones left-padded). Every decode step adds one column; a row that finishes
leaves, and leading columns no remaining row uses are cut (Rows.select). So `t` steps from now
the cache holds (rows still alive) x (the longest of them + t) tokens. A row may run until its
max_tokens, so at worst the rows alive at `t` are those with at least `t` steps left, and the
peak over time falls at the last step of one of them. Counted in tokens (rows x columns), the
bytes follow from the model's shape (memory.kv_bytes_per_token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

CacheRow = tuple[int, int]  # (tokens the row holds now, decode steps it may still take)


def peak_cache_tokens(rows: Iterable[CacheRow]) -> int:
    """The most cache tokens these rows can come to hold together, if each runs to its end."""
    peak = widest = 0
    for alive, (length, left) in enumerate(sorted(rows, key=lambda row: -row[1]), start=1):
        widest = max(widest, length)
        peak = max(peak, alive * (widest + left))
    return peak


def slot_cache_tokens(rows: Iterable[CacheRow]) -> int:
    """The cache tokens rows hold in fixed slots (slot_decode.py): every slot has the columns
    of the widest row's end."""
    ends = [length + left for length, left in rows]
    return len(ends) * max(ends, default=0)


def rows_that_fit(
    committed: list[CacheRow],
    row: CacheRow,
    most: int,
    budget: int,
    peak: Callable[[list[CacheRow]], int] = peak_cache_tokens,
) -> int:
    """How many copies of `row` (up to `most`) can join `committed` with the `peak` within
    `budget`: the peak only grows with each copy, so the answer is found by bisection."""
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        if peak(committed + [row] * middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low
