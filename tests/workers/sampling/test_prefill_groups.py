"""Grouping prompts by length for prefill (workers/sampling/prefill_groups.py): the least
padded tokens plus a price per call, checked against every partition of small cases."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from queue_tinker.workers.sampling.prefill_groups import (
    CALL_TOKENS_CPU,
    CALL_TOKENS_GPU,
    length_groups,
    prefill_call_tokens,
)


def cost(lengths: list[int], groups: list[list[int]], call_tokens: int) -> int:
    return sum(len(g) * max(lengths[i] for i in g) + call_tokens for g in groups)


def least_cost(lengths: list[int], call_tokens: int) -> int:
    """Brute force: every way to cut the sorted lengths into runs."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = None
    for cuts in itertools.product([False, True], repeat=max(0, len(order) - 1)):
        groups, current = [], [order[0]]
        for index, cut in zip(order[1:], cuts, strict=True):
            if cut:
                groups.append(current)
                current = []
            current.append(index)
        groups.append(current)
        total = cost(lengths, groups, call_tokens)
        best = total if best is None else min(best, total)
    assert best is not None
    return best


@pytest.mark.parametrize("call_tokens", [0, 5, 40, 1000])
def test_groups_cost_the_least_of_any_cut(call_tokens: int) -> None:
    draws = random.Random(call_tokens)
    for _ in range(30):
        lengths = [draws.randint(1, 60) for _ in range(draws.randint(1, 9))]
        groups = length_groups(lengths, call_tokens)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        flat = [lengths[i] for g in groups for i in g]
        assert flat == sorted(flat)  # groups from shortest to longest
        assert cost(lengths, groups, call_tokens) == least_cost(lengths, call_tokens)


def test_a_free_call_splits_every_length_and_a_dear_one_none() -> None:
    lengths = [30, 5, 5, 12]
    assert length_groups(lengths, 0) == [[1, 2], [3], [0]]
    assert length_groups(lengths, 10_000) == [[1, 2, 3, 0]]
    assert length_groups([], 0) == []


def test_a_gpu_call_costs_more_tokens_than_a_cpu_one() -> None:
    assert prefill_call_tokens(torch.device("cpu")) == CALL_TOKENS_CPU
    assert prefill_call_tokens(torch.device("cuda", 0)) == CALL_TOKENS_GPU > CALL_TOKENS_CPU
