"""The sampler's prefix cache: the key / value states and last logits of prompts prefilled
before (per adapter), so that a request whose prompt was seen joins from them instead of
prefilling it again, and one whose prompt begins with a kept prompt prefills only the rest.

- **Exact hits.** A request with a kept (prompt, adapter) joins from its states and logits:
  none of its prompt runs through the model.
- **Prefix hits.** Otherwise the longest kept prefix, in whole blocks of `BLOCK` tokens (an RL
  group's shared question, a conversation's history, a long system prompt), seeds the cache and
  only the remaining tokens are prefilled on top of it; the full prompt is then kept too.
- **Least recently used out.** Entries outlive their requests and are evicted, least recently
  used first, once what they hold passes `max_bytes`; an entry a request in the loop still
  counts on (`enter` / `leave`) is never evicted, so one admitted in a later step finds it.
  Under a KV budget the decode loop sets `max_bytes` (`resize`) to what the budget leaves
  beside its rows' peak, KEPT_BYTES at least: the prompts kept share the sampler's memory with
  the rows, growing while few rows run and giving way as more join.

- **Prefixes only where a state was saved.** A key / value layer holds every position, so any
  whole-block prefix of a kept prompt seeds a cache. A linear-attention layer's recurrent and
  convolution states (Qwen3.5's) and a sliding-window layer's last columns (gpt-oss's) hold
  the prompt's end only: a prompt with such layers is reused whole or as the exact beginning
  of a longer prompt (a conversation's next turn, a long prompt's next chunk), never cut
  inside. Every kept prompt is also found at its own end, whole blocks or not.

Prefixes are found by a chain of block hashes (each block's hash covers every block before
it), checked against the tokens on a hit, so a lookup costs one hash per block of the prompt
(a kept prompt's end is indexed under its last whole block's hash). Adapter names stand for
immutable weights (a checkpoint's), so a kept state never goes stale; inflight weights moving
on change a request's adapter, and its next prompt misses.

A cache with any other kind of layer (a quantised one, say) is not kept; its prompts are
prefilled as usual.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from queue_tinker.workers.sampling.decode_rows import (
    LiveRequest,
    Rows,
    joined_as_it_is,
    per_sample,
    select_rows,
)
from queue_tinker.workers.sampling.host_reads import to_device
from queue_tinker.workers.sampling.kv_cache import (
    GrowingLayer,
    cache_of,
    held_bytes,
    join_windows,
    keys_layer,
    pad_left,
    stacked_states,
    state_rows,
    window_rows,
)

PromptKey = tuple[tuple[int, ...], str]
# The kept states are a second copy of their prompts' KV cache: past this many bytes the least
# recently used entries go (or a new prompt is not kept), so the cache cannot double the loop's
# memory on a big model. 256 MiB keeps a few 4k-token prompts of an 8B model, or thousands of
# short RL prompts.
KEPT_BYTES = 1 << 28
# Prefix hits come in whole blocks of this many tokens (as paged KV caches share them): finer
# would cost a hash per token, coarser would miss short shared prefixes.
BLOCK = 16


def prompt_key(request: LiveRequest) -> PromptKey:
    return tuple(request.spec.prompt), request.adapter


def charge_prefilled(
    taken: Iterable[tuple[LiveRequest, range]], tokens: Mapping[PromptKey, int]
) -> int:
    """Each prompt's prefilled tokens (`tokens`) counted once, for the first taken request on
    it (the others shared its prefill); their total."""
    charged: set[PromptKey] = set()
    for request, _ in taken:
        key = prompt_key(request)
        if key in tokens and key not in charged:
            charged.add(key)
            request.prefilled += tokens[key]
    return sum(tokens.values())


# A kept prompt's layer: its (keys, values), (1, heads, prompt, dim) each; or a one-row layer
# whose states hold the prompt's end only (a linear-attention or a sliding-window layer).
KeptLayer = tuple[torch.Tensor, torch.Tensor] | LinearAttentionLayer | DynamicSlidingWindowLayer


@dataclass(frozen=True)
class SharedPrompt:
    """One prompt's prefill: each layer's states (KeptLayer), the logits at its last position
    (vocab,), which its first token is chosen from, and its length."""

    layers: list[KeptLayer]
    logits: torch.Tensor
    length: int

    @property
    def sliceable(self) -> bool:
        """Whether any prefix of it can seed a cache (key / value layers only), not only the
        whole prompt."""
        return all(isinstance(layer, tuple) for layer in self.layers)

    @property
    def nbytes(self) -> int:
        states = sum(
            layer[0].nbytes + layer[1].nbytes if isinstance(layer, tuple) else held_bytes(layer)
            for layer in self.layers
        )
        return states + self.logits.nbytes

    def prefix_cache(self, tokens: int) -> DynamicCache:
        """A cache holding this prompt's first `tokens` positions (all of them unless
        sliceable), to prefill more on top of; the entry itself is never written (the key /
        value layers concatenate onto its tensors, the others hold copies)."""
        assert tokens == self.length or self.sliceable, "a state holds its prompt's end only"
        whole = slice(0, 1)
        return cache_of(
            [
                keys_layer(layer[0][..., :tokens, :], layer[1][..., :tokens, :])
                if isinstance(layer, tuple)
                else window_rows(layer, whole, tokens)
                if isinstance(layer, DynamicSlidingWindowLayer)
                else state_rows(layer, whole)
                for layer in self.layers
            ]
        )


def keeps(cache: DynamicCache) -> bool:
    """Whether prompts prefilled into a cache like this one (a fresh one) can be kept: every
    layer a key / value layer, or one rows join as it is (decode_rows.joined_as_it_is)."""
    return all(
        type(layer) in (DynamicLayer, GrowingLayer) or joined_as_it_is(layer)
        for layer in cache.layers
    )


def prompt_layers(cache: DynamicCache, row: int, length: int) -> list[KeptLayer] | None:
    """Row `row`'s prompt (its last `length` columns: prompts are left-padded) in every layer
    of a prefill's cache, copied out so nothing else stays alive; None if the cache is not
    kept (keeps) or a layer holds nothing."""
    if not keeps(cache):
        return None
    rows = slice(row, row + 1)
    kept: list[KeptLayer] = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            kept.append(state_rows(layer, rows))
            continue
        assert isinstance(layer, DynamicLayer)
        if layer.keys is None or layer.values is None:
            return None
        if isinstance(layer, DynamicSlidingWindowLayer):
            kept.append(window_rows(layer, rows, length))
        else:
            width = layer.keys.shape[2]
            kept.append(
                (
                    layer.keys[rows, :, width - length :].clone(),
                    layer.values[rows, :, width - length :].clone(),
                )
            )
    return kept


@dataclass(frozen=True)
class PrefixHit:
    """A kept prompt whose first `tokens` tokens begin a request's prompt (fewer than all)."""

    entry: SharedPrompt
    tokens: int


