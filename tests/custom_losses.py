"""Custom losses as users write them (traced by the official SDK, run on the worker), shared by
the engine-level custom-loss tests and the SDK protocol tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def dpo(logprobs: Any, ref_logprobs: Any, chosen: Any, rejected: Any) -> Any:
    """DPO-style: -log sigmoid(beta * (chosen margin - rejected margin)) over one datum that
    holds both completions, masked."""
    beta = 0.1
    diff = logprobs - ref_logprobs
    margin = (diff * chosen).sum() - (diff * rejected).sum()
    return -F.logsigmoid(beta * margin), {"custom/margin:mean": margin.detach()}


def clipped_policy(logprobs: Any, old_logprobs: Any, advantages: Any) -> Any:
    """PPO's clipped surrogate, with its clip fraction as a metric."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    fraction = ((ratio < 0.8) | (ratio > 1.2)).float().mean()
    return loss, {"custom/clip_fraction:mean": fraction}


def weighted_nll(logprobs: Any, weights: Any) -> Any:
    """Per-token weighted NLL, normalised by the datum's length (read from its shape)."""
    loss = -(weights * logprobs).sum() / logprobs.shape[0]
    return loss, {"custom/weight:sum": weights.sum()}


LOSSES: dict[str, tuple[Callable[..., Any], list[str]]] = {
    "dpo": (dpo, ["ref_logprobs", "chosen", "rejected"]),
    "clipped_policy": (clipped_policy, ["old_logprobs", "advantages"]),
    "weighted_nll": (weighted_nll, ["weights"]),
}
