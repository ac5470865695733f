"""Kernels a step launches and the bytes they move, counted without a GPU: the step runs on
meta tensors (no memory, no data) under a dispatch mode that sees every aten op.

What counts: an aten op that launches work counts 1 and the bytes of its tensor inputs and
outputs; a view (or a detach, an alias) and an allocation (empty) count 0. Attention counts as
the fused kernels a GPU runs, one for the forward and one for the backward, over the bytes of
q, k, v and the output (SDPA has no meta kernel of its own: it is run as its math here,
uncounted). A read of a device value on the host (`.item()`, a copy to the CPU) counts 1 as
well, and, having no data, answers true for a flag and 0 (zeros) for a number: the branch a
batch with no padding takes (transformers asks whether the attention mask is all ones).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that move no data though torch does not mark them as views; and allocations, which
# launch nothing (the caching allocator hands out memory; a zeros is empty + fill_, one kernel).
FREE = frozenset({
    "detach", "_unsafe_view", "alias", "lift_fresh", "_reshape_alias",
    "empty", "empty_strided", "new_empty", "new_empty_strided",
})  # fmt: skip
HOST_READS = frozenset({"_local_scalar_dense", "is_nonzero", "item"})
# Matrix products: 2 x the reduction x each output element; the operand whose last dimension
# is the reduction.
GEMMS = {"mm": 0, "bmm": 0, "_grouped_mm": 0, "addmm": 1, "baddbmm": 1}
ATTENTION = "scaled_dot_product_attention"
_sdpa: Callable[..., torch.Tensor] = F.scaled_dot_product_attention  # called with *qkv


@dataclass
class Counts:
    """What a step launched: kernels by op name, the host reads among them, bytes, and the
    FLOPs of its matrix products (attention's aside)."""

    kernels: Counter[str] = field(default_factory=Counter)
    host_reads: int = 0
    bytes_moved: int = 0
    gemm_flops: int = 0
    bytes_by_op: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.kernels.values())


# An op's bytes where its arguments overstate them: a gather of rows from a table (the
# embedding), a kernel that reads a cache only where rows have filled it (the decode step's
# attention), a pool of adapters of which it reads only the rows' own. From the op's arguments
# and what the caller knows on the host.
Moved = Mapping[str, Callable[[tuple[Any, ...], Any], int]]


class _Counting(TorchDispatchMode):
    def __init__(self, counts: Counts, moved: Moved) -> None:
        super().__init__()
        self.counts = counts
        self.moved = moved
        self.paused = 0

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self._count(name, 0, host=True)
            # No data: a flag reads true ("the mask is all ones"), a number 0.
            return args[0].dtype == torch.bool if args else 0
        to_host = _copies_to_host(name, args, kwargs)
        if to_host is not None:
            self._count(name, _bytes(args), host=True)
            return to_host
        out = func(*args, **kwargs)
        if not (func.is_view or name in FREE):
            rule = self.moved.get(name)
            self._count(name, rule(args, out) if rule else _bytes(args) + _bytes(out))
            if name in GEMMS and not self.paused:
                reduced = args[GEMMS[name]].shape[-1]
                self.counts.gemm_flops += 2 * reduced * out.numel()
        return out

    def _count(self, name: str, moved: int, host: bool = False) -> None:
        if self.paused:
            return
        self.counts.kernels[name] += 1
        self.counts.bytes_moved += moved
        self.counts.bytes_by_op[name] += moved
        self.counts.host_reads += int(host)


class _FusedAttention(TorchFunctionMode):
    """F.scaled_dot_product_attention as one kernel each way (_Attention), where a caller
    holds the function from before the count (_fused_sdpa replaces it for the others)."""

    def __init__(self, counting: _Counting) -> None:
        super().__init__()
        self.counting = counting

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _Attention.apply(self.counting, kwargs, *args)
        if func is torch.Tensor.tolist and args[0].device.type == "meta":
            # A read of a whole tensor on the host (the decode step's tokens): one read, zeros.
            self.counting._count("tolist", _bytes(args), host=True)
            return torch.zeros(args[0].shape, dtype=args[0].dtype).tolist()
        return func(*args, **kwargs)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, counting: _Counting, kwargs: dict[str, Any], *qkv: torch.Tensor
    ) -> torch.Tensor:
        ctx.counting, ctx.kwargs = counting, kwargs
        ctx.save_for_backward(*qkv)
        with _paused(counting), torch.enable_grad():
            out = _sdpa(*qkv, **kwargs)
        counting._count(ATTENTION, _bytes(qkv) + _bytes(out))
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        qkv = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in qkv]
        with _paused(ctx.counting), torch.enable_grad():
            out = _sdpa(*leaves, **ctx.kwargs)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        ctx.counting._count(f"{ATTENTION}_backward", 2 * _bytes(qkv) + _bytes(grad))
        return (None, None, *(next(grads) if t.requires_grad else None for t in leaves))


@contextmanager
def _paused(counting: _Counting) -> Iterator[None]:
    counting.paused += 1
    try:
        yield
    finally:
        counting.paused -= 1


def count_kernels(step: Callable[[], object], moved: Moved | None = None) -> Counts:
    """The kernels and bytes of `step` (its tensors on the meta device); `moved` an op's
    bytes by name, where its arguments' and outputs' would overstate them."""
    counts = Counts()
    counting = _Counting(counts, moved or {})
    with counting, _FusedAttention(counting), _fused_sdpa(counting):
        step()
    return counts


@contextmanager
def _fused_sdpa(counting: _Counting) -> Iterator[None]:
    """F.scaled_dot_product_attention as one kernel each way (_Attention) meanwhile, in place
    of the function itself: a checkpointed layer's recomputation in backward runs outside
    the function mode (_FusedAttention), but looks the function up as its forward did."""

    def fused(*qkv: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return cast(torch.Tensor, _Attention.apply(counting, kwargs, *qkv))

    # setattr: torch types the attribute as its builtin's exact signature.
    setattr(F, "scaled_dot_product_attention", fused)  # noqa: B010
    try:
        yield
    finally:
        setattr(F, "scaled_dot_product_attention", _sdpa)  # noqa: B010


def _copies_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Zeros on the CPU for a copy of a meta tensor there (it has no data); else None."""
    if name != "_to_copy" or not args or not isinstance(args[0], torch.Tensor):
        return None
    source, device = args[0], kwargs.get("device")
    if source.device.type != "meta" or device is None or torch.device(device).type == "meta":
        return None
    return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype, device=device)


def _bytes(value: Any) -> int:
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
