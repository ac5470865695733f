"""Who joins the decode loop's rows at a step (the loop's scheduler): waiting requests, first
come first served, while the batch has rows for them, the cache their rows may grow to stays
within the KV budget (cache_budget.py) and the step's prefill within its own; and what the kept
prompts may hold beside the rows (prefix_cache.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from queue_tinker.workers.sampling import prefix_cache
from queue_tinker.workers.sampling.cache_budget import (
    CacheRow,
    peak_cache_tokens,
    rows_that_fit,
    slot_cache_tokens,
)
from queue_tinker.workers.sampling.decode_rows import LiveRequest
from queue_tinker.workers.sampling.prefix_cache import PrefixCache

Taken = list[tuple[LiveRequest, range]]  # requests and which of their samples join


@dataclass
class Admission:
    """The loop's budgets and the decisions they make."""

    max_rows: int | None  # rows in the batch at once; None: no cap
    # KV-cache tokens (rows x columns) the rows admitted may come to hold at their peak
    # (cache_budget.py); None: no cap. A sample that alone needs more runs alone.
    max_cache_tokens: int | None
    # Cache tokens' worth each row holds whatever its length, charged beside its columns: a
    # sliding window's, a linear-attention layer's states (memory.row_state_bytes).
    row_cache_tokens: int
    # Padded prompt tokens (prefill rows x longest prompt) a step prefills at most; None: no cap.
    prefill_tokens: int | None
    slots: bool  # rows on fixed slots (slot_decode.py): every row as wide as the widest

    def take(self, waiting: deque[LiveRequest], running: Sequence[CacheRow], rows: int) -> Taken:
        """Waiting requests (and which of their samples) that join beside `rows` running rows
        (`running`: their cache_rows), taken off `waiting`. A request with more samples than
        there is room for takes what there is (at least one sample when the loop is empty)
        and waits for room for the rest, and so does everyone behind it."""
        taken: Taken = []
        committed = list(running) if self.max_cache_tokens is not None else []
        prompts: set[tuple[tuple[int, ...], str]] = set()
        width = 0
        while waiting:
            request = waiting[0]
            more = prompts | {(tuple(request.spec.prompt), request.adapter)}
            wider = max(width, len(request.spec.prompt))
            if (
                taken
                and self.prefill_tokens is not None
                and len(more) * wider > self.prefill_tokens
            ):
                break
            left = request.spec.num_samples - request.admitted
            free = left if self.max_rows is None else min(left, self.max_rows - rows)
            if free > 0 and self.max_cache_tokens is not None:
                row = self.joining_row(request)
                fits = rows_that_fit(committed, row, free, self.max_cache_tokens, self.peak)
                free = fits if fits or rows else 1
                committed += [row] * free
            if free <= 0:
                break
            taken.append((request, range(request.admitted, request.admitted + free)))
            request.admitted += free
            rows, prompts, width = rows + free, more, wider
            if request.admitted < request.spec.num_samples:
                break
            waiting.popleft()
        return taken

    def joining_row(self, request: LiveRequest) -> CacheRow:
        """A sample of the request as it joins: its prompt's tokens and its row's fixed state,
        and the steps it may take."""
        return len(request.spec.prompt) + self.row_cache_tokens, request.spec.max_tokens

    def cache_rows(self, requests: Sequence[LiveRequest], samples: Sequence[int]) -> list[CacheRow]:
        """Each running row's (tokens it holds now, steps it may still take)."""
        rows = []
        for request, sample in zip(requests, samples, strict=True):
            generated = len(request.tokens[sample])
            held = len(request.spec.prompt) + generated + self.row_cache_tokens
            rows.append((held, request.spec.max_tokens - generated))
        return rows

    def peak(self, rows: list[CacheRow]) -> int:
        """The cache tokens rows may come to hold: on slots, every row as wide as the widest
        (cache_budget.py)."""
        return slot_cache_tokens(rows) if self.slots else peak_cache_tokens(rows)

    def fit_prompts(self, prompts: PrefixCache, rows: list[CacheRow]) -> None:
        """Under a KV budget, the kept prompts may hold what the budget leaves beside the peak
        of `rows` (running and joining; KEPT_BYTES at least)."""
        per_token = prompts.bytes_per_token()
        if self.max_cache_tokens is None or per_token is None:
            return
        room = self.max_cache_tokens - self.peak(rows)
        prompts.resize(max(prefix_cache.KEPT_BYTES, int(room * per_token)))
