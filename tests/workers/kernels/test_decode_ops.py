"""The fused decode step's kernels (kernels/decode_ops.py): each Triton kernel, run by Triton's
interpreter on CPU tensors, equals its torch reference (what a CPU worker runs), at shapes no
block divides, with rows on the base model, rows one token long and rows across several pages;
each compiles for sm_90 here; each counts as one kernel on meta tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from bench.harness.kernel_count import count_kernels
from queue_tinker.workers.kernels import decode_ops as ops

EPS = 1e-6


def both(monkeypatch: pytest.MonkeyPatch, fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """fn's result by the torch reference, then by the interpreted kernel, each on copies."""

    def copies() -> list[Any]:
        return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reference = fn(*copies())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = fn(*copies())
    monkeypatch.delenv("TRITON_INTERPRET")
    return reference, kernel


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def test_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    x, residual, weight = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    close(*both(monkeypatch, ops.rms_norm, x, weight, EPS))

    def added(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.cat([ops.add_rms_norm_(x, residual, weight, EPS), residual])

    reference, kernel = both(monkeypatch, added, x, residual, weight)
    close(reference, kernel)
    close(reference[5:], x + residual)  # the residual stream summed in place


def test_silu_mul(monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up = torch.randn(5, 2 * 40)
    reference, kernel = both(monkeypatch, ops.silu_mul, gate_up)
    close(reference, kernel)
    close(reference, torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:])


def pages(count: int, page: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(count, page, kv_heads, dim), torch.randn(count, page, kv_heads, dim)


# Rows of 1, 10 and 22 tokens over pages of 8 (one row's pages out of order).
TABLE = torch.tensor([[1, 2, 3], [4, 5, 6], [9, 8, 7]], dtype=torch.int32)
LENGTHS = torch.tensor([1, 10, 22], dtype=torch.int32)


def test_rope_and_the_kv_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """q and k rotated as transformers' rotate_half does, k and v in each row's page."""
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim)
    positions = LENGTHS.long() - 1
    inv_freq = 1 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    keys, values = (torch.zeros(10, 8, kv_heads, dim) for _ in range(2))

    def written(*args: Any) -> torch.Tensor:
        q = ops.rope_kv_write(*args)
        return torch.cat([q.flatten(), args[6].flatten(), args[7].flatten()])

    args = (qkv, positions, inv_freq, 0.5, heads, dim, keys, values, TABLE)
    reference, kernel = both(monkeypatch, written, *args)
    close(reference, kernel)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], -1)
    q = qkv[:, : heads * dim].view(3, heads, 1, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(3, kv_heads, 1, dim)
    want_q, want_k = apply_rotary_pos_emb(
        q, k, angles.cos()[:, None] * 0.5, angles.sin()[:, None] * 0.5
    )
    close(reference[: q.numel()], want_q.flatten())
    k_pages = reference[q.numel() : q.numel() + keys.numel()].view_as(keys)
    close(k_pages[7, 5], want_k[2, :, 0])  # row 2 at 21: its third page (7), column 5


def test_rope_after_each_head_s_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's q / k norms: each head RMS-normed over its dim by its own weight, then rotated,
    as transformers' Qwen3 attention does."""
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim)
    positions = LENGTHS.long() - 1
    inv_freq = 1 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    q_norm, k_norm = torch.rand(dim) + 0.5, torch.rand(dim) + 0.5
    keys, values = (torch.zeros(10, 8, kv_heads, dim) for _ in range(2))

    def written(*args: Any) -> torch.Tensor:
        q = ops.rope_kv_write(*args)
        return torch.cat([q.flatten(), args[6].flatten(), args[7].flatten()])

    args = (qkv, positions, inv_freq, 1.0, heads, dim, keys, values, TABLE, q_norm, k_norm, 1e-6)
    reference, kernel = both(monkeypatch, written, *args)
    close(reference, kernel)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    norm = Qwen3RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(q_norm)
        q = norm(qkv[:, : heads * dim].view(3, heads, dim))[:, :, None]
        norm.weight.copy_(k_norm)
        k = norm(qkv[:, heads * dim : (heads + kv_heads) * dim].view(3, kv_heads, dim))[:, :, None]
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], -1)[:, None]
    want_q, want_k = apply_rotary_pos_emb(q, k, angles.cos(), angles.sin())
    close(reference[: q.numel()], want_q.flatten())
    k_pages = reference[q.numel() : q.numel() + keys.numel()].view_as(keys)
    close(k_pages[7, 5], want_k[2, :, 0])


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_paged_attention(monkeypatch: pytest.MonkeyPatch, splits: int) -> None:
    """Each row against its own filled columns only, by pages, whole or split and merged."""
    heads, kv_heads, dim = 6, 2, 16  # a group of 3 (no block divides it)
    keys, values = pages(10, 8, kv_heads, dim)
    q = torch.randn(3, heads, dim)

    def attended(*args: Any) -> torch.Tensor:
        return ops.decode_attention(*args, splits)

    reference, kernel = both(monkeypatch, attended, q, keys, values, TABLE, LENGTHS, 0.25)
    close(reference, kernel)
    row = 1  # against plain attention over its 10 tokens
    k = keys[TABLE[row].long()].reshape(-1, kv_heads, dim)[:10].repeat_interleave(3, 1)
    v = values[TABLE[row].long()].reshape(-1, kv_heads, dim)[:10].repeat_interleave(3, 1)
    weights = torch.softmax(torch.einsum("hd,thd->ht", q[row], k) * 0.25, -1)
    close(reference[row], torch.einsum("ht,thd->hd", weights, v))


