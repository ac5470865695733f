"""Per-datum loss functions over per-token tensors, as in Tinker. Knows no Redis and no SQL.

Every loss takes one datum's `logprobs` (T,) — the model's log-probability of each target token,
with grad — its `inputs` (1-D tensors of length T, validated elsewhere) and the loss `config` (with
defaults filled in), and returns a scalar: a sum over the datum's tokens. Below, q is
inputs["logprobs"] (the sampling policy's logprobs), A is inputs["advantages"] (zeros when
absent), w is inputs["weights"] (ones when absent: a per-token mask or scale on every loss) and
ratio = exp(logp - q). The formulas, with their sources, are in docs/losses.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from queue_tinker.workers.training.custom_loss_graph import GraphLoss, graph_batch_loss

BuiltInLoss = Callable[
    [torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor
]

# stable_reinforce truncates its importance weight here (truncated importance sampling, whose
# customary cap is 2: Yao et al., 2025, "Your efficient RL framework secretly brings you
# off-policy RL training").
STABLE_REINFORCE_TRUNCATION = 2.0


def _ratio(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(logprobs - inputs["logprobs"])


def _advantages(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    advantages = inputs.get("advantages")
    return torch.zeros_like(logprobs.detach()) if advantages is None else advantages


def _weighted_sum(terms: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    weights = inputs.get("weights")
    return terms.sum() if weights is None else (weights * terms).sum()


def _clip_range(config: Mapping[str, float]) -> tuple[float, float]:
    return float(config["clip_low_threshold"]), float(config["clip_high_threshold"])


def _pessimistic(
    ratio: torch.Tensor, advantages: torch.Tensor, config: Mapping[str, float]
) -> torch.Tensor:
    """Per token -min(ratio·A, clip(ratio, lo, hi)·A): PPO's clipped surrogate, negated."""
    lo, hi = _clip_range(config)
    return -torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages)


