"""The kernels of workers/kernels/ on CUDA: torch's `_grouped_mm` (bf16, sm_90+) and the Triton
segment GEMM compiled for the card (fp32 and bf16) each equal a loop of one matmul per group in
fp32, forward and backward, at LoRA's shrink and expand shapes of the 8B model.

A dry run on the CPU (GPU_TESTS_DEVICE=cpu) runs the Triton kernels under the interpreter at a
smaller shape: the script's path, not the card's figures."""

from __future__ import annotations

import os

import pytest
import torch

from queue_tinker.workers.kernels.grouped_matmul import grouped_matmul, torch_has_kernel

DEVICE = os.environ.get("GPU_TESTS_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="needs a CUDA device (torch.cuda.is_available() is False)",
    ),
]
# 8 adapters' 4 x 512-token ops at the 8B shape (rank 32, hidden 4096); one group empty. The
# dry run (the interpreter runs each program in Python): a few groups of a few rows.
SIZES = [2048] * 7 + [0] if DEVICE == "cuda" else [48, 80, 0]
HIDDEN, RANK = (4096, 32) if DEVICE == "cuda" else (128, 32)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


# torch's bf16 kernel on the CPU is not the card's, and the interpreter's bf16 tl.dot is wrong
# even for one 16 x 16 block (Triton 3.7.1: 1e10 off): bf16 is checked on the card alone.
ON_THE_CARD = pytest.mark.skipif(DEVICE == "cpu", reason="bf16 is checked on the card alone")


@pytest.mark.parametrize(("k", "n"), [(HIDDEN, RANK), (RANK, HIDDEN)], ids=["shrink", "expand"])
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        pytest.param("torch", torch.bfloat16, id="torch-bf16", marks=ON_THE_CARD),
        pytest.param("triton", torch.bfloat16, id="triton-bf16", marks=ON_THE_CARD),
        pytest.param("triton", torch.float32, id="triton-fp32"),
    ],
)
def test_grouped_matmul_equals_a_matmul_per_group(
    monkeypatch: pytest.MonkeyPatch, backend: str, dtype: torch.dtype, k: int, n: int
) -> None:
    """Output and both gradients within bf16's (2%) or fp32's (1e-4) tolerance of the fp32
    per-group loop, relative to each tensor's largest element."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(k + n)
    rows = sum(SIZES)
    x = torch.randn(rows, k, generator=generator)
    w = torch.randn(len(SIZES), n, k, generator=generator) / k**0.5
    grad = torch.randn(rows, n, generator=generator)
    ends = torch.tensor(SIZES).cumsum(0).to(torch.int32)

    want_x, want_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.cat([p @ want_w[g].T for g, p in enumerate(want_x.split(SIZES))])
    want.backward(grad)

    device = torch.device(DEVICE)
    got_x = x.to(device, dtype).requires_grad_()
    got_w = w.to(device, dtype).requires_grad_()
    if backend == "torch":
        assert torch_has_kernel(got_x, got_w)
    got = grouped_matmul(got_x, got_w, ends.to(device), backend=backend)  # type: ignore[arg-type]
    got.backward(grad.to(device, dtype))
    assert got_x.grad is not None and got_w.grad is not None
    for name, actual, expected in (
        ("output", got, want),
        ("x's gradient", got_x.grad, want_x.grad),
        ("the weights' gradient", got_w.grad, want_w.grad),
    ):
        assert expected is not None
        error = float((actual.float().cpu() - expected.detach()).abs().max())
        scale = float(expected.abs().max())
        assert error <= TOLERANCE[dtype] * scale, (name, error, scale)