def test_lora_shrink_and_expand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row times its slot's A, then its slot's B added in place, a fused group's output
    columns reading their own part; rows on the base model unchanged."""
    rank, slot = 8, torch.tensor([2, -1, 0, 1, 0])
    x, a = torch.randn(5, 48), torch.randn(3, 3 * rank, 48)
    b, y = torch.randn(3, 60, rank), torch.randn(5, 60)
    reference, kernel = both(monkeypatch, ops.lora_shrink, x, a, slot)
    used = slot >= 0
    close(reference[used], kernel[used])
    close(reference[0], a[2] @ x[0])

    def expanded(y: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ops.lora_expand_(y, low, b, slot, rank, [20, 40])
        return y

    reference, kernel = both(monkeypatch, expanded, y, kernel)
    close(reference, kernel)
    close(reference[1], y[1])  # the base model's row
    low = ops.lora_shrink(x, a, slot)
    pieces = [slice(0, 20), slice(20, 40), slice(40, 60)]
    for i, columns in enumerate(pieces):  # row 3 on slot 1: q, k, v each by its own rank
        want = y[3, columns] + b[1, columns] @ low[3, i * rank : (i + 1) * rank]
        close(reference[3, columns], want)


def test_each_op_is_one_kernel_on_meta_tensors() -> None:
    meta = torch.device("meta")
    with meta:
        x, w = torch.empty(4, 32), torch.empty(32)
        q, (keys, values) = torch.empty(4, 4, 16), pages(8, 8, 2, 16)
        table, lengths = torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
        slot, a, b = torch.zeros(4, dtype=torch.long), torch.empty(2, 8, 32), torch.empty(2, 32, 8)

    def step() -> None:
        ops.add_rms_norm_(x, x.clone(), w, EPS)
        ops.paged_attention(q, keys, values, table, lengths, 0.25)
        ops.lora_expand_(x, ops.lora_shrink(x, a, slot), b, slot, 8, [])

    counts = count_kernels(step)
    assert counts.kernels == {
        "clone": 1, "add_rms_norm_": 1, "paged_attention": 1, "lora_shrink": 1, "lora_expand_": 1
    }  # fmt: skip


INT_ARGS = {
    "n", "heads", "head_dim", "group", "k", "width", "rank", "end1", "end2",
    "splits", "page_size",
}  # fmt: skip
FLOAT_ARGS = {"eps", "attention_scaling", "scale", "norm_eps"}
KERNELS = {  # name: (pointer dtypes other than the model's, constexprs) as the launchers pick
    "add_rms_norm": ({}, {"HAS_RESIDUAL": True, "BLOCK": 4096}),
    "rope_kv_write": (
        {"pos_ptr": "*i64", "freq_ptr": "*fp32", "table_ptr": "*i32"},
        {"HALF": 64, "QK_NORM": True},
    ),
    "paged_attention": (
        {"table_ptr": "*i32", "len_ptr": "*i32", "max_ptr": "*fp32", "sum_ptr": "*fp32"},
        {"PAGE": 64, "DIM": 128, "BLOCK_G": 16, "FINAL": True, "IEEE": False},
    ),
    "paged_attention_fp32": (  # fp32 models (the GPU suite's): the dots in IEEE
        {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "out_ptr": "*fp32",
         "table_ptr": "*i32", "len_ptr": "*i32", "max_ptr": "*fp32", "sum_ptr": "*fp32"},
        {"PAGE": 64, "DIM": 128, "BLOCK_G": 16, "FINAL": True, "IEEE": True},
    ),
    "paged_attention_parts": (
        {"table_ptr": "*i32", "len_ptr": "*i32", "out_ptr": "*fp32", "max_ptr": "*fp32",
         "sum_ptr": "*fp32"},
        {"PAGE": 64, "DIM": 128, "BLOCK_G": 16, "FINAL": False, "IEEE": False},
    ),
    "attention_splits": (
        {"part_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32"}, {"SPLITS": 8, "DIM": 128}
    ),
    "silu_mul": ({}, {"BLOCK": 1024}),
    "lora_shrink": ({"slot_ptr": "*i64"}, {"BLOCK_N": 64, "BLOCK_K": 256}),
    "lora_expand": ({"slot_ptr": "*i64"}, {"BLOCK_N": 64, "BLOCK_R": 32}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_compiles_for_sm90(name: str) -> None:
    """Each kernel compiles to an sm_90 cubin here, without a GPU, in bf16 at the 8B shape's
    block sizes: what the interpreter forgives fails here, not on the first GPU run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from queue_tinker.workers.kernels import decode_kernels

    pointers, constexprs = KERNELS[name]
    source = "paged_attention" if name.startswith("paged_attention") else name
    kernel = triton.jit(getattr(decode_kernels, f"{source}_kernel"))
    signature: dict[str, str] = {}
    for arg in kernel.arg_names:
        if arg in pointers:
            signature[arg] = pointers[arg]
        elif arg.startswith("stride") or arg in INT_ARGS:
            signature[arg] = "i32"
        elif arg in FLOAT_ARGS:
            signature[arg] = "fp32"
        else:
            signature[arg] = "*bf16" if arg.endswith("_ptr") else "constexpr"
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 64)
    )
    assert compiled.asm["cubin"]


def test_the_attention_reference_reads_only_the_filled_pages() -> None:
    """A page table as wide as a long-context model's positions (the fused step's) costs the
    CPU reference nothing past the pages rows fill: with 10^7 pages a row (what gathering them
    all would need is ~60 GB), rows of a few tokens attend at once, as over a narrow table."""
    keys, values = pages(4, 8, 2, 16)
    q = torch.randn(3, 4, 16)
    wide = torch.zeros(3, 10**7, dtype=torch.int32)
    wide[:, :3] = TABLE
    narrow = ops.paged_attention_reference(q, keys.repeat(3, 1, 1, 1), values.repeat(3, 1, 1, 1),
                                           TABLE, LENGTHS, 0.25)  # fmt: skip
    got = ops.paged_attention_reference(
        q, keys.repeat(3, 1, 1, 1), values.repeat(3, 1, 1, 1), wide, LENGTHS, 0.25
    )
    close(got, narrow)
