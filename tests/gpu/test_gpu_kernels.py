"""The kernels of workers/kernels/ on CUDA: torch's `_grouped_mm` (bf16, sm_90+) and the Triton
segment GEMM compiled for the card (fp32 and bf16) each equal a loop of one matmul per group in
fp32, forward and backward, at LoRA's shrink and expand shapes of the 8B model.

A dry run on the CPU (GPU_TESTS_DEVICE=cpu) runs the Triton kernels under the interpreter at a
smaller shape: the script's path, not the card's figures."""

from __future__ import annotations

import os
from typing import Any

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


# --- the decode step's kernels (kernels/decode_ops.py) -----------------------------------------
# The 8B step's shapes (64 rows, 32 query / 8 key-value heads of 128, pages of 64, rows up to
# 1,280 tokens); the dry run's a few rows of a small model.
ROWS, HEADS, KV_HEADS, DIM, PAGES = (64, 32, 8, 128, 20) if DEVICE == "cuda" else (3, 4, 2, 16, 3)
PAGE = 64 if DEVICE == "cuda" else 8


def decode_cases() -> dict[str, tuple[Any, ...]]:
    """Each op's arguments (fp32, CPU), seeded."""
    from queue_tinker.workers.kernels import decode_ops as ops

    g = torch.Generator().manual_seed(7)
    hidden = HEADS * DIM

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    table = torch.randperm(ROWS * PAGES, generator=g).view(ROWS, PAGES).to(torch.int32)
    lengths = torch.randint(1, PAGES * PAGE + 1, (ROWS,), generator=g)
    keys, values = rand(ROWS * PAGES, PAGE, KV_HEADS, DIM), rand(ROWS * PAGES, PAGE, KV_HEADS, DIM)
    inv_freq = 1 / 500000 ** (torch.arange(0, DIM, 2).float() / DIM)
    slot = torch.randint(-1, 8, (ROWS,), generator=g)
    qkv = rand(ROWS, (HEADS + 2 * KV_HEADS) * DIM)
    return {
        "rms_norm": (ops.rms_norm, rand(ROWS, hidden), rand(hidden), 1e-5),
        "add_rms_norm_": (
            ops.add_rms_norm_, rand(ROWS, hidden), rand(ROWS, hidden), rand(hidden), 1e-5
        ),
        "rope_kv_write": (
            ops.rope_kv_write, qkv, lengths - 1, inv_freq, 1.0, HEADS, DIM, keys, values, table
        ),
        "decode_attention": (
            ops.decode_attention, rand(ROWS, HEADS, DIM), keys, values, table, lengths, DIM**-0.5, 1
        ),
        "decode_attention_split": (
            ops.decode_attention, rand(2, HEADS, DIM), keys, values, table[:2], lengths[:2],
            DIM**-0.5, 4,
        ),
        "silu_mul": (ops.silu_mul, rand(ROWS, 2 * hidden)),
        "lora_shrink": (ops.lora_shrink, rand(ROWS, hidden), rand(8, 96, hidden) / 10, slot),
        "lora_expand_": (
            ops.lora_expand_, rand(ROWS, hidden + 2 * KV_HEADS * DIM), rand(ROWS, 96),
            rand(8, hidden + 2 * KV_HEADS * DIM, 32), slot, 32, [hidden, hidden + KV_HEADS * DIM],
        ),
    }  # fmt: skip


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.bfloat16, id="bf16", marks=ON_THE_CARD),
        pytest.param(torch.float32, id="fp32"),
    ],
)
@pytest.mark.parametrize("name", sorted(decode_cases()))
def test_decode_kernels_equal_their_references(
    monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype
) -> None:
    """Each decode kernel on the device (compiled for the card; the dry run's interpreted)
    equals its torch reference in fp32 on the CPU, what it returns and what it writes in place,
    within bf16's or fp32's tolerance of the largest element."""
    op, *args = decode_cases()[name]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reference = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    want = op(*reference)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = torch.device(DEVICE)

    def moved(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        return a.to(device, dtype if a.is_floating_point() and a.dim() > 1 else a.dtype)

    on_device = [moved(a) for a in args]
    got = op(*on_device)
    pairs = [(got, want)] if got is not None else []
    pairs += [
        (a, b) for a, b in zip(on_device, reference, strict=True)
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() > 1
    ]  # fmt: skip
    for index, (actual, expected) in enumerate(pairs):
        actual, expected = actual.float().cpu(), expected.float()
        if name == "lora_shrink" and index == 0:  # a base-model row's output is undefined
            actual, expected = actual[args[2] >= 0], expected[args[2] >= 0]
        error = float((actual - expected).abs().max())
        assert error <= TOLERANCE[dtype] * float(expected.abs().max()), (name, error)
