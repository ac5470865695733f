"""The decode loop's KV-cache projection (workers/sampling/cache_budget.py) against a
step-by-step count of the same rectangle: rows right-aligned, one column a step, finished rows
leaving and the leading columns no remaining row uses cut."""

from __future__ import annotations

import random

import pytest

from queue_tinker.workers.sampling.cache_budget import CacheRow, peak_cache_tokens, rows_that_fit


def counted_peak(rows: list[CacheRow]) -> int:
    """The cache's size at every step from now to the last row's end, the largest of them."""
    peak = 0
    for step in range(max((left for _, left in rows), default=0) + 1):
        alive = [length for length, left in rows if left >= step]
        if alive:
            peak = max(peak, len(alive) * (max(alive) + step))
    return peak


def random_rows(rng: random.Random) -> list[CacheRow]:
    return [(rng.randint(1, 60), rng.randint(0, 80)) for _ in range(rng.randint(0, 12))]


def test_the_peak_is_the_largest_cache_of_any_step() -> None:
    rng = random.Random(3)
    for _ in range(500):
        rows = random_rows(rng)
        assert peak_cache_tokens(rows) == counted_peak(rows), rows


def test_a_long_row_among_short_ones_peaks_when_they_leave() -> None:
    """Four rows of 10 tokens with 2 steps left beside one of 10 with 100 left: 5 x 12 while
    all live, then the long row alone up to 110."""
    rows = [(10, 2)] * 4 + [(10, 100)]
    assert peak_cache_tokens(rows) == 110 == counted_peak(rows)
    assert peak_cache_tokens([]) == 0


@pytest.mark.parametrize("budget", [0, 50, 300, 1000, 10_000])
def test_rows_that_fit_is_the_most_copies_within_the_budget(budget: int) -> None:
    rng = random.Random(budget)
    for _ in range(100):
        committed, row, most = random_rows(rng), (rng.randint(1, 40), rng.randint(0, 60)), 9
        fits = rows_that_fit(committed, row, most, budget)
        assert 0 <= fits <= most
        if fits:
            assert counted_peak(committed + [row] * fits) <= budget
        if fits < most:
            assert counted_peak(committed + [row] * (fits + 1)) > budget
