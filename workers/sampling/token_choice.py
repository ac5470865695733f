"""Choosing the next token of many rows at once, each with its own sampling settings.

Every row of a step is chosen by the same few fixed-shape operations, whatever its settings
and with no read of the device: the shapes depend on the rows and the vocabulary only, so a
step can be captured in a graph, and a fused kernel can reproduce the mapping bit for bit.

- **Uniforms on the device.** A row's draw at its step s is a hash of (its sample's stream,
  s) (`step_uniforms`): a 24-bit integer from a 32-bit integer mix of a counter. The stream
  is fixed by the request's seed and the sample's index (`sample_stream`), the step counted in
  the sample's own tokens, so a row's draws do not depend on what shares its batch, when it
  joined, or which kind of step ran it, and nothing is copied to the device per step.
- **Cuts without sorting the vocabulary.** top_k and top_p keep the tokens whose (tempered)
  logit is at or above a per-row threshold: for top_k the k-th largest logit (from `topk` of
  the batch's widest k, a power of two), for top_p the logit of the most likely token whose
  cumulative mass (counted from the most likely down) first reaches top_p of what top_k kept:
  among the top_k candidates when the row cuts both, else by a radix select over the logits'
  order-preserving 32-bit keys (`_threshold`: four passes of 8 bits, each a 256-bucket
  histogram). Tokens tied at a threshold are all kept, so a cut never depends on the order a
  sort would leave ties in.
- **Exact integer masses.** Probabilities become integers of 2**-MASS_BITS, and the histograms,
  the nucleus and the draw (inverse CDF in vocabulary order) are integer sums: every row's
  choice is exact and the same on any device and in any batch, given its logits.

Logits of any dtype are scaled and normalised in float32. The logprobs a response carries are
the model's (no temperature), from the same log_softmax the draw starts from (`choose`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from queue_tinker.types.requests.sampling import SamplingParams

# Rows x vocab per float pass (a log_softmax: prompt_scores.py too): bounds its float copies
# (~0.4 GB) however many rows a batch holds.
CHUNK_ELEMENTS = 1 << 25
# Rows x vocab per `choose` pass: its int64 masses, keys and histograms' inputs take 8 bytes an
# element, so a quarter of that bounds them alike.
CHOICE_CHUNK_ELEMENTS = CHUNK_ELEMENTS // 4
# Probabilities as integers of 2**-36: a token below 1.5e-11 of its row's mass is never drawn;
# 24-bit uniforms times a row's total mass (<= 2**36 + vocab) stay within int64.
MASS_BITS = 36
UNIFORM_BITS = 24
_WORD = 0xFFFF_FFFF
SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF
# Sample j of a request takes stream mix(seed + j * stride) (a 64-bit odd constant, the golden
# ratio's: the samples' streams are far apart whatever the request's seed).
SAMPLE_SEED_STRIDE = 0x9E37_79B9_7F4A_7C15
STEP_STRIDE = 0x9E37_79B9  # its 32-bit counterpart: a row's counter steps by it


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0 or params.top_k == 1


def request_seed(params: SamplingParams) -> int:
    """The request's seed as 64 bits (any int wrapped; a random one when it sets none)."""
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    return seed & SEED_MASK


def sample_stream(seed: int, sample: int) -> tuple[int, int]:
    """The (high, low) 32-bit words of sample `sample`'s stream: splitmix64's finaliser of its
    seed, so nearby seeds and samples give unrelated streams."""
    z = (seed + sample * SAMPLE_SEED_STRIDE) & SEED_MASK
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & SEED_MASK
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & SEED_MASK
    z ^= z >> 31
    return z >> 32, z & _WORD