def cross_entropy(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """-Σ w·logp. Negative weights are allowed."""
    return _weighted_sum(-logprobs, inputs)


def importance_sampling(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """-Σ w·ratio·A."""
    return _weighted_sum(-_ratio(logprobs, inputs) * _advantages(logprobs, inputs), inputs)


def ppo(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """-Σ w·min(ratio·A, clip(ratio, lo, hi)·A); lo, hi = clip_low/high_threshold."""
    terms = _pessimistic(_ratio(logprobs, inputs), _advantages(logprobs, inputs), config)
    return _weighted_sum(terms, inputs)


def cispo(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """-Σ w·stopgrad(clip(ratio, lo, hi))·A·logp; lo, hi = clip_low/high_threshold."""
    lo, hi = _clip_range(config)
    weight = _ratio(logprobs, inputs).clamp(lo, hi).detach()
    return _weighted_sum(-weight * _advantages(logprobs, inputs) * logprobs, inputs)


def dro(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """-Σ w·(A·logp - (beta/2)·(logp - q)²); beta = config["beta"]."""
    penalty = 0.5 * float(config["beta"]) * (logprobs - inputs["logprobs"]).square()
    return _weighted_sum(-(_advantages(logprobs, inputs) * logprobs - penalty), inputs)


@dataclass(frozen=True)
class Sequences:
    """Where each token of several datums' joined tokens sits: what gspo, whose terms carry
    their sequence's ratio, needs to take them all at once."""

    index: torch.Tensor  # (tokens,) int64, on the tokens' device: each token's datum
    position: torch.Tensor  # (tokens,) int64: its place in its datum
    count: int  # datums
    width: int  # the longest datum's tokens

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device) -> Sequences:
        """Datums of these lengths, datum after datum (laid out on the host, one copy)."""
        sizes = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(sizes) - sizes
        index = np.repeat(np.arange(len(sizes)), sizes)
        position = np.arange(int(sizes.sum())) - np.repeat(starts, sizes)
        both = torch.from_numpy(np.stack([index, position])).to(device)
        return cls(both[0], both[1], len(sizes), int(sizes.max(initial=0)))

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """(count,): each datum's sum of `values`, added in a fixed order on any device (every
        token gets a slot of its own; no atomic adds)."""
        laid_out = values.new_zeros(self.count, self.width)
        laid_out[self.index, self.position] = values
        return laid_out.sum(1)


def sequence_log_ratio(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], sequences: Sequences | None = None
) -> torch.Tensor:
    """GSPO's sequence log-ratio (no grad) at each token: the mean of logp - q over the tokens
    of its sequence that sequence_ratio_mask marks (every token when it is absent). Without
    `sequences` the tokens are one sequence, and the result one 0-d value. Masked by
    selection, not by indexing: no device read for the marked count."""
    log_ratio = logprobs.detach() - inputs["logprobs"]
    mask = inputs.get("sequence_ratio_mask")
    selected = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else mask != 0
    kept = torch.where(selected, log_ratio, 0.0)
    marked = selected.to(log_ratio.dtype)
    if sequences is None:
        return kept.sum() / marked.sum()
    means = sequences.sums(kept) / sequences.sums(marked)
    return means.index_select(0, sequences.index)


def gspo_token_ratio(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], sequences: Sequences | None = None
) -> torch.Tensor:
    """Each token carries its sequence ratio's value and the gradient of its own logp."""
    log_ratio = sequence_log_ratio(logprobs, inputs, sequences)
    return torch.exp(log_ratio + logprobs - logprobs.detach())


def gspo(
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    sequences: Sequences | None = None,
) -> torch.Tensor:
    """GSPO-token: ppo's clipped surrogate with every token's ratio replaced by the sequence
    ratio s = exp(mean over sequence_ratio_mask of (logp - q)), carrying the token's own grad."""
    ratio = gspo_token_ratio(logprobs, inputs, sequences)
    terms = _pessimistic(ratio, _advantages(logprobs, inputs), config)
    return _weighted_sum(terms, inputs)


def stable_reinforce(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """-Σ w·stopgrad(min(ratio, 2))·A·logp: REINFORCE with a truncated importance weight."""
    weight = _ratio(logprobs, inputs).clamp(max=STABLE_REINFORCE_TRUNCATION).detach()
    return _weighted_sum(-weight * _advantages(logprobs, inputs) * logprobs, inputs)


LOSSES: dict[str, BuiltInLoss] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
_CLIPPED = frozenset({"ppo", "cispo", "gspo"})  # losses that report clip_fraction:mean


def _loss_fn(loss_fn: str) -> BuiltInLoss:
    try:
        return LOSSES[loss_fn]
    except KeyError:
        known = ", ".join(sorted(LOSSES))
        raise ValueError(f"unknown loss_fn {loss_fn!r} (known: {known})") from None


def datum_loss(
    loss_fn: str,
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
) -> torch.Tensor:
    """Scalar loss of one datum (a sum over its tokens). Raise ValueError for an unknown loss_fn."""
    return _loss_fn(loss_fn)(logprobs, inputs, config)


def _token_ratio(
    loss_fn: str,
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    sequences: Sequences | None = None,
) -> torch.Tensor:
    """The ratio each token's term uses (gspo: its sequence's ratio)."""
    if loss_fn == "gspo":
        return gspo_token_ratio(logprobs, inputs, sequences)
    return _ratio(logprobs, inputs)


def _ratio_metrics(
    loss_fn: str,
    logprobs: Sequence[torch.Tensor],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    config: Mapping[str, float],
    sequences: Sequences | None = None,
) -> dict[str, torch.Tensor]:
    """Token means over the batch of the ratio (and, for clipped losses, of the clip fraction),
    as 0-d tensors. Empty when the loss has no ratio or the batch has no tokens. `sequences`:
    the datums of a batch of one joined tensor."""
    if loss_fn == "cross_entropy" or sum(lp.numel() for lp in logprobs) == 0:
        return {}
    with torch.no_grad():
        ratio = torch.cat(
            [
                _token_ratio(loss_fn, lp, d, sequences)
                for lp, d in zip(logprobs, inputs, strict=True)
            ]
        )
        metrics = {"ratio:mean": ratio.mean()}
        if loss_fn in _CLIPPED:
            lo, hi = _clip_range(config)
            outside = (ratio < lo) | (ratio > hi)
            metrics["clip_fraction:mean"] = outside.float().mean()
    return metrics


# A metric as a loss reports it: a 0-d tensor still on the loss's device (read with the
# others once the pass is done: shared_pass._read), or a number already read.
Metric = torch.Tensor | float


def device_batch_loss(
    loss_fn: str | GraphLoss,
    logprobs: Sequence[torch.Tensor],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    config: Mapping[str, float],
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Sum of datum losses over the batch and metrics keyed 'name:reduction', left on the
    device: nothing here waits for it, so a pass can launch its backward before any of its
    numbers are read. Always includes 'loss:sum'. A GraphLoss is a loss uploaded with
    create_custom_loss."""
    if isinstance(loss_fn, GraphLoss):
        total, graph_metrics = graph_batch_loss(loss_fn, logprobs, inputs)
        return total, dict(graph_metrics)
    fn = _loss_fn(loss_fn)
    if len(logprobs) != len(inputs):
        raise ValueError(f"{len(logprobs)} logprobs tensors for {len(inputs)} data")
    losses = [fn(lp, d, config) for lp, d in zip(logprobs, inputs, strict=True)]
    total = torch.stack(losses).sum() if losses else torch.zeros(())
    metrics: dict[str, Metric] = {"loss:sum": total.detach()}
    metrics.update(_ratio_metrics(loss_fn, logprobs, inputs, config))
    return total, metrics


def joined_batch_loss(
    loss_fn: str,
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    sequences: Sequences,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """device_batch_loss of a built-in loss from its datums' logprobs and inputs joined (datum
    after datum; `sequences` says which datum each token is from): over all their tokens at
    once, a few kernels however many datums the batch has, where datum by datum launches a
    few per datum. Every loss but gspo is a sum of per-token terms; gspo's ratio is taken per
    sequence."""
    if loss_fn == "gspo":
        total = gspo(logprobs, inputs, config, sequences)
    else:
        total = _loss_fn(loss_fn)(logprobs, inputs, config)
    metrics: dict[str, Metric] = {"loss:sum": total.detach()}
    metrics.update(_ratio_metrics(loss_fn, [logprobs], [inputs], config, sequences))
    return total, metrics


def batch_loss(
    loss_fn: str | GraphLoss,
    logprobs: Sequence[torch.Tensor],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    config: Mapping[str, float],
) -> tuple[torch.Tensor, dict[str, float]]:
    """device_batch_loss with its metrics read (one at a time: for callers outside a pass)."""
    total, metrics = device_batch_loss(loss_fn, logprobs, inputs, config)
    return total, {key: float(value) for key, value in metrics.items()}
