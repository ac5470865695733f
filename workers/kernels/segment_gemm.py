"""The Triton segment GEMM's kernels (grouped_matmul.py launches them): plain functions, made
jit-compiled or interpreted there, since which one a launch needs depends on its tensors'
device. Imported only where Triton is installed (CUDA workers, the tests).

Accumulators start from tl.full, not tl.zeros: zeros is a @jit function of Triton's standard
library, which the interpreter fails to call once the process has compiled a kernel for a GPU
(the tests compile for sm_90 beside the interpreted runs)."""

import triton.language as tl


def segment_matmul_kernel(
    x_ptr, w_ptr, ends_ptr, out_ptr, n, k,
    stride_xt, stride_xk, stride_wg, stride_wn, stride_wk, stride_ot, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0)
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(ends_ptr + group)
    first = start + tl.program_id(1) * BLOCK_M
    if first < end:
        offs_m = first + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_m < end
        col_ok = offs_n < n
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k
            a = tl.load(
                x_ptr + offs_m[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + group * stride_wg + offs_k[:, None] * stride_wk
                + offs_n[None, :] * stride_wn,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )  # fmt: skip
            # fp32 in IEEE: tf32 would round away what the fp32 reference keeps.
            acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
        tl.store(
            out_ptr + offs_m[:, None] * stride_ot + offs_n[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def segment_outer_kernel(
    grad_ptr, x_ptr, ends_ptr, out_ptr, n, k,
    stride_gt, stride_gn, stride_xt, stride_xk, stride_og, stride_on, stride_ok,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0)
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(ends_ptr + group)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < n
    k_ok = offs_k < k
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_ok = offs_t < end
        g = tl.load(
            grad_ptr + offs_t[None, :] * stride_gt + offs_n[:, None] * stride_gn,
            mask=n_ok[:, None] & t_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_T): the group's rows of grad, transposed
        a = tl.load(
            x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xk,
            mask=t_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(g.dtype)
        acc = tl.dot(g, a, acc, input_precision="ieee") if IEEE else tl.dot(g, a, acc)
    tl.store(
        out_ptr + group * stride_og + offs_n[:, None] * stride_on + offs_k[None, :] * stride_ok,
        acc.to(out_ptr.dtype.element_ty),
        mask=n_ok[:, None] & k_ok[None, :],
    )
