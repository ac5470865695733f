"""What a sample response says about its prompt, from the prompt's logits: the logprob of each
prompt token, the top-k tokens at each position, the logprobs of requested target ids, and
alternative tokens drawn at each position.

The sampling loop (sampler.py) runs each prompt once and hands this module one request's row
of logits; everything here is a function of that row and the request, so it can be checked
against full-vocabulary logits alone (tests/workers/sampling/test_prompt_scores.py). Work is
done over row chunks so a long prompt on a large vocabulary never holds (prompt x vocab) fp32 at
once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from queue_tinker.types.requests.sampling import NO_TARGET, SamplingParams
from queue_tinker.workers.sampling.host_reads import to_device, to_host
from queue_tinker.workers.sampling.token_choice import CHUNK_ELEMENTS, request_seed

if TYPE_CHECKING:
    from queue_tinker.workers.sampling.decode_rows import LiveRequest

# The alternatives draw from a stream of their own, seeded from the request's seed and this,
# so asking for them changes none of the request's samples.
PROMPT_ALT_SALT = 0x5EED_A17E


class PromptRequest(Protocol):
    # Read-only (properties), so a frozen dataclass such as sampler.GenerationRequest is one.
    @property
    def prompt(self) -> list[int]: ...
    @property
    def prompt_logprobs(self) -> bool: ...
    @property
    def prompt_topk(self) -> int: ...
    @property
    def prompt_targets(self) -> list[list[int]] | None: ...
    @property
    def prompt_alt_k(self) -> int: ...
    @property
    def params(self) -> SamplingParams: ...


def wants_prompt_scores(request: PromptRequest) -> bool:
    """Whether the request needs logits at every prompt position (not only the last)."""
    return bool(
        request.prompt_logprobs
        or request.prompt_topk
        or request.prompt_targets is not None
        or request.prompt_alt_k
    )


def _log_softmax_chunks(scored: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    rows, vocab = scored.shape
    size = max(1, CHUNK_ELEMENTS // vocab)
    for start in range(0, rows, size):
        part = slice(start, min(rows, start + size))
        yield part, torch.log_softmax(scored[part].float(), dim=-1)


def prompt_scores(logits: torch.Tensor, request: PromptRequest) -> dict[str, Any]:
    """The SampleResponse fields the request asked for about its prompt. `logits` is the
    request's row of the prefill: (width, vocab), the prompt left-padded into its last
    len(prompt) positions, position j predicting prompt token j + 1."""
    if not wants_prompt_scores(request):
        return {}
    prompt = request.prompt
    n = len(prompt)
    scored = logits[logits.shape[0] - n : -1]
    targets = to_device(prompt[1:], torch.long, logits.device)
    wanted = (
        to_device(request.prompt_targets, torch.long, logits.device)
        if request.prompt_targets is not None
        else None
    )
    logprobs: list[float | None] = [None]
    topk: list[list[tuple[int, float]] | None] = [None]
    target_lps: list[list[float]] = []
    alternatives = _Alternatives(request) if request.prompt_alt_k else None
    k = min(request.prompt_topk, logits.shape[-1])
    for part, rows in _log_softmax_chunks(scored):
        if alternatives is not None:
            alternatives.draw(scored[part], rows)
        if request.prompt_logprobs:
            logprobs.extend(to_host(rows.gather(1, targets[part, None]).squeeze(1)))
        if k:
            values, ids = rows.topk(k, dim=-1)  # sorted, most likely first
            topk.extend(
                [
                    list(zip(i, v, strict=True))
                    for i, v in zip(to_host(ids), to_host(values), strict=True)
                ]
            )
        if wanted is not None:
            cells = wanted[part]
            picked = rows.gather(1, cells.clamp(min=0))
            target_lps.extend(to_host(picked.masked_fill(cells == NO_TARGET, 0.0)))
    fields: dict[str, Any] = {}
    if request.prompt_logprobs:
        fields["prompt_logprobs"] = logprobs
    if k:
        fields["topk_prompt_logprobs"] = topk
    if wanted is not None:
        fields["target_prompt_logprobs"] = target_lps
    if alternatives is not None:
        fields["prompt_alt_tokens"] = {
            "tokens": alternatives.tokens,
            "logprobs": alternatives.logprobs,
        }
    return fields


class _Alternatives:
    """prompt_alt_tokens_k draws at each prompt position after the first: k token ids drawn
    with replacement from softmax(logits / temperature) (the most likely one k times for a
    greedy request), by inverse CDF on uniforms from the request's own stream, and their
    logprobs under the model (no temperature, as every logprob a response carries)."""

    def __init__(self, request: PromptRequest) -> None:
        self.k = request.prompt_alt_k
        self.temperature = request.params.temperature
        seed = (request_seed(request.params) ^ PROMPT_ALT_SALT) & 0xFFFF_FFFF_FFFF_FFFF
        self.generator = torch.Generator().manual_seed(seed)
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []

    def draw(self, logits: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Draws for a chunk of positions: their logits and their fp32 log-softmax."""
        uniforms = torch.rand((logits.shape[0], self.k), generator=self.generator)
        if self.temperature <= 0:
            ids = logprobs.argmax(dim=-1, keepdim=True).expand(-1, self.k)
        else:
            cdf = torch.softmax(logits.float() / self.temperature, dim=-1).cumsum(dim=-1)
            scaled = uniforms.to(cdf.device) * cdf[:, -1:]
            ids = torch.searchsorted(cdf, scaled, right=True).clamp(max=cdf.shape[-1] - 1)
        self.tokens.extend(to_host(ids))
        self.logprobs.extend(to_host(logprobs.gather(1, ids)))


def record_prompt_scores(
    taken: list[tuple[LiveRequest, range]],
    source: list[int],
    wanted: list[bool],
    logits: torch.Tensor,
) -> None:
    """Each request that wants its prompt scored gets them from its prompt's row of `logits`."""
    for (request, _), row, want in zip(taken, source, wanted, strict=True):
        if want:
            request.prompt_scores = prompt_scores(logits[row], request.spec)
