"""The decode loop's live state: each request's draws and outputs so far (`LiveRequest`), and
a batch of rows aligned with its KV cache (`Rows`) that rows leave (`select`) and join
(`merge`, the narrower cache left-padded) between steps. A plain cache's layers become
`GrowingLayer`s (kv_cache.py) when its rows are built, so decode steps write in place."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from queue_tinker.types.requests.sampling import SampledSequence, SampleResponse, StopReason
from queue_tinker.workers.sampling.host_reads import to_device
from queue_tinker.workers.sampling.kv_cache import (
    GrowingLayer,
    drop_window_left,
    join_windows,
    stacked_states,
)
from queue_tinker.workers.sampling.token_choice import is_greedy, request_seed, sample_stream

if TYPE_CHECKING:
    from queue_tinker.workers.sampling.decode_loop import GenerationRequest

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed-adapter batch

Key = Hashable


@dataclass(eq=False)  # compared and hashed by identity
class LiveRequest:
    """A request in the loop: its draws, and what each of its samples produced so far."""

    key: Key
    spec: GenerationRequest
    stop_ids: list[int]
    greedy: bool
    streams: list[tuple[int, int]]  # each sample's uniform stream (token_choice.sample_stream)
    tokens: list[list[int]]
    logprobs: list[list[float]]
    topk: list[list[list[tuple[int, float]]]]  # per sample, per token (when asked for)
    reasons: list[StopReason]
    live: int  # samples still generating
    admitted: int = 0  # samples that joined the loop so far (rows beyond max_rows wait)
    prefilled: int = 0  # prompt tokens run through the model for it (0: it shared a prefill)
    # The first chunk(s) of its prompt, kept in the prefix cache while the rest waits its turn
    # (chunked prefill: prefix_prefill.py); None once it joins.
    pinned: tuple[tuple[int, ...], str] | None = None
    # What it asked about its prompt (prompt_scores.py): SampleResponse fields.
    prompt_scores: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, key: Key, spec: GenerationRequest, eos_token_ids: Sequence[int]) -> LiveRequest:
        greedy = is_greedy(spec.params)
        n = spec.num_samples
        seed = request_seed(spec.params)
        # Sample j draws from its own stream, so its draws do not depend on when it joins (a
        # request with more samples than max_rows joins in parts) nor on anything else.
        streams = [sample_stream(seed, j) for j in range(n)]
        return cls(
            key=key,
            spec=spec,
            stop_ids=spec.params.ending_token_ids(eos_token_ids),
            greedy=greedy,
            streams=streams,
            tokens=[[] for _ in range(n)],
            logprobs=[[] for _ in range(n)],
            topk=[[] for _ in range(n)],
            reasons=["length"] * n,
            live=n,
        )

    @property
    def adapter(self) -> str:
        return self.spec.adapter or BASE_ADAPTER

    def response(self) -> SampleResponse:
        asked = self.spec.sample_topk > 0
        return SampleResponse(
            sequences=[
                SampledSequence(
                    stop_reason=reason,
                    tokens=tokens,
                    logprobs=logprobs,
                    topk_logprobs=topk if asked else None,
                )
                for tokens, logprobs, topk, reason in zip(
                    self.tokens, self.logprobs, self.topk, self.reasons, strict=True
                )
            ],
            # Never below 0: a part that joined later on moved inflight weights prefills again.
            prompt_cache_hit_tokens=max(0, len(self.spec.prompt) - self.prefilled),
            **self.prompt_scores,
        )


@dataclass
class Rows:
    """A batch of rows (samples), aligned with its KV cache; a request's rows are adjacent."""

    requests: list[LiveRequest]
    samples: list[int]  # which sample of its request each row is
    cache: DynamicCache
    mask: torch.Tensor  # (rows, cached positions): 1 at a row's real tokens, 0 at its padding
    next_pos: torch.Tensor  # (rows,): the position of the token each row is fed next
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor  # (rows,) bool: the row takes the argmax
    streams: torch.Tensor  # (rows, 2) int64: its sample's uniform stream
    steps: torch.Tensor  # (rows,) int64: tokens its sample has (its next draw's step)
    stop_ids: torch.Tensor  # (rows, most stop ids of a row), padded with -1 (no token)
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @classmethod
    def build(
        cls,
        requests: list[LiveRequest],
        samples: list[int],
        cache: DynamicCache,
        mask: torch.Tensor,
        next_pos: torch.Tensor,
    ) -> Rows:
        device = mask.device
        params = [r.spec.params for r in requests]
        # Greedy rows never divide by their temperature; 1 keeps the arithmetic finite.
        temperature = [1.0 if r.greedy else r.spec.params.temperature for r in requests]
        width = max(1, *(len(r.stop_ids) for r in requests))
        stops = [r.stop_ids + [-1] * (width - len(r.stop_ids)) for r in requests]
        _grow_in_place(cache, room=max(r.spec.max_tokens for r in requests))
        return cls(
            requests=requests,
            samples=samples,
            cache=cache,
            mask=mask,
            next_pos=next_pos,
            temperature=to_device(temperature, torch.float32, device),
            top_k=to_device([p.top_k for p in params], torch.long, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            greedy=to_device([r.greedy for r in requests], torch.bool, device),
            streams=to_device(
                [r.streams[s] for r, s in zip(requests, samples, strict=True)], torch.long, device
            ),
            steps=to_device(
                [len(r.tokens[s]) for r, s in zip(requests, samples, strict=True)],
                torch.long,
                device,
            ),
            stop_ids=to_device(stops, torch.long, device),
        )

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def adapters(self) -> list[str]:
        return [r.adapter for r in self.requests]

    def close(self) -> None:
        """Every row left (nothing to give back: the cache goes with the rows)."""

    def mergeable(self) -> bool:
        """Whether other rows can join this cache: plain per-layer key / value tensors beside
        sliding-window layers (gpt-oss's) and linear-attention layers' per-row states
        (Qwen3.5's); a quantised cache keeps its own bookkeeping."""
        return joinable(self.cache)

    def select(self, keep: list[int]) -> None:
        """Keep these rows only, in order; then cut the columns no remaining row uses."""
        index = to_device(keep, torch.long, self.mask.device)
        select_rows(self.cache, index)
        self.requests = [self.requests[i] for i in keep]
        self.samples = [self.samples[i] for i in keep]
        self.mask = self.mask[index]
        self._index_fields(index)
        # The first column anyone uses, from the rows' lengths: no read of the mask.
        start = self.mask.shape[1] - self.used_columns()
        if start > 0 and joinable(self.cache):
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                if isinstance(layer, GrowingLayer):
                    layer.drop_left(start)
                elif isinstance(layer, DynamicSlidingWindowLayer):
                    drop_window_left(layer, start)

    def used_columns(self) -> int:
        """The cache columns the longest row uses (row_lengths)."""
        return max(self.row_lengths())

    def row_lengths(self) -> list[int]:
        """The cache columns each row uses, known on the host: its prompt's and its tokens'
        but the newest, which the next step feeds."""
        return [
            len(request.spec.prompt) + len(request.tokens[sample]) - 1
            for request, sample in zip(self.requests, self.samples, strict=True)
        ]

    def merge(self, other: Rows) -> None:
        """Append `other`'s rows (and cache) after these; the narrower side is left-padded."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        assert joinable(self.cache) and joinable(other.cache), "merge() needs mergeable() caches"
        pairs = zip(self.cache.layers, other.cache.layers, strict=True)
        for index, (layer, new_layer) in enumerate(pairs):
            if isinstance(layer, GrowingLayer) and isinstance(new_layer, GrowingLayer):
                self.cache.layers[index] = GrowingLayer.joined(layer, new_layer, width)
            elif isinstance(layer, DynamicSlidingWindowLayer):
                assert isinstance(new_layer, DynamicSlidingWindowLayer)
                self.cache.layers[index] = join_windows([layer, new_layer], width)
            else:
                assert isinstance(layer, LinearAttentionLayer)
                assert isinstance(new_layer, LinearAttentionLayer)
                self.cache.layers[index] = stacked_states([layer, new_layer])
        self.mask = torch.cat(
            [
                F.pad(self.mask, (width - self.mask.shape[1], 0)),
                F.pad(other.mask, (width - other.mask.shape[1], 0)),
            ]
        )
        self._append_fields(other)
        self.requests += other.requests
        self.samples += other.samples

    def _index_fields(self, index: torch.Tensor) -> None:
        """Keep the per-row settings and state of the rows `index` (on the device) names, in
        its order."""
        self.next_pos, self.tokens = self.next_pos[index], self.tokens[index]
        self.temperature, self.top_k, self.top_p = (
            self.temperature[index], self.top_k[index], self.top_p[index]
        )  # fmt: skip
        self.greedy, self.streams, self.steps = (
            self.greedy[index], self.streams[index], self.steps[index]
        )  # fmt: skip
        self.stop_ids = self.stop_ids[index]

    def _append_fields(self, other: Rows) -> None:
        """Append `other`'s per-row settings and state after these rows'."""
        stops = max(self.stop_ids.shape[1], other.stop_ids.shape[1])
        self.stop_ids = torch.cat(
            [F.pad(s, (0, stops - s.shape[1]), value=-1) for s in (self.stop_ids, other.stop_ids)]
        )
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.tokens = torch.cat([self.tokens, other.tokens])
        self.temperature = torch.cat([self.temperature, other.temperature])
        self.top_k = torch.cat([self.top_k, other.top_k])
        self.top_p = torch.cat([self.top_p, other.top_p])
        self.greedy = torch.cat([self.greedy, other.greedy])
        self.streams = torch.cat([self.streams, other.streams])
        self.steps = torch.cat([self.steps, other.steps])


def select_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep the cache's rows that `index` names, in its order. A linear-attention layer
    (Qwen3.5's) holds each row's recurrent and convolution state, no columns: it gathers them
    as a beam search reorders (its full-attention part too, where it has one)."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.reorder_cache(cast(torch.LongTensor, index))
        else:  # a key / value layer of any kind
            cast(DynamicLayer, layer).batch_select_indices(index)


def growing_layers(cache: DynamicCache) -> list[GrowingLayer] | None:
    """The cache's layers if every one is a GrowingLayer; else None."""
    layers = [layer for layer in cache.layers if isinstance(layer, GrowingLayer)]
    return layers if layers and len(layers) == len(cache.layers) else None


def joinable(cache: DynamicCache) -> bool:
    """Whether every layer is a GrowingLayer, a linear-attention layer (whose per-row states
    join by concatenation) or a sliding-window layer that keeps only its window: then rows
    can join and leave the cache."""
    return bool(cache.layers) and all(
        isinstance(layer, GrowingLayer) or joined_as_it_is(layer) for layer in cache.layers
    )


def fresh_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty cache of the model's layer kinds (its config's: a Qwen3.5's linear-attention
    layers, a gpt-oss's sliding windows)."""
    return DynamicCache(config=getattr(model, "config", None))


def prefilled_apart(cache: DynamicCache) -> bool:
    """Whether prompts prefilled into separate caches like this (a fresh one) can be joined
    after: plain key / value layers, beside those joined as they are."""
    return all(type(layer) is DynamicLayer or joined_as_it_is(layer) for layer in cache.layers)


def joined_as_it_is(layer: object) -> bool:
    """A linear-attention layer, or a sliding-window layer keeping only its window (one that
    records its past keeps more, for a crop to come)."""
    if type(layer) is DynamicSlidingWindowLayer:
        return not layer.record_past
    return type(layer) is LinearAttentionLayer


def _grow_in_place(cache: DynamicCache, room: int) -> None:
    """Make a plain cache's key / value layers GrowingLayers with `room` more columns at most,
    beside any linear-attention layers (others stay as they are: a sliding-window or quantised
    cache keeps its own bookkeeping)."""
    plain = (DynamicLayer, GrowingLayer)
    keyed: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for index, layer in enumerate(cache.layers):
        if joined_as_it_is(layer):
            continue
        if not isinstance(layer, DynamicLayer) or type(layer) not in plain:
            return
        if layer.keys is None or layer.values is None:
            return
        keyed.append((index, layer.keys, layer.values))
    for index, keys, values in keyed:
        cache.layers[index] = GrowingLayer.holding(keys, values, room)


def per_sample(
    taken: list[tuple[LiveRequest, range]], source: list[int]
) -> tuple[list[LiveRequest], list[int], list[int]]:
    """One entry per sample taken, in order: its request, its sample number, and the prefill
    row of its prompt."""
    requests: list[LiveRequest] = []
    samples: list[int] = []
    rows: list[int] = []
    for (request, taken_samples), row in zip(taken, source, strict=True):
        requests.extend([request] * len(taken_samples))
        samples.extend(taken_samples)
        rows.extend([row] * len(taken_samples))
    return requests, samples, rows


def kept(rows: Rows, keep: list[int]) -> Rows | None:
    """The rows after keeping `keep`; None when none is left."""
    if not keep:
        rows.close()
        return None
    if len(keep) < rows.size:
        rows.select(keep)
    return rows
