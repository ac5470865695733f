"""LoRA on a mixture of experts' stacked weights, per block of rows.

transformers 5 keeps a sparse layer's experts in 3-D parameters (Qwen3-MoE: `gate_up_proj`
(experts, 2 x width, hidden) and `down_proj` (experts, hidden, width)), not in linear layers.
PEFT adapts them through `target_parameters`: a `ParamWrapper` per parameter (nested when a
module has two) holds each adapter's A (rank x experts, in) and B (out, rank x experts), a
rank-`rank` update per expert, and its own forward folds the *active* adapter's update into the
weight for the whole batch. A pass whose rows belong to several adapters needs each block's own
update instead, so here the experts module runs once per block of rows with that block's
adapter folded in (torch.func.functional_call with the folded weights in place of the
parameters): every block gets W + scaling * B_e A_e for each expert e, as PEFT computes it
for one adapter (the same baddbmm, so a block alone equals PEFT's own forward to the bit).

The experts module sees tokens, not rows: the sparse block flattens (rows, positions, hidden)
to (rows x positions, hidden) before routing, so a block of rows is a run of rows x positions
tokens, and every per-token argument (the routing indices and weights) is cut the same way.

Cost: a fold makes a copy of the layer's expert weights per block (and keeps it for backward),
where a LoRA linear layer adds a low-rank product of the activations. It is what PEFT does too;
at the tiny model it is nothing, at Qwen3-30B-A3B it is 1.2 GiB a layer in bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from peft.tuners.lora import ParamWrapper
from torch.func import functional_call


def outermost_wrappers(model: torch.nn.Module) -> list[ParamWrapper]:
    """The model's parameter-LoRA wrappers that no other one wraps: one per experts module."""
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    inner = {id(w.base_layer) for w in wrappers}
    return [w for w in wrappers if id(w) not in inner]


def chain_of(wrapper: ParamWrapper) -> tuple[list[ParamWrapper], torch.nn.Module]:
    """The nested wrappers from `wrapper` inwards, and the experts module they wrap."""
    chain: list[ParamWrapper] = []
    module: torch.nn.Module = wrapper
    while isinstance(module, ParamWrapper):
        chain.append(module)
        module = module.base_layer
    return chain, module


def folded_weight(wrapper: ParamWrapper, name: str) -> torch.Tensor:
    """The wrapped parameter plus adapter `name`'s update of every expert, folded in the
    adapter's dtype (fp32) and rounded once to the parameter's."""
    param: torch.Tensor = wrapper.get_param()
    lora_a: torch.Tensor = wrapper.lora_A[name].weight  # type: ignore[assignment]
    lora_b: torch.Tensor = wrapper.lora_B[name].weight  # type: ignore[assignment]
    experts = int(wrapper.num_experts)
    a = lora_a.reshape(experts, -1, lora_a.shape[-1])  # (experts, rank, in)
    b = lora_b.reshape(lora_b.shape[0], -1, experts).permute(2, 0, 1)  # (experts, out, rank)
    if wrapper._did_swap_in_out_features:  # stored (experts, out, in), as Qwen3-MoE's
        lhs, rhs = b, a
    else:  # stored (experts, in, out)
        lhs, rhs = a.transpose(-2, -1), b.transpose(-2, -1)
    scaling = float(wrapper.scaling[name])
    folded = torch.baddbmm(param.to(lora_a.dtype), lhs, rhs, alpha=scaling)
    return folded.to(param.dtype)


def experts_forward(
    wrapper: ParamWrapper,
    blocks: Sequence[tuple[str, int]],
    x: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """The experts module of `wrapper` over tokens `x`, each block of (adapter name, rows)
    with its adapter's update (none where the adapter adapts no expert)."""
    chain, experts = chain_of(wrapper)
    rows = sum(size for _, size in blocks)
    per_row, rest = divmod(x.shape[0], rows)
    if rest:
        raise RuntimeError(
            f"experts got {x.shape[0]} tokens, not a whole number per row of {rows} rows"
        )
    if len(blocks) == 1:
        return _run(chain, experts, blocks[0][0], x, args, kwargs)
    tokens = x.shape[0]
    outputs = []
    start = 0
    for name, size in blocks:
        begin, length = start * per_row, size * per_row
        start += size

        def cut(value: Any, begin: int = begin, length: int = length) -> Any:
            per_token = isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == tokens
            return value.narrow(0, begin, length) if per_token else value

        outputs.append(
            _run(
                chain,
                experts,
                name,
                cut(x),
                tuple(cut(a) for a in args),
                {k: cut(v) for k, v in kwargs.items()},
            )
        )
    return torch.cat(outputs)


def _run(
    chain: list[ParamWrapper],
    experts: torch.nn.Module,
    name: str,
    x: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    weights = {w.parameter_name: folded_weight(w, name) for w in chain if name in w.lora_A}
    if not weights:
        return experts(x, *args, **kwargs)
    out: torch.Tensor = functional_call(experts, weights, (x, *args), kwargs, strict=False)
    return out
