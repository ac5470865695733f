"""Prompts in flight, shared across steps: the KV states and last logits of each prompt (per
adapter) that a request still in the decode loop was prefilled with, so that an identical
request admitted at a later step joins from them instead of prefilling its prompt again.

An entry lives while some request with its (prompt, adapter) is in the loop, waiting or
running (`enter` / `leave`), so what it holds is bounded by what is in flight. Only plain
per-layer key / value caches are kept (a sliding-window or quantised cache keeps its own
bookkeeping, and such prompts are prefilled as usual).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from queue_tinker.workers.sampling.decode_rows import (
    LiveRequest,
    Rows,
    pad_left,
    per_sample,
    plain_layers,
)

PromptKey = tuple[tuple[int, ...], str]
# The kept states are a second copy of their prompts' KV cache: past this many bytes a prompt is
# not kept (an identical request then prefills it), so long prompts on a big model cannot double
# the loop's cache memory. 256 MiB keeps a few 4k-token prompts of an 8B model, or thousands of
# short RL prompts.
KEPT_BYTES = 1 << 28


def prompt_key(request: LiveRequest) -> PromptKey:
    return tuple(request.spec.prompt), request.adapter


@dataclass(frozen=True)
class SharedPrompt:
    """One prompt's prefill: per layer (keys, values) of shape (1, heads, prompt, dim), and
    the logits at its last position (vocab,), which its first token is chosen from."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[-2]

    @property
    def nbytes(self) -> int:
        states = sum(k.nbytes + v.nbytes for k, v in self.layers)
        return states + self.logits.nbytes


class SharedPrompts:
    def __init__(self, max_bytes: int = KEPT_BYTES) -> None:
        self.entries: dict[PromptKey, SharedPrompt] = {}
        self.users: Counter[PromptKey] = Counter()  # requests in the loop per prompt
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the entries hold

    def enter(self, request: LiveRequest) -> None:
        self.users[prompt_key(request)] += 1

    def leave(self, request: LiveRequest) -> None:
        """A request left the loop (finished or cancelled); its prompt's entry goes with the
        last request on it."""
        key = prompt_key(request)
        self.users[key] -= 1
        if self.users[key] <= 0:
            del self.users[key]
            entry = self.entries.pop(key, None)
            if entry is not None:
                self.nbytes -= entry.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.users.clear()
        self.nbytes = 0

    def get(self, request: LiveRequest) -> SharedPrompt | None:
        return self.entries.get(prompt_key(request))

    def keep(self, keys: list[PromptKey], cache: DynamicCache, last_logits: torch.Tensor) -> None:
        """Keep each prefill row's prompt (row i of the left-padded prefill is keys[i]): its
        own positions only, copied out of the padded batch so nothing else stays alive."""
        layers = plain_layers(cache)
        if layers is None:
            return
        width = layers[0][1][0].shape[-2]
        for row, key in enumerate(keys):
            if key in self.entries or key not in self.users:
                continue
            start = width - len(key[0])  # left padding: the prompt ends the row
            per_position = sum(k[row, :, 0].nbytes + v[row, :, 0].nbytes for _, (k, v) in layers)
            if self.nbytes + per_position * (width - start) > self.max_bytes:
                continue  # over the budget: an identical request prefills it again
            entry = SharedPrompt(
                layers=[
                    (k[row : row + 1, :, start:].clone(), v[row : row + 1, :, start:].clone())
                    for _, (k, v) in layers
                ],
                logits=last_logits[row].clone(),
            )
            self.entries[key] = entry
            self.nbytes += entry.nbytes

    def rows(self, taken: list[tuple[LiveRequest, range]]) -> tuple[Rows, torch.Tensor]:
        """Rows for requests whose prompts are kept, as `_prefill` would make them: the kept
        states left-padded to the longest and expanded to one row per sample, each row's
        positions going on from its prompt's length; and the logits each row chooses from."""
        unique: dict[PromptKey, int] = {}
        source = [unique.setdefault(prompt_key(r), len(unique)) for r, _ in taken]
        stored = [self.entries[key] for key in unique]
        requests, samples, rows = per_sample(taken, source)
        logits = torch.stack([entry.logits for entry in stored])
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        width = max(entry.length for entry in stored)
        data = [
            tuple(
                torch.cat([pad_left(entry.layers[layer][part], width) for entry in stored])[index]
                for part in (0, 1)
            )
            for layer in range(len(stored[0].layers))
        ]
        lengths = torch.tensor([entry.length for entry in stored], device=logits.device)[index]
        columns = torch.arange(width, device=logits.device)
        mask = (columns[None, :] >= width - lengths[:, None]).long()  # 1 at the real tokens
        incoming = Rows.build(
            requests=requests,
            samples=samples,
            cache=DynamicCache(ddp_cache_data=data),
            mask=mask,
            next_pos=lengths,  # real tokens count from 0, as alone
        )
        return incoming, logits[index]
