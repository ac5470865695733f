"""Which prompts to prefill together: prompts of very different lengths, left-padded into one
batch, spend most of the prefill on padding; prefilled in groups of similar length they waste
less, at the price of a model call per group.

The grouping minimises padded tokens + `call_tokens` per group over groups of consecutive
lengths (sorted), exactly (dynamic programming, O(prompts^2)). `call_tokens` is what a call
costs in tokens' worth of prefill: on a CPU, where a prefill's time grows with its tokens, a
few dozen (on this machine's 2 cores: 32 prompts of 8-48 tokens on the 100M model, padded into
one batch 1.00 s, in 4 groups 0.77 s); on a GPU a call costs its kernel launches (~18 ms at
100M on an H100, the time of tens of thousands of prefill tokens), so only long uneven prompts
are split there.

`prefill_prompts` runs the prefill: a group's distinct (prompt, adapter) pairs once each,
left-padded, kept by the prefix cache, the cache then expanded to one row per sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from queue_tinker.workers.model.lora.row_blocks import grouped_order
from queue_tinker.workers.sampling.decode_rows import (
    Rows,
    fresh_cache,
    per_sample,
    prefilled_apart,
    select_rows,
)
from queue_tinker.workers.sampling.host_reads import to_device
from queue_tinker.workers.sampling.image_prefill import prefill_with_images
from queue_tinker.workers.sampling.model_call import ModelCall
from queue_tinker.workers.sampling.prefix_cache import PrefixCache, charge_prefilled, prompt_key
from queue_tinker.workers.sampling.prefix_prefill import Part
from queue_tinker.workers.sampling.prompt_scores import record_prompt_scores, wants_prompt_scores

CALL_TOKENS_CPU = 64
CALL_TOKENS_GPU = 8192


def prefill_call_tokens(device: torch.device) -> int:
    return CALL_TOKENS_CPU if device.type == "cpu" else CALL_TOKENS_GPU


def length_groups(lengths: Sequence[int], call_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, grouped: each group is prefilled as one left-padded batch; the
    groups from shortest to longest, each in order of length."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    # best[j]: the least cost of the j shortest prompts; cut[j]: where their last group starts.
    best = [0] + [0] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        widest = lengths[order[end - 1]]  # sorted: the group's last prompt is its longest
        best[end], cut[end] = min(
            (best[start] + (end - start) * widest + call_tokens, start) for start in range(end)
        )
    groups: list[list[int]] = []
    end = len(order)
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def padded_prompts(
    prompts: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of the prompts, one row each, left-padded to the longest, on `device`."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    both = to_device(torch.stack([ids, mask]), torch.long, device)  # one copy
    return both[0], both[1]


def prefill_prompts(
    call: ModelCall,
    model: torch.nn.Module,
    prompts: PrefixCache,
    taken: list[Part],
    device: torch.device,
    call_tokens: int,
) -> tuple[list[tuple[Rows, torch.Tensor]], int]:
    """The taken requests' prompts prefilled in groups of similar length (length_groups), each
    group's rows and the logits they choose their first tokens from; and the prompt tokens run
    through the model. A cache whose prompts cannot be prefilled apart and joined after
    (decode_rows.prefilled_apart) takes one group. A prompt with images is prefilled alone
    (image_prefill.py)."""
    parts, prefilled = [], 0
    for request, samples in [(r, s) for r, s in taken if r.spec.images is not None]:
        prefilled += len(request.spec.prompt)
        parts.append(prefill_with_images(call, model, request, samples, device))
    taken = [(r, samples) for r, samples in taken if r.spec.images is None]
    if not taken:
        return parts, prefilled
    keys = list(dict.fromkeys(prompt_key(r) for r, _ in taken))
    if not prefilled_apart(fresh_cache(model)):
        groups = [list(range(len(keys)))]
    else:
        groups = length_groups([len(prompt) for prompt, _ in keys], call_tokens)
    for group in groups:
        chosen = {keys[i] for i in group}
        part = [(r, samples) for r, samples in taken if prompt_key(r) in chosen]
        rows, logits, tokens = _prefill_group(call, model, prompts, part, device)
        parts.append((rows, logits))
        prefilled += tokens
    return parts, prefilled


def _prefill_group(
    call: ModelCall,
    model: torch.nn.Module,
    prompts: PrefixCache,
    taken: list[Part],
    device: torch.device,
) -> tuple[Rows, torch.Tensor, int]:
    """Each distinct (prompt, adapter) once, left-padded; the cache expanded to one row per
    sample. The new rows, the logits each row chooses its first token from, and the prompt
    tokens run through the model."""
    keys = list(dict.fromkeys(prompt_key(r) for r, _ in taken))
    keys = [keys[i] for i in grouped_order([adapter for _, adapter in keys])]
    unique = {key: row for row, key in enumerate(keys)}
    source = [unique[prompt_key(r)] for r, _ in taken]
    ids, mask = padded_prompts([prompt for prompt, _ in unique], device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # real tokens count from 0, as alone
    # What a request asks about its prompt comes with its first part.
    wanted = [wants_prompt_scores(r.spec) and samples.start == 0 for r, samples in taken]
    cache = fresh_cache(model)
    adapters = [adapter for _, adapter in unique]
    logits = call(model, ids, mask, positions, cache, adapters, last_only=not any(wanted))
    prefilled = charge_prefilled(taken, {key: len(key[0]) for key in unique})
    prompts.keep(list(unique), cache, logits[:, -1])
    record_prompt_scores(taken, source, wanted, logits)
    requests, samples, rows = per_sample(taken, source)
    index = to_device(rows, torch.long, device)
    if rows != list(range(len(unique))):  # expand to samples
        select_rows(cache, index)
    incoming = Rows.build(
        requests=requests,
        samples=samples,
        cache=cache,
        mask=mask[index],
        next_pos=(positions[:, -1] + 1)[index],
    )
    return incoming, logits[:, -1][index], prefilled
