"""One matmul for rows grouped by weight: rows `ends[g-1]:ends[g]` of `x` (T, K) times group g's
matrix of `w` (G, N, K), transposed, into (T, N): many LoRA adapters' A (or B) in one kernel
whatever their number, forward and backward, where a loop would launch one matmul per adapter
(the pass of 8 adapters' ops: 8x the kernels of one, bench.mfu --count).

Two implementations of the same product, with autograd:
- torch's `_grouped_mm`, where torch has a kernel for the device and dtype: the CPU (any float
  dtype) and CUDA from sm_90 on in bf16 (cuBLAS / CUTLASS grouped GEMMs, as MoE layers use);
- a segment GEMM written here in Triton elsewhere on CUDA (fp32 adapters, cards before sm_90),
  and on the CPU under Triton's interpreter (TRITON_INTERPRET=1: how CI holds it to torch's).
  Its grid has a program per (group, block of rows, block of columns) over the longest group's
  rows, and a program past its group's end does nothing (Punica's SGMV, vLLM's lora_shrink /
  lora_expand), so the launch is one whatever the groups' sizes. Each kernel is a torch.library
  custom op with a fake implementation: it counts as one kernel on meta tensors.

Every row is in a group (the last group ends at the last row); an empty group's weight gradient
is zero. `ends` is int32 on x's device, cumulative (torch's `offs`): building it is the only copy
a pass makes for it, and neither kernel reads it on the host. torch's backward takes a gradient
with real strides only (not an expanded one, as `y.sum()` would send): a LoRA update's always is.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from queue_tinker.workers.kernels.launch import kernel

Backend = Literal["torch", "triton"]


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, backend: Backend | None = None
) -> torch.Tensor:
    """(T, N): x[rows of group g] @ w[g].T for each group g; x (T, K), w (G, N, K) in one dtype,
    ends (G,) int32 cumulative row counts on x's device. `backend` None: torch's kernel where
    it has one for the device and dtype (torch_has_kernel), the Triton segment GEMM elsewhere."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} do not chain")
    if ends.shape != (w.shape[0],) or ends.dtype != torch.int32:
        raise ValueError(f"grouped_matmul: ends must be ({w.shape[0]},) int32, got {ends.dtype}")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_matmul: x is {x.dtype} but w is {w.dtype}")
    chosen = backend or ("torch" if torch_has_kernel(x, w) else "triton")
    if chosen == "torch":
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)
    return torch.ops.queue_tinker.segment_matmul(x, w, ends)


def torch_has_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's `_grouped_mm` runs for these operands (torch_runs); on CUDA the rows'
    count too must keep x's transpose aligned, which the weights' gradient reads."""
    if not torch_runs(x.device, x.dtype, x.shape[1], w.shape[1]):
        return False
    return x.device.type == "cpu" or x.shape[0] * x.element_size() % 16 == 0


def torch_runs(device: torch.device, dtype: torch.dtype, k: int, n: int) -> bool:
    """Whether torch's `_grouped_mm` runs for a product of width k into width n: on the CPU,
    or in bf16 on a CUDA card of sm_90 or later (or meta tensors, which stand for one:
    bench.mfu --count), with every row of x, of w and of the output 16-byte aligned (cuBLAS's
    rule, which torch applies on the CPU too: a rank-2 fp32 adapter's rows are 8 bytes)."""
    if k * dtype.itemsize % 16 or n * dtype.itemsize % 16:
        return False
    if device.type == "cpu":
        return True
    if dtype != torch.bfloat16:
        return False
    return device.type == "meta" or (
        device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    )


# --- the Triton segment GEMM ---------------------------------------------------------------------


@torch.library.custom_op("queue_tinker::segment_matmul", mutates_args=())
def segment_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[1], dtype=w.dtype, device=x.device)
    _launch_segment_matmul(x, w, ends, out)
    return out


@segment_matmul.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1], dtype=w.dtype)


@torch.library.custom_op("queue_tinker::segment_outer", mutates_args=())
def segment_outer(grad: torch.Tensor, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(G, N, K): grad[rows of g].T @ x[rows of g] for each group g: the weights' gradient."""
    out = torch.empty(ends.shape[0], grad.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    _launch_segment_outer(grad, x, ends, out)
    return out


@segment_outer.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(ends.shape[0], grad.shape[1], x.shape[1])


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, w, ends = inputs
    ctx.save_for_backward(x, w, ends)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, w, ends = ctx.saved_tensors
    grad = grad.contiguous()
    # x's gradient is the same product with each group's matrix untransposed (a strided view).
    dx = segment_matmul(grad, w.transpose(1, 2), ends) if ctx.needs_input_grad[0] else None
    dw = segment_outer(grad, x, ends) if ctx.needs_input_grad[1] else None
    return dx, dw, None


segment_matmul.register_autograd(_backward, setup_context=_setup_context)


def _blocks(n: int) -> int:
    """A block width for a dimension of n: tl.dot wants 16 or more, more than 64 gains little
    for LoRA's thin side."""
    return min(64, max(16, 1 << (max(n, 1) - 1).bit_length()))


def _launch_segment_matmul(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, out: torch.Tensor
) -> None:
    groups, n, k = w.shape
    if groups == 0 or x.shape[0] == 0:
        return
    block_m, block_n, block_k = 32, _blocks(n), _blocks(k)
    # The longest group bounds the grid's rows; a host read of `ends` is what torch's own
    # kernel avoids, so the bound is every row (programs past their group's end return).
    rows = x.shape[0]
    grid = (groups, -(-rows // block_m), -(-n // block_n))
    kernel("segment_gemm", "segment_matmul", x)[grid](
        x, w, ends, out, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
    )  # fmt: skip


def _launch_segment_outer(
    grad: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, out: torch.Tensor
) -> None:
    groups, n, k = out.shape
    if groups == 0:
        return
    block_t, block_n, block_k = 32, _blocks(n), _blocks(k)
    grid = (groups, -(-n // block_n), -(-k // block_k))
    kernel("segment_gemm", "segment_outer", x)[grid](
        grad, x, ends, out, n, k,
        grad.stride(0), grad.stride(1), x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