def step_uniforms(streams: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's draw at its step: an int64 in [0, 2**UNIFORM_BITS), the mix of its stream's
    low word with a counter that starts at its high word and steps by a 32-bit odd constant
    (streams (rows, 2): high and low words; steps (rows,)). Two samples' draws are one
    sequence shifted only if their low words are equal."""
    counter = (streams[:, 0] + steps.long() * STEP_STRIDE) & _WORD
    return _mix32(counter ^ streams[:, 1]) >> (32 - UNIFORM_BITS)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of words held in int64."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB_352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846C_A68B)
    return x ^ (x >> 16)


def _times(x: torch.Tensor, factor: int) -> torch.Tensor:
    """x * factor mod 2**32 for 32-bit words in int64, with no product past 2**63 (signed
    overflow is undefined in the kernels torch builds): a factor's top bit adds x's low bit
    times 2**31."""
    if factor < 1 << 31:
        return (x * factor) & _WORD
    return (x * (factor - (1 << 31)) + ((x & 1) << 31)) & _WORD


@dataclass(frozen=True)
class Cuts:
    """The cuts a batch's rows make, known on the host from their settings (a row that makes
    none passes every threshold whole): `top_k`, the candidates top_k is found among (the
    smallest power of two at least every row's top_k; 0: no row cuts one); `top_p`, whether a
    row cuts a nucleus; `nucleus_in_top_k`, whether each such row cuts a top_k too, so its
    nucleus is found among the candidates rather than by a select over the vocabulary."""

    top_k: int = 0
    top_p: bool = False
    nucleus_in_top_k: bool = False

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int) -> Cuts:
        return cls.of_settings([p.top_k for p in params], [p.top_p for p in params], vocab)

    @classmethod
    def of_settings(cls, top_ks: list[int], top_ps: list[float], vocab: int) -> Cuts:
        cutting = [0 < k < vocab for k in top_ks]
        widest = max((k for k, cuts in zip(top_ks, cutting, strict=True) if cuts), default=0)
        nucleus = [cuts for cuts, p in zip(cutting, top_ps, strict=True) if p < 1]
        return cls(
            top_k=min(vocab, 1 << (widest - 1).bit_length()) if widest else 0,
            top_p=bool(nucleus),
            nucleus_in_top_k=bool(nucleus) and all(nucleus),
        )


@dataclass(frozen=True)
class Choices:
    """A step's choices: each row's token, its logprob under the model, and (logprobs, ids)
    of the k most likely tokens when any row asked for k (None otherwise)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    candidates: tuple[torch.Tensor, torch.Tensor] | None


def choose(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor | None,
    cuts: Cuts,
    wanted: list[int],
) -> Choices:
    """Every row's next token and logprobs, a few rows per pass: argmax for `greedy` rows,
    else drawn by `draw` with its uniform (`uniforms` None: every row is greedy). `wanted`:
    each row's count of top-k logprobs (0: none)."""
    vocab = logits.shape[-1]
    k = min(max(wanted, default=0), vocab)
    tokens, chosen, values, ids = [], [], [], []
    for part in row_chunks(logits.shape[0], vocab):
        logprobs = torch.log_softmax(logits[part].float(), dim=-1)
        picked = logits[part].argmax(dim=-1)
        if uniforms is not None:
            drawn = draw(
                logprobs, temperature[part], top_k[part], top_p[part], uniforms[part], cuts
            )
            picked = torch.where(greedy[part], picked, drawn)
        tokens.append(picked)
        chosen.append(logprobs.gather(1, picked[:, None]).squeeze(1))
        if k:
            top = logprobs.topk(k, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
    candidates = (torch.cat(values), torch.cat(ids)) if k else None
    return Choices(torch.cat(tokens), torch.cat(chosen), candidates)


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    cuts: Cuts,
) -> torch.Tensor:
    """One token per row from softmax(logits / temperature) cut to its top_k (<= 0 or >= the
    vocabulary: none) and then its nucleus top_p, by inverse CDF in vocabulary order on its
    uniform (`step_uniforms`)."""
    masses = cut_masses(logits, temperature, top_k, top_p, cuts)
    cdf = masses.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]) >> UNIFORM_BITS  # < the row's total: a token with mass
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)


