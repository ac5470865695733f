"""Choosing the next token of many rows at once, each with its own sampling settings.

Pure functions of logits and per-row settings; the uniforms come from the caller (each request
draws its own from its own generator, so a row's choice does not depend on the rest of the
batch). Logits of any dtype are scaled and normalised in float32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from queue_tinker.types.requests.sampling import SamplingParams
from queue_tinker.workers.sampling.host_reads import to_host

# Rows x vocab per softmax / sort pass: bounds their float and index copies (~0.4 GB) however
# many samples a batch holds.
CHUNK_ELEMENTS = 1 << 25


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0 or params.top_k == 1


def request_seed(params: SamplingParams) -> int:
    """The request's seed as a torch generator takes it (any int, wrapped to 64 bits)."""
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    return seed & 0xFFFF_FFFF_FFFF_FFFF


def sample_unfiltered(
    logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), by inverse CDF in vocabulary
    order: no sort needed when nothing is cut away."""
    cdf = torch.softmax(logits.float() / temperature[:, None], dim=-1).cumsum(dim=-1)
    target = uniforms.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return pos.clamp(max=cdf.shape[-1] - 1)  # rounding at the top end stays in the vocabulary


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    widest: int | None = None,
) -> torch.Tensor:
    """One token per row: logits / temperature, keep the top_k (<= 0: all), then the nucleus
    top_p of what is left, and draw by inverse CDF with `uniforms` (in [0, 1)). `widest`: the
    largest of the rows' kept counts (top_k, or the vocabulary), if the caller knows it
    (else it is read from the device).

    Both filters keep a prefix of the tokens sorted by probability, so one sort and one cumsum
    serve every row whatever its settings; only the prefix length differs per row.
    """
    scaled = logits.float() / temperature[:, None]
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    widest = int(to_host(k.max())) if widest is None else widest
    # Equal logits (frequent in bf16) in index order, as a stable sort puts them: an unstable
    # order may differ with the batch's size, and the same uniform would then draw another
    # token when other rows share the step.
    if widest < vocab:  # every row has a top_k: the k largest are all that can be drawn
        values, order = scaled.topk(widest, dim=-1)
        order, by_index = order.sort(dim=-1)
        values, resorted = values.gather(1, by_index).sort(dim=-1, descending=True, stable=True)
        order = order.gather(1, resorted)
    else:
        values, order = scaled.sort(dim=-1, descending=True, stable=True)
    # Probabilities relative to the kept set only: each row renormalises within its prefix.
    cdf = torch.softmax(values, dim=-1).cumsum(dim=-1)
    mass_k = cdf.gather(1, (k - 1)[:, None])
    before = F.pad(cdf[:, :-1], (1, 0))  # probability of everything more likely than token i
    # The nucleus: tokens whose predecessors (within the top k) hold less than top_p of its mass.
    nucleus = (before < top_p[:, None] * mass_k).sum(dim=-1)
    kept = torch.minimum(k, nucleus).clamp(min=1)
    total = cdf.gather(1, (kept - 1)[:, None])
    target = uniforms.to(cdf.device, cdf.dtype)[:, None] * total
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1)
    pos = torch.minimum(pos, kept - 1)  # rounding at the top end must not leave the kept set
    return order.gather(1, pos[:, None]).squeeze(1)


def model_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int]
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """On the device, from one log_softmax a row chunk: log p(token) of each row's chosen
    token under the model, and (logprobs, token ids) [rows, k] of every row's k most likely
    tokens, k the most any row wants (None when no row wants any; each row's own count is cut
    on the host, top_logprob_rows, after the step's one copy)."""
    vocab = logits.shape[-1]
    k = min(max(wanted, default=0), vocab)
    chosen, values, ids = [], [], []
    for part in row_chunks(len(wanted), vocab):
        logprobs = torch.log_softmax(logits[part].float(), dim=-1)
        chosen.append(logprobs.gather(1, tokens[part, None]).squeeze(1))
        if k:
            top = logprobs.topk(k, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
    return torch.cat(chosen), (torch.cat(values), torch.cat(ids)) if k else None


def top_logprob_rows(
    wanted: list[int], values: list[list[float]], ids: list[list[int]]
) -> list[list[tuple[int, float]] | None]:
    """Each row's top_k_sample_logprobs from the candidates read on the host: its `wanted`
    most likely (token, logprob) pairs, None for a row that wants none."""
    return [
        list(zip(ids[row][:want], values[row][:want], strict=True)) if want else None
        for row, want in enumerate(wanted)
    ]


def row_chunks(rows: int, vocab: int) -> list[slice]:
    """Slices of `rows` rows, each at most CHUNK_ELEMENTS of logits."""
    size = max(1, CHUNK_ELEMENTS // vocab)
    return [slice(start, min(rows, start + size)) for start in range(0, rows, size)]
