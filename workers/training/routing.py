"""Mixture-of-experts routing metrics of a training pass, as Tinker reports them with
forward_backward on an MoE model (the SDK's ForwardBackwardOutput.metrics documents them):

- `e_frac_with_tokens:mean`: the fraction of experts that received at least one token;
- `e_frac_oversubscribed:mean`: the fraction receiving more than perfect balance;
- `e_max_violation:mean` / `:max`: (the busiest expert's tokens - perfect balance) / perfect
  balance;
- `e_min_violation:mean`: the same for the least loaded expert (0 or below);

each per MoE layer, then averaged (or the max) over layers. Perfect balance is the tokens
routed over the experts: an op's real tokens times the experts a token goes to (top-k), over
the number of experts. Each op counts its own datums' tokens only (no padding, no other op's
rows), so ops that share a pass report what they would alone.

The experts chosen are read from each router's output by a forward hook, during the pass's
forward only (a checkpointed layer's recomputation in backward is not counted twice).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import torch

Span = tuple[int, int, int]  # a datum's (row, first position, tokens) in the pass's batch


# Each model's routers, found once: a walk of every module cost 0.5 ms a pass on the tiny
# model (186 modules) and grows with the model. Adapters wrap linear layers, never routers, so
# the routers of a model object do not change.
_ROUTERS: WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = WeakKeyDictionary()


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers: modules that pick `top_k` of `num_experts` experts a token
    (transformers' `*TopKRouter`s: Qwen3-MoE, gpt-oss, ...)."""
    found = _ROUTERS.get(model)
    if found is None:
        found = _ROUTERS[model] = [
            module
            for module in model.modules()
            if type(module).__name__.endswith("Router")
            and isinstance(getattr(module, "top_k", None), int)
            and isinstance(getattr(module, "num_experts", None), int)
        ]
    return found


@dataclass
class Routing:
    """What a pass's routers chose: per call, (tokens, top_k) expert ids, in layer order; and
    how many experts they pick from (0: not a mixture-of-experts model)."""

    chosen: list[torch.Tensor] = field(default_factory=list)
    experts: int = 0


@contextmanager
def recorded_routing(model: torch.nn.Module) -> Iterator[Routing]:
    """While open, each router's chosen experts (one walk of the model finds the routers)."""
    found = routers(model)
    routing = Routing(experts=int(getattr(found[0], "num_experts", 0)) if found else 0)

    def record(_: torch.nn.Module, __: object, output: object) -> None:
        indices = output[-1] if isinstance(output, tuple) else None
        if isinstance(indices, torch.Tensor) and not indices.is_floating_point():
            routing.chosen.append(indices.detach())

    handles = [router.register_forward_hook(record) for router in found]
    try:
        yield routing
    finally:
        for handle in handles:
            handle.remove()


def routing_metrics(
    chosen: Sequence[torch.Tensor], rows: int, width: int, spans: Sequence[Span], experts: int
) -> dict[str, float]:
    """The metrics of the tokens at `spans`, from each layer's (rows * width, top_k) chosen
    experts; empty when nothing was routed."""
    if not chosen or not spans or experts <= 0:
        return {}
    per_layer: list[tuple[float, float, float, float]] = []
    for layer in chosen:
        by_position = layer.reshape(rows, width, -1)
        picked = torch.cat([by_position[row, start : start + n] for row, start, n in spans])
        counts = torch.bincount(picked.flatten(), minlength=experts).double()
        balance = picked.numel() / experts
        per_layer.append(
            (
                float((counts > 0).double().mean()),
                float((counts > balance).double().mean()),
                float((counts.max() - balance) / balance),
                float((counts.min() - balance) / balance),
            )
        )
    with_tokens, oversubscribed, max_violation, min_violation = zip(*per_layer, strict=True)
    return {
        "e_frac_with_tokens:mean": _mean(with_tokens),
        "e_frac_oversubscribed:mean": _mean(oversubscribed),
        "e_max_violation:mean": _mean(max_violation),
        "e_max_violation:max": max(max_violation),
        "e_min_violation:mean": _mean(min_violation),
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