def block_hashes(prompt: Sequence[int], adapter: str) -> Iterator[tuple[int, int]]:
    """(length, hash of prompt[:length] and the adapter) at the prompt's start (length 0) and
    at every whole block of it."""
    chained = hash(adapter)
    yield 0, chained
    for end in range(BLOCK, len(prompt) + 1, BLOCK):
        chained = hash((chained, tuple(prompt[end - BLOCK : end])))
        yield end, chained


def end_hash(prompt: Sequence[int], adapter: str) -> int:
    """The block hash a kept prompt's end is indexed under: its last whole block's."""
    *_, (_, chained) = block_hashes(prompt, adapter)
    return chained


class PrefixCache:
    def __init__(self, max_bytes: int = KEPT_BYTES) -> None:
        # Least recently used first.
        self.entries: OrderedDict[PromptKey, SharedPrompt] = OrderedDict()
        self.users: Counter[PromptKey] = Counter()  # requests in the loop per prompt
        # Block-chain hash -> a kept sliceable prompt that starts with those blocks.
        self.prefixes: dict[int, PromptKey] = {}
        # Block-chain hash -> the kept prompts whose last whole block it is (their ends).
        self.ends: dict[int, set[PromptKey]] = {}
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the entries hold

    def enter(self, request: LiveRequest) -> None:
        self.users[prompt_key(request)] += 1

    def leave(self, request: LiveRequest) -> None:
        """A request left the loop (finished, cancelled or moved to other weights); its
        prompt's entry stays, evictable once no request in the loop counts on it."""
        self.unpin(request)
        self._release(prompt_key(request))

    def pin(self, request: LiveRequest, key: PromptKey) -> None:
        """Keep a kept prefix of the request's prompt (its prefill so far) from eviction until
        the request joins or leaves (one pin a request: the newest)."""
        self.unpin(request)
        self.users[key] += 1
        request.pinned = key

    def unpin(self, request: LiveRequest) -> None:
        if request.pinned is not None:
            self._release(request.pinned)
            request.pinned = None

    def _release(self, key: PromptKey) -> None:
        self.users[key] -= 1
        if self.users[key] <= 0:
            del self.users[key]

    def clear(self) -> None:
        self.entries.clear()
        self.users.clear()
        self.prefixes.clear()
        self.ends.clear()
        self.nbytes = 0

    def get(self, request: LiveRequest) -> SharedPrompt | None:
        """The request's whole prompt, kept (an exact hit): marked recently used."""
        key = prompt_key(request)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def longest_prefix(self, request: LiveRequest) -> PrefixHit | None:
        """The longest kept prefix of the request's prompt, leaving at least one token to
        prefill (its logits choose the first token): whole blocks of a sliceable kept prompt,
        or a whole kept prompt; marked recently used."""
        prompt, adapter = prompt_key(request)
        limit = len(prompt) - 1
        found: tuple[int, PromptKey] | None = None
        for end, chained in block_hashes(prompt[:limit], adapter):
            key = self.prefixes.get(chained)
            if end > 0 and key is not None and (found is None or end > found[0]):
                found = end, key
            for kept in self.ends.get(chained, ()):  # prompts ending in the next block
                length = len(kept[0])
                longer = found is None or length > found[0]
                if longer and length <= limit and kept == (prompt[:length], adapter):
                    found = length, kept
        if found is None:
            return None
        end, key = found
        if key[1] != adapter or key[0][:end] != prompt[:end]:
            return None  # a hash collision
        self.entries.move_to_end(key)
        return PrefixHit(self.entries[key], end)

    def keep(self, keys: list[PromptKey], cache: DynamicCache, last_logits: torch.Tensor) -> None:
        """Keep each prefill row's prompt (row i of the left-padded prefill is keys[i]): its
        own positions only, copied out of the padded batch so nothing else stays alive."""
        for row, key in enumerate(keys):
            if key in self.entries:
                continue
            layers = prompt_layers(cache, row, len(key[0]))
            if layers is None:
                return
            self.add(key, SharedPrompt(layers, last_logits[row].clone(), len(key[0])))

    def add(self, key: PromptKey, entry: SharedPrompt) -> bool:
        """Keep a prompt's states, evicting the least recently used entries no request in
        the loop counts on to make room; False (nothing kept) if there is no room."""
        if key in self.entries:
            return True
        if not self._make_room(entry.nbytes):
            return False
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        if entry.sliceable:
            for _, chained in block_hashes(key[0], key[1]):
                self.prefixes[chained] = key  # the newest: the last to be evicted
        self.ends.setdefault(end_hash(*key), set()).add(key)
        return True

    def bytes_per_token(self) -> float | None:
        """What a kept token costs (every layer's keys and values), from an entry; None while
        none is kept."""
        for entry in self.entries.values():
            return entry.nbytes / entry.length
        return None

    def resize(self, max_bytes: int) -> None:
        """Hold at most `max_bytes` from now on: the least recently used entries no request in
        the loop counts on go until what is kept fits."""
        self.max_bytes = max_bytes
        self._make_room(0)

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.max_bytes:
            return False
        if self.nbytes + nbytes <= self.max_bytes:
            return True  # the decode loop resizes at every step: mostly this
        for key in [k for k in self.entries if k not in self.users]:
            if self.nbytes + nbytes <= self.max_bytes:
                break
            self._evict(key)
        return self.nbytes + nbytes <= self.max_bytes

    def _evict(self, key: PromptKey) -> None:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes
        for _, chained in block_hashes(key[0], key[1]):
            if self.prefixes.get(chained) == key:
                del self.prefixes[chained]
        ends = self.ends[end_hash(*key)]
        ends.discard(key)
        if not ends:
            del self.ends[end_hash(*key)]

    def rows(
        self, taken: list[tuple[LiveRequest, range]], entries: Mapping[PromptKey, SharedPrompt]
    ) -> tuple[Rows, torch.Tensor]:
        """Rows for requests whose whole prompts' states are in `entries`, as `_prefill` would
        make them: the states left-padded to the longest and expanded to one row per sample,
        each row's positions going on from its prompt's length; and the logits each row
        chooses from."""
        unique: dict[PromptKey, int] = {}
        source = [unique.setdefault(prompt_key(r), len(unique)) for r, _ in taken]
        stored = [entries[key] for key in unique]
        requests, samples, rows = per_sample(taken, source)
        logits = torch.stack([entry.logits for entry in stored])
        index = to_device(rows, torch.long, logits.device)
        width = max(entry.length for entry in stored)
        cache = cache_of(
            [
                _joined([entry.layers[layer] for entry in stored], width)
                for layer in range(len(stored[0].layers))
            ]
        )
        if rows != list(range(len(stored))):  # to one row per sample
            select_rows(cache, index)
        lengths = to_device([entry.length for entry in stored], torch.long, logits.device)[index]
        columns = torch.arange(width, device=logits.device)
        mask = (columns[None, :] >= width - lengths[:, None]).long()  # 1 at the real tokens
        incoming = Rows.build(
            requests=requests,
            samples=samples,
            cache=cache,
            mask=mask,
            next_pos=lengths,  # real tokens count from 0, as alone
        )
        return incoming, logits[index]


def _joined(layers: Sequence[KeptLayer], width: int) -> DynamicLayer | LinearAttentionLayer:
    """One layer of several kept prompts, one row each, left-padded to `width` columns."""
    first = layers[0]
    if isinstance(first, tuple):
        pairs = cast(Sequence[tuple[torch.Tensor, torch.Tensor]], layers)
        return keys_layer(
            torch.cat([pad_left(keys, width) for keys, _ in pairs]),
            torch.cat([pad_left(values, width) for _, values in pairs]),
        )
    if isinstance(first, DynamicSlidingWindowLayer):
        return join_windows(cast(Sequence[DynamicSlidingWindowLayer], layers), width)
    return stacked_states(cast(Sequence[LinearAttentionLayer], layers))
