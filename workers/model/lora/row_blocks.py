"""Rows of one batch on different LoRA adapters: each block of consecutive rows (dim 0) gets its
own adapter's update in every LoRA layer, so all rows share the base model's matmuls. Training
passes (train_batch.py: a block per model's ops) and the decode loop (sampler.py: a block per
adapter of the rows in flight) use it.

PEFT's own mixed-adapter batch (`adapter_names=`) gathers and scatters rows by index per adapter
and layer, and registers and removes a forward hook on every LoRA module at every call: its
backward made a shared pass of 8 ops up to 2x slower than the 8 ops one at a time (tiny model,
CPU), and its hooks cost 1.4 ms per decode step at the tiny model and 5.6 ms at 100M (CPU).
Contiguous blocks need a slice of the input and an update per block and layer, joined and
added to the base output at once.

A mixture of experts' stacked weights, which PEFT adapts as parameters (`ParamWrapper`), run
their experts once per block with that block's adapter folded in (expert_lora.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import ParamWrapper

from queue_tinker.workers.model.lora.expert_lora import experts_forward, outermost_wrappers

# A layer row blocks give each block's update: a LoRA linear layer, or the outermost of a
# module's parameter wrappers (a mixture of experts' stacked weights).
LoraLayer = LoraLinear | ParamWrapper


def lora_layers_of(model: torch.nn.Module) -> list[LoraLayer]:
    """Every LoRA linear layer and experts' wrapper of the model (a traversal of every module:
    keep the list while no adapter comes or goes)."""
    linears: list[LoraLayer] = [m for m in model.modules() if isinstance(m, LoraLinear)]
    return linears + list(outermost_wrappers(model))


def blocks_of(parts: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """(adapter name, rows) of each run of consecutive parts on one adapter, from (adapter
    name, rows) parts in row order: a row each (the decode loop), an op's data each (a pass)."""
    blocks: list[tuple[str, int]] = []
    for name, rows in parts:
        if blocks and blocks[-1][0] == name:
            blocks[-1] = (name, blocks[-1][1] + rows)
        else:
            blocks.append((name, rows))
    return blocks


def grouped_order(names: Sequence[str]) -> list[int]:
    """Row indices in an order that puts each adapter's rows together (adapters in order of
    first appearance; rows of one adapter keep their order): one block per adapter."""
    rank: dict[str, int] = {}
    for name in names:
        rank.setdefault(name, len(rank))
    return sorted(range(len(names)), key=lambda row: rank[names[row]])


@contextmanager
def forwards_replaced(
    forwards: Iterable[tuple[torch.nn.Module, Callable[..., torch.Tensor]]],
) -> Iterator[None]:
    """Meanwhile each module's forward is the one paired with it (an instance attribute:
    nn.Module calls self.forward), its class's own again after."""
    replaced = []
    for module, forward in forwards:
        module.forward = forward
        replaced.append(module)
    try:
        yield
    finally:
        for module in replaced:
            del module.forward


@contextmanager
def row_blocks(
    layers: Sequence[LoraLayer],
    blocks: Sequence[tuple[str, int]],
    compute: torch.dtype | None = None,
) -> Iterator[None]:
    """Meanwhile each LoRA layer computes its base layer plus, for each block of consecutive
    rows (dim 0), that block's adapter's update, as PEFT adds the active adapter's:
    lora_B(lora_A(dropout(x))) * scaling, in the adapter's dtype (or in `compute`, see
    `_update`), added in the wider dtype and rounded once. A block whose adapter does not adapt
    a layer (or no adapter at all: the base model's rows) gets the base layer's output there.
    Experts' wrappers: see expert_lora.py."""
    with forwards_replaced(
        (layer, partial(experts_forward, layer, blocks))
        if isinstance(layer, ParamWrapper)
        else (layer, partial(blocks_forward, layer, blocks, compute))
        for layer in layers
    ):
        yield