def cut_masses(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    cuts: Cuts,
) -> torch.Tensor:
    """Each row's token probabilities as int64 multiples of 2**-MASS_BITS, zero outside its
    top_k and nucleus."""
    scaled = logits.float() / temperature[:, None]
    masses = (torch.softmax(scaled, dim=-1) * (1 << MASS_BITS)).long()
    if not (cuts.top_k or cuts.top_p):
        return masses
    keys = order_keys(scaled)
    vocab = scaled.shape[-1]
    floor = torch.zeros_like(temperature, dtype=torch.long)
    candidates = None
    if cuts.top_k:
        # The k-th largest logit of each row that cuts, from its candidates (largest first).
        values, candidates = scaled.topk(cuts.top_k, dim=-1)
        kth = values.gather(1, (top_k.clamp(1, cuts.top_k) - 1)[:, None]).squeeze(1)
        floor = torch.where((top_k > 0) & (top_k < vocab), order_keys(kth), floor)
    if cuts.top_p:
        masses = masses * (keys >= floor[:, None])
        kept = masses.sum(dim=-1)
        # The nucleus reaches top_p of the mass top_k kept (ceil: at least that much).
        target = torch.ceil(top_p.double() * kept.double()).long().clamp(min=1)
        target = torch.minimum(target, kept)
        if candidates is not None and cuts.nucleus_in_top_k:
            floor = _nucleus_among(keys, masses, candidates, target, floor)
        else:
            floor = _threshold(keys, masses, target)
    return masses * (keys >= floor[:, None])


def order_keys(values: torch.Tensor) -> torch.Tensor:
    """float32 values as int64 keys in [0, 2**32) in the same order (negative floats' bits
    flipped below the sign, then offset)."""
    bits = values.contiguous().view(torch.int32)
    keys = torch.where(bits >= 0, bits, bits ^ 0x7FFF_FFFF)
    return keys.long() + (1 << 31)


def _threshold(keys: torch.Tensor, weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the largest key t with sum(weights[keys >= t]) >= target (target at most the
    row's total weight; non-negative int64 weights): a radix select, 8 bits a pass from the
    top, each pass a histogram of the candidates' next digit."""
    rows = keys.shape[0]
    prefix = torch.zeros(rows, dtype=torch.long, device=keys.device)
    above = torch.zeros_like(prefix)  # weight of keys above the candidates (their high bits)
    high = None  # the keys' bits above this pass's digit (the last pass's shifted keys)
    for shift in (24, 16, 8, 0):
        shifted = keys >> shift
        digits = shifted & 0xFF
        candidate = weights if high is None else weights * (high == prefix[:, None])
        high = shifted
        histogram = torch.zeros((rows, 256), dtype=torch.long, device=keys.device)
        histogram.scatter_add_(1, digits, candidate)
        # Weight at or above each digit; non-increasing in the digit, so the digits that still
        # reach the target are 0..d, and d is the one.
        at_or_above = histogram.flip(1).cumsum(dim=1).flip(1) + above[:, None]
        digit = (at_or_above >= target[:, None]).sum(dim=1, keepdim=True) - 1
        above = (at_or_above.gather(1, digit) - histogram.gather(1, digit)).squeeze(1)
        prefix = (prefix << 8) | digit.squeeze(1)
    return prefix


def _nucleus_among(
    keys: torch.Tensor,
    masses: torch.Tensor,
    candidates: torch.Tensor,
    target: torch.Tensor,
    floor: torch.Tensor,
) -> torch.Tensor:
    """`_threshold`'s answer when every row's kept tokens are among its candidates (largest
    first) but for ties at its floor: the key of the first candidate whose running mass
    reaches the target (tied tokens have equal masses, so their order does not matter), else
    the floor itself (the ties past the candidates hold the rest)."""
    running = masses.gather(1, candidates).cumsum(dim=1)
    first = (running < target[:, None]).sum(dim=1, keepdim=True)
    reached = first.squeeze(1) < candidates.shape[1]
    at = keys.gather(1, candidates.gather(1, first.clamp(max=candidates.shape[1] - 1)))
    return torch.where(reached, at.squeeze(1), floor)


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
    """Slices of `rows` rows, each at most CHOICE_CHUNK_ELEMENTS of logits."""
    size = max(1, CHOICE_CHUNK_ELEMENTS // vocab)
    return [slice(start, min(rows, start + size)) for start in range(0, rows, size)]
