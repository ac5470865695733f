"""Prefill through the prefix cache (prefix_cache.py): which waiting requests join from kept
prompts, the rest of a prompt prefilled on top of its kept prefix, and chunked prefill.

- **Look-up.** A request whose whole prompt is kept joins from it; one whose prompt begins
  with a kept one (whole blocks, or a whole kept prompt: prefix_cache.py) prefills only the
  rest, on top of the kept states, one prompt per model call. A part that reports its
  prompt's scores (they need every position's logits) and a prompt holding images (its ids
  are placeholder slots, the same for any image) are prefilled whole, as before.
- **Chunked prefill.** While rows are decoding, a prompt with more than a step's prefill budget
  left to prefill goes in chunks of whole blocks, one per step: each chunk is prefilled on top
  of the one before and kept (pinned to its request, so it is not evicted meanwhile), and the
  running rows take a decode step between chunks, so a long prompt holds them up for at most a
  chunk's prefill a step. Alone in the loop, a prompt is prefilled at once (fewer calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from queue_tinker.workers.sampling.decode_rows import LiveRequest, fresh_cache
from queue_tinker.workers.sampling.host_reads import to_device
from queue_tinker.workers.sampling.model_call import ModelCall
from queue_tinker.workers.sampling.prefix_cache import (
    BLOCK,
    PrefixCache,
    PrefixHit,
    PromptKey,
    SharedPrompt,
    charge_prefilled,
    keeps,
    prompt_key,
    prompt_layers,
)
from queue_tinker.workers.sampling.prompt_scores import wants_prompt_scores

Part = tuple[LiveRequest, range]  # a request and which of its samples join


def prefilled_whole(request: LiveRequest, samples: range) -> bool:
    """Whether this part is prefilled whatever the cache holds: it reports its prompt's scores,
    or its prompt holds images."""
    scores = wants_prompt_scores(request.spec) and samples.start == 0
    return scores or request.spec.images is not None


def look_up(
    cache: PrefixCache, taken: Sequence[Part]
) -> tuple[list[Part], list[Part], dict[PromptKey, SharedPrompt], dict[PromptKey, PrefixHit]]:
    """The taken parts that join from the cache and those prefilled afresh; the whole prompts
    it holds and the prompts it holds a prefix of."""
    cached: list[Part] = []
    fresh: list[Part] = []
    entries: dict[PromptKey, SharedPrompt] = {}
    hits: dict[PromptKey, PrefixHit] = {}
    for request, samples in taken:
        key = prompt_key(request)
        if prefilled_whole(request, samples):
            fresh.append((request, samples))
            continue
        if key not in entries and key not in hits:
            entry = cache.get(request)
            if entry is not None:
                entries[key] = entry
            elif (hit := cache.longest_prefix(request)) is not None:
                hits[key] = hit
        (cached if key in entries or key in hits else fresh).append((request, samples))
    return cached, fresh, entries, hits


def prefill_on(
    forward: ModelCall,
    model: torch.nn.Module,
    key: PromptKey,
    hit: PrefixHit | None,
    device: torch.device,
) -> SharedPrompt:
    """The prompt `key[0]` prefilled alone on `key[1]`'s adapter, on top of the kept prefix
    `hit` (from its first token without one): its states and last logits."""
    prompt, adapter = key
    done = 0 if hit is None else hit.tokens
    cache = fresh_cache(model) if hit is None else hit.entry.prefix_cache(done)
    ids = to_device([prompt[done:]], torch.long, device)
    mask = torch.ones(1, len(prompt), dtype=torch.long, device=device)
    positions = torch.arange(done, len(prompt), device=device)[None]
    logits = forward(model, ids, mask, positions, cache, [adapter], last_only=True)
    layers = prompt_layers(cache, 0, len(prompt))
    assert layers is not None, "prefilled on top of a kept prompt, or into a cache that keeps"
    return SharedPrompt(layers, logits[0, -1], len(prompt))


def extend(
    forward: ModelCall,
    model: torch.nn.Module,
    cache: PrefixCache,
    hits: Mapping[PromptKey, PrefixHit],
    taken: Sequence[Part],
    device: torch.device,
) -> tuple[dict[PromptKey, SharedPrompt], int]:
    """Each prompt that begins with a kept one prefilled on top of it and kept whole; the new
    entries, and the prompt tokens run through the model."""
    extended = {key: prefill_on(forward, model, key, hit, device) for key, hit in hits.items()}
    for key, entry in extended.items():
        cache.add(key, entry)
    prefilled = {key: len(key[0]) - hit.tokens for key, hit in hits.items()}
    return extended, charge_prefilled(taken, prefilled)


def next_chunk(
    forward: ModelCall,
    model: torch.nn.Module,
    cache: PrefixCache,
    request: LiveRequest,
    budget: int,
    device: torch.device,
) -> int:
    """Prefill the next chunk (the most whole blocks within `budget` tokens) of a waiting
    request's prompt, if more than `budget` of it is left to prefill; the tokens prefilled
    (0: none, the request joins as usual)."""
    chunk = budget // BLOCK * BLOCK
    if chunk <= 0 or request.admitted or prefilled_whole(request, range(1)):
        return 0
    if cache.get(request) is not None:
        return 0
    hit = cache.longest_prefix(request)
    done = 0 if hit is None else hit.tokens
    prompt = request.spec.prompt
    if len(prompt) - done <= budget:
        return 0
    if not keeps(fresh_cache(model)):
        return 0  # its chunks could not be kept: the whole prompt is prefilled when it joins
    key = (tuple(prompt[: done + chunk]), request.adapter)
    entry = prefill_on(forward, model, key, hit, device)
    if not cache.add(key, entry):
        return 0  # no room to keep it: the whole prompt is prefilled when it joins
    cache.pin(request, key)
    request.prefilled += chunk
    return chunk