def blocks_forward(
    layer: LoraLinear,
    blocks: Sequence[tuple[str, int]],
    compute: torch.dtype | None,
    x: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """A LoRA linear's forward in row blocks (row_blocks)."""
    names = [name for name, _ in blocks]
    sizes = [rows for _, rows in blocks]
    result = layer.base_layer(x, *args, **kwargs)
    if len(names) == 1 and names[0] in layer.lora_A:
        # One block, every row: PEFT's own sum. An in-place add into a view of the output
        # puts a CopySlices node in the graph, whose backward cost 2 ms a step on the tiny
        # model (8 x 128 tokens, 15 LoRA layers) for nothing the whole batch needs.
        return (result + _update(layer, names[0], x, compute)).to(result.dtype)
    if not any(name in layer.lora_A for name in names):
        return result
    # Each block's update (zeros where its adapter does not adapt this layer), joined and
    # added at once: an in-place add into each block's slice of the output would put a
    # CopySlices node per block in the graph, whose backward copies the whole output's
    # gradient (a pass of 8 adapters' ops was 3-5% slower so on the CPU). The input is
    # split, not narrowed block by block: a narrow's backward writes its block's gradient
    # into a zeroed copy of the whole input, one per block (at the 8B shape 8 adapters'
    # 4 x 512-token ops moved 359 GiB so, bench.mfu --count); a split's joins them once.
    parts = x.split(sizes)
    updates = [
        _update(layer, name, part, compute)
        if name in layer.lora_A
        else result.new_zeros((rows, *result.shape[1:]))
        for name, part, rows in zip(names, parts, sizes, strict=True)
    ]
    return (result + torch.cat(updates)).to(result.dtype)


def plain_lora(layer: LoraLayer, names: Iterable[str] | None = None) -> bool:
    """Whether the layer is a LoRA linear whose adapters `names` (those it has; None: all)
    are plain lora_B(lora_A(x)) * scaling, which a stacked form can stand for: no experts'
    wrapper, no DoRA, no LoRA bias."""
    if type(layer) is not LoraLinear or any(getattr(layer, "use_dora", {}).values()):
        return False
    held = set(layer.lora_A)
    return all(
        getattr(layer.lora_A[name], "bias", None) is None
        and getattr(layer.lora_B[name], "bias", None) is None
        for name in (held if names is None else held & set(names))
    )


def stacks(layers: Sequence[LoraLayer], blocks: Sequence[tuple[str, int]]) -> bool:
    """Whether `stacked_blocks` can stand in for `row_blocks` here: several blocks, every layer
    plain for their adapters (plain_lora), without dropout (one input feeds every adapter's A
    at once)."""
    if len(blocks) < 2:
        return False
    names = {name for name, _ in blocks}
    return all(
        plain_lora(layer, names)
        and all(
            isinstance(layer.lora_dropout[name], torch.nn.Identity)
            for name in names & set(layer.lora_A)
        )
        for layer in layers
    )


@contextmanager
def stacked_blocks(
    layers: Sequence[LoraLayer],
    blocks: Sequence[tuple[str, int]],
    compute: torch.dtype | None = None,
) -> Iterator[None]:
    """`row_blocks` in another form (where `stacks`): in each LoRA layer the blocks' adapters'
    A stacked into one matrix and their B (scaling folded in) into another, each row keeping
    its own adapter's columns of the low-rank product: two matmuls a layer however many
    adapters share the pass, where row_blocks runs two a block (and their backward), launched
    from Python. The stacks are made from the adapters' weights at every call (torch.cat,
    through which their gradients flow), and the product computes every adapter's columns for
    every row: cheaper than launches where a kernel costs microseconds to start (a GPU),
    dearer where it does not (a CPU: row_blocks measured faster there)."""
    names = [name for name, _ in blocks]
    owner = torch.tensor([i for i, (_, rows) in enumerate(blocks) for _ in range(rows)])
    masks: dict[tuple[tuple[str, int], ...], torch.Tensor] = {}

    def column_mask(columns: tuple[tuple[str, int], ...], like: torch.Tensor) -> torch.Tensor:
        """(rows, stacked rank): 1 where the column is the row's own adapter's."""
        if columns not in masks:
            column_owner = torch.tensor(
                [names.index(name) for name, rank in columns for _ in range(rank)]
            )
            masks[columns] = (owner[:, None] == column_owner[None, :]).to(like.device, like.dtype)
        return masks[columns]

    def forward(layer: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = layer.base_layer(x, *args, **kwargs)
        present = [name for name in dict.fromkeys(names) if name in layer.lora_A]
        if not present:
            return result
        own: torch.dtype = layer.lora_A[present[0]].weight.dtype  # type: ignore[assignment]
        dtype = compute or own
        a = torch.cat([_weight(layer.lora_A[name], dtype) for name in present])
        b = torch.cat(
            [_weight(layer.lora_B[name], dtype) * layer.scaling[name] for name in present], dim=1
        )
        low_rank = F.linear(x.to(dtype), a)
        mask = column_mask(tuple((name, layer.r[name]) for name in present), low_rank)
        update = F.linear(low_rank * mask.view(mask.shape[0], *([1] * (x.dim() - 2)), -1), b)
        return (result + update).to(result.dtype)

    linears = [layer for layer in layers if isinstance(layer, LoraLinear)]  # stacks(): all
    with forwards_replaced((linear, partial(forward, linear)) for linear in linears):
        yield


def _update(
    layer: LoraLinear, name: str, x: torch.Tensor, compute: torch.dtype | None
) -> torch.Tensor:
    """The adapter's LoRA update of rows `x`, in the adapter's dtype, or in `compute` (the
    base's bf16 on CUDA: QT_LORA_MATMUL_DTYPE). In `compute` the adapter's weights are cast per
    call and their gradients reach them in their own dtype, while `x` stays as it came: its
    backward keeps the tensor the base layer keeps anyway rather than an fp32 copy, and the
    matmuls run at the base's speed."""
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    own: torch.dtype = lora_a.weight.dtype  # type: ignore[assignment]
    dtype = compute or own
    dropped = layer.lora_dropout[name](x.to(dtype))
    if dtype == own:
        return lora_b(lora_a(dropped)) * layer.scaling[name]
    low_rank = F.linear(dropped, _weight(lora_a, dtype), _bias(lora_a, dtype))
    return F.linear(low_rank, _weight(lora_b, dtype), _bias(lora_b, dtype)) * layer.scaling[name]


def _weight(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    weight: torch.Tensor = linear.weight  # type: ignore[assignment]
    return weight.to(dtype)


def _bias(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    bias = getattr(linear, "bias", None)
    return None if bias is None else bias.to(dtype)
