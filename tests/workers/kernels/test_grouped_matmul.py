"""The grouped matmul (kernels/grouped_matmul.py): torch's `_grouped_mm` and the Triton segment
GEMM (run by Triton's interpreter on CPU tensors) each equal a loop of one matmul per group,
forward and backward, for uneven, empty and one-row groups and dimensions no block divides;
each counts as one kernel on meta tensors; bad input is refused with what was wrong."""

from __future__ import annotations

import pytest
import torch

from bench.harness.kernel_count import count_kernels
from queue_tinker.workers.kernels.grouped_matmul import grouped_matmul, torch_has_kernel

# (rows of each group, K, N): LoRA's shapes in small, a rank below tl.dot's 16, a group with
# no rows, a one-row group, and widths no block size divides.
CASES = [
    ([10, 0, 25, 5], 24, 8),
    ([3, 64, 3], 8, 40),
    ([1], 70, 17),
    ([0, 33], 16, 16),
]


def loop_reference(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """One matmul per group, joined: what row_blocks does a block at a time."""
    parts = list(x.split(sizes))
    return torch.cat([part @ w[g].T for g, part in enumerate(parts)])


def run(
    backend: str, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = grouped_matmul(x, w, ends, backend=backend)  # type: ignore[arg-type]
    y.backward(grad)
    assert x.grad is not None and w.grad is not None
    return y.detach(), x.grad, w.grad


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def aligned(k: int, n: int) -> bool:
    """fp32 rows of k and of n elements are both 16-byte aligned: what torch's kernel takes."""
    return k % 4 == 0 and n % 4 == 0


# torch's kernel on the cases it takes; the Triton segment GEMM on every case.
BACKEND_CASES = [
    (backend, *case)
    for case in CASES
    for backend in ("torch", "triton")
    if backend == "triton" or aligned(case[1], case[2])
]


@pytest.mark.parametrize(("backend", "sizes", "k", "n"), BACKEND_CASES)
def test_equals_a_matmul_per_group(
    interpreted: None, backend: str, sizes: list[int], k: int, n: int
) -> None:
    """Output, x's gradient and every group's weight gradient equal the per-group loop's
    (fp32, 1e-5); an empty group's weight gradient is zero. torch's kernel takes 16-byte
    aligned rows only, and says so (torch_has_kernel)."""
    generator = torch.Generator().manual_seed(sum(sizes) + k + n)
    rows = sum(sizes)
    x = torch.randn(rows, k, generator=generator)
    w = torch.randn(len(sizes), n, k, generator=generator)
    assert torch_has_kernel(x, w) == aligned(k, n)
    grad = torch.randn(rows, n, generator=generator)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)

    want_x, want_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = loop_reference(want_x, want_w, sizes)
    want.backward(grad)

    y, dx, dw = run(backend, x, w, ends, grad)
    torch.testing.assert_close(y, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, want_x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, want_w.grad, rtol=1e-5, atol=1e-5)
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(dw[g], torch.zeros_like(dw[g]))


def test_triton_reads_strided_weights(interpreted: None) -> None:
    """Each group's matrix given transposed (a strided view, as backward passes it) gives the
    product with the transpose, without a copy."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(20, 12, generator=generator)
    stored = torch.randn(2, 12, 9, generator=generator)  # (G, K, N) in memory
    ends = torch.tensor([7, 20], dtype=torch.int32)
    want = loop_reference(x, stored.transpose(1, 2), [7, 13])
    got = grouped_matmul(x, stored.transpose(1, 2), ends, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_the_interpreter_the_cpu_path_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton path on CPU tensors without TRITON_INTERPRET=1 fails with how to run it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(4, 16), torch.randn(1, 16, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        grouped_matmul(x, w, torch.tensor([4], dtype=torch.int32), backend="triton")


@pytest.mark.parametrize(
    ("x", "w", "ends", "message"),
    [
        (torch.randn(4, 8), torch.randn(2, 3, 5), torch.tensor([1, 4]), "do not chain"),
        (torch.randn(4, 8), torch.randn(2, 3, 8), torch.tensor([4]), r"ends must be \(2,\)"),
        (torch.randn(4, 8), torch.randn(2, 3, 8), torch.tensor([1.0, 4.0]), "int32"),
        (torch.randn(4, 8).double(), torch.randn(2, 3, 8), torch.tensor([1, 4]), "float64"),
    ],
)
def test_refuses_bad_input(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, message: str
) -> None:
    ends = ends.to(torch.int32) if message not in ("int32",) else ends
    with pytest.raises(ValueError, match=message):
        grouped_matmul(x, w, ends)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_counts_one_kernel_each_way(backend: str) -> None:
    """On meta tensors the product is one kernel forward and two backward (x's gradient and the
    weights'), whatever the number of groups: what the pass's count at the 8B shape adds up."""
    x = torch.empty(2048, 4096, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(8, 32, 4096, device="meta", dtype=torch.bfloat16, requires_grad=True)
    ends = torch.empty(8, dtype=torch.int32, device="meta")

    def step() -> None:
        y = grouped_matmul(x, w, ends, backend=backend)  # type: ignore[arg-type]
        y.backward(torch.empty_like(y))

    counts = count_kernels(step)
    grouped = {
        name: n for name, n in counts.kernels.items() if "grouped_mm" in name or "segment" in name
    }
    assert sum(grouped.values()) == 3, counts.kernels
    assert counts.host_reads == 0


INT_ARGS = {
    "segment_matmul_kernel": (
        "n", "k", "stride_xt", "stride_xk", "stride_wg", "stride_wn", "stride_wk",
        "stride_ot", "stride_on",
    ),
    "segment_outer_kernel": (
        "n", "k", "stride_gt", "stride_gn", "stride_xt", "stride_xk", "stride_og",
        "stride_on", "stride_ok",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(INT_ARGS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("n", "k"), [(32, 4096), (4096, 32), (8, 64)])
def test_compiles_for_sm90(name: str, dtype: str, n: int, k: int) -> None:
    """Each kernel compiles to an sm_90 cubin here, without a GPU, at the block sizes the
    launcher picks for LoRA's shrink and expand: what the interpreter forgives (tl.dot blocks
    under 16, mixed dtypes in a dot) fails here, not on the first GPU run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from queue_tinker.workers.kernels import segment_gemm
    from queue_tinker.workers.kernels.grouped_matmul import _blocks

    kernel = triton.jit(getattr(segment_gemm, name))
    signature: dict[str, str] = {}
    for arg in kernel.arg_names:
        if arg in INT_ARGS[name]:
            signature[arg] = "i32"
        elif arg == "ends_ptr":
            signature[arg] = "*i32"
        elif arg.endswith("_ptr"):
            signature[arg] = f"*{dtype}"
        else:
            signature[arg] = "constexpr"
    rows = "BLOCK_M" if name == "segment_matmul_kernel" else "BLOCK_T"
    constexprs = {rows: 32, "BLOCK_N": _blocks(n), "BLOCK_K": _blocks(k), "IEEE": dtype == "fp32"}
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 64)
    )
    assert compiled.asm["cubin"]
