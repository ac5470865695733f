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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from queue_tinker.workers.sampling.host_reads import to_device

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
