"""The fused decode step's kernels as torch.library custom ops: each is one launch on CUDA
(decode_kernels.py, in Triton), interpreted on the CPU under TRITON_INTERPRET=1, and its torch
reference on a CPU worker; a fake implementation makes it count as one kernel on meta tensors
(bench.decode_step --count).

- `rms_norm`, `add_rms_norm_` (the residual added in place, then normed): a decoder layer's
  norms, one kernel each where the model runs three (or five) elementwise ones.
- `rope_kv_write`: q and k rotated (each head RMS-normed first for Qwen3) and k, v written
  into their pages of the KV cache.
- `paged_attention` (and, split over a long row's pages, `paged_attention_parts` +
  `merge_attention_splits`): one query token a row against its filled pages only, the query
  heads sharing a key / value head read together (grouped-query attention without copies).
- `silu_mul`: SwiGLU over the one gate/up GEMM's output.
- `lora_shrink` / `lora_expand_`: every row's own adapter's A, then B added in place (BGMV, as
  Punica and vLLM's lora kernels), a row on the base model (slot < 0) reading no adapter.

The KV cache is paged: k_pages / v_pages (pages, page size, kv heads, head dim), row r's token t
in page table[r, t // page size] at t % page size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from queue_tinker.workers.kernels.launch import kernel, runs_triton

SOURCE = "decode_kernels"


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


# --- norms ---------------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama's): normed in fp32, scaled in the input's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@torch.library.custom_op("queue_tinker::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (rows, hidden) normed."""
    if not runs_triton(x):
        return rms_norm_reference(x, weight, eps)
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    _launch_norm(x, None, weight, eps, out)
    return out


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.result_type(weight, x))


@torch.library.custom_op("queue_tinker::add_rms_norm_", mutates_args=("residual",))
def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (the decoder's residual stream, in place), then residual normed."""
    if not runs_triton(x):
        residual.add_(x)
        return rms_norm_reference(residual, weight, eps)
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    _launch_norm(x, residual, weight, eps, out)
    return out


@add_rms_norm_.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.result_type(weight, x))


def _launch_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    rows, n = x.shape
    if rows == 0:
        return
    # With a residual the kernel reads x and the residual and writes the sum over the residual.
    source = x if residual is None else residual
    kernel(SOURCE, "add_rms_norm", x)[(rows,)](
        x, source, weight, out, source, n, eps,
        x.stride(0), source.stride(0), out.stride(0), source.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=_pow2(n),
    )  # fmt: skip


# --- rotary embedding and the KV write -----------------------------------------------------------


def rope_kv_write_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    heads: int,
    head_dim: int,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> torch.Tensor:
    """transformers' rotary embedding (rotate_half) on q and k (each head RMS-normed first
    where q_norm / k_norm are given: Qwen3's), k and v written to each row's position; q back
    (rows, heads * head_dim)."""
    rows = qkv.shape[0]
    kv_heads = k_pages.shape[2]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    if q_norm is not None and k_norm is not None:
        q = rms_norm_reference(q.reshape(rows, heads, head_dim), q_norm, norm_eps)
        k = rms_norm_reference(k.reshape(rows, kv_heads, head_dim), k_norm, norm_eps)
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    cos = (angles.cos() * attention_scaling).to(qkv.dtype)
    sin = (angles.sin() * attention_scaling).to(qkv.dtype)

    def rotated(x: torch.Tensor, count: int) -> torch.Tensor:
        x = x.reshape(rows, count, head_dim)
        first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    page_size = k_pages.shape[1]
    page = table.gather(1, (positions // page_size)[:, None].to(table.dtype))[:, 0].long()
    offset = (positions % page_size).long()
    k_pages[page, offset] = rotated(k, kv_heads).to(k_pages.dtype)
    v_pages[page, offset] = v.reshape(rows, kv_heads, head_dim).to(v_pages.dtype)
    return rotated(q, heads).reshape(rows, heads * head_dim)


@torch.library.custom_op("queue_tinker::rope_kv_write", mutates_args=("k_pages", "v_pages"))
def rope_kv_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    heads: int,
    head_dim: int,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> torch.Tensor:
    """qkv (rows, (heads + 2 kv heads) * head_dim) at `positions` (rows,): q rotated back,
    k rotated and v written to the pages; q and k each head RMS-normed first where q_norm /
    k_norm (head_dim,) are given."""
    args = (qkv, positions, inv_freq, attention_scaling, heads, head_dim, k_pages, v_pages, table)
    if not runs_triton(qkv):
        return rope_kv_write_reference(*args, q_norm, k_norm, norm_eps)
    rows = qkv.shape[0]
    q = torch.empty(rows, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    if rows:
        kv_heads = k_pages.shape[2]
        normed = q_norm is not None and k_norm is not None
        kernel(SOURCE, "rope_kv_write", qkv)[(rows, heads + kv_heads)](
            qkv, positions, inv_freq, q, k_pages, v_pages, table,
            q_norm if normed else inv_freq, k_norm if normed else inv_freq,
            heads, head_dim, attention_scaling, norm_eps,
            qkv.stride(0), q.stride(0), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            table.stride(0), k_pages.shape[1],
            HALF=_pow2(head_dim // 2), QK_NORM=normed,
        )  # fmt: skip
    return q


@rope_kv_write.register_fake
def _(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    heads: int,
    head_dim: int,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], heads * head_dim)


# --- attention over the filled pages -------------------------------------------------------------


def paged_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q (rows, heads, dim) against each row's first lengths[r] tokens; (rows, heads, dim)."""
    rows, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    # Only the pages some row fills (a table is as wide as the model's positions): on the CPU,
    # where this runs, reading the longest length costs nothing.
    table = table[:, : -(-int(lengths.max()) // page_size)] if rows else table[:, :0]
    columns = table.shape[1] * page_size

    def gathered(pages: torch.Tensor) -> torch.Tensor:  # (rows, kv heads, columns, dim)
        return pages[table.long()].reshape(rows, columns, kv_heads, dim).transpose(1, 2)

    filled = torch.arange(columns, device=q.device)[None, :] < lengths[:, None]
    grouped = q.reshape(rows, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(
        grouped, gathered(k_pages), gathered(v_pages), attn_mask=filled[:, None, None, :],
        scale=scale,
    )  # fmt: skip
    return out.reshape(rows, heads, dim)


@torch.library.custom_op("queue_tinker::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One program a row and key / value head over all its pages (a batch of many rows)."""
    if not runs_triton(q):
        return paged_attention_reference(q, k_pages, v_pages, table, lengths, scale)
    out = torch.empty_like(q)
    _launch_attention(q, k_pages, v_pages, table, lengths, scale, 1, (out,))
    return out


@paged_attention.register_fake
def _(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("queue_tinker::paged_attention_parts", mutates_args=())
def paged_attention_parts(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-decoding's first half: each split of a row's pages attended alone, its
    unnormalised output (rows, heads, splits, dim), running max and sum (rows, heads, splits)
    kept for merge_attention_splits. Triton only (the reference runs paged_attention whole)."""
    rows, heads, dim = q.shape
    parts = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
    best = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    total = torch.empty_like(best)
    _launch_attention(q, k_pages, v_pages, table, lengths, scale, splits, (parts, best, total))
    return parts, best, total


@paged_attention_parts.register_fake
def _(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, heads, dim = q.shape
    best = q.new_empty(rows, heads, splits, dtype=torch.float32)
    return q.new_empty(rows, heads, splits, dim, dtype=torch.float32), best, torch.empty_like(best)


@torch.library.custom_op("queue_tinker::merge_attention_splits", mutates_args=())
def merge_attention_splits(
    parts: torch.Tensor, best: torch.Tensor, total: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The splits' outputs merged by their maxima: (rows, heads, dim) in `dtype`."""
    rows, heads, splits, dim = parts.shape
    out = torch.empty(rows, heads, dim, dtype=dtype, device=parts.device)
    if rows:
        kernel(SOURCE, "attention_splits", parts)[(rows, heads)](
            parts, best, total, out, splits, dim,
            parts.stride(0), parts.stride(1), parts.stride(2), best.stride(0), best.stride(1),
            out.stride(0), out.stride(1),
            SPLITS=_pow2(splits), DIM=_pow2(dim),
        )  # fmt: skip
    return out


@merge_attention_splits.register_fake
def _(
    parts: torch.Tensor, best: torch.Tensor, total: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    rows, heads, _, dim = parts.shape
    return parts.new_empty(rows, heads, dim, dtype=dtype)


def decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int,
) -> torch.Tensor:
    """q (rows, heads, dim) against each row's filled pages: in one kernel, or split over the
    pages (`splits` > 1, where rows x key / value heads alone would leave the device's cores
    idle: few rows, long ones) and merged in a second."""
    if splits <= 1 or not runs_triton(q):
        return paged_attention(q, k_pages, v_pages, table, lengths, scale)
    parts, best, total = paged_attention_parts(q, k_pages, v_pages, table, lengths, scale, splits)
    return merge_attention_splits(parts, best, total, q.dtype)


def _launch_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int,
    outs: tuple[torch.Tensor, ...],
) -> None:
    rows, heads, dim = q.shape
    if rows == 0:
        return
    _, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    final = splits == 1
    out = outs[0]
    best, total = (outs[1], outs[2]) if not final else (out, out)  # unread when final
    kernel(SOURCE, "paged_attention", q)[(rows, kv_heads, splits)](
        q, k_pages, v_pages, table, lengths, out, best, total,
        group, dim, scale,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        table.stride(0), out.stride(0), out.stride(1), out.stride(2) if not final else 0,
        best.stride(0) if not final else 0, best.stride(1) if not final else 0,
        PAGE=page_size, DIM=_pow2(dim, 16), BLOCK_G=_pow2(group, 16), FINAL=final,
        IEEE=q.dtype == torch.float32,
    )  # fmt: skip


# --- SwiGLU --------------------------------------------------------------------------------------


@torch.library.custom_op("queue_tinker::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (rows, 2 * width), gate then up: silu(gate) * up (rows, width)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if not runs_triton(gate_up):
        return F.silu(gate) * up
    rows, width = gate.shape
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, _pow2(width))
        kernel(SOURCE, "silu_mul", gate_up)[(rows, -(-width // block))](
            gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=block
        )
    return out


@silu_mul.register_fake
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


# --- LoRA slots (BGMV) ---------------------------------------------------------------------------


@torch.library.custom_op("queue_tinker::lora_shrink", mutates_args=())
def lora_shrink(x: torch.Tensor, a: torch.Tensor, row_slot: torch.Tensor) -> torch.Tensor:
    """x (rows, in) times each row's slot's A: a (slots, width, in), row_slot (rows,) (< 0: no
    adapter, its output undefined); (rows, width) in a's dtype."""
    rows, width = x.shape[0], a.shape[1]
    if not runs_triton(x):
        chosen = a[row_slot.clamp(min=0)]  # (rows, width, in)
        low = torch.bmm(chosen, x.to(a.dtype)[:, :, None])[:, :, 0]
        return low * (row_slot >= 0)[:, None].to(a.dtype)
    out = torch.empty(rows, width, dtype=a.dtype, device=x.device)
    if rows:
        block_n = min(64, _pow2(width, 16))
        kernel(SOURCE, "lora_shrink", x)[(rows, -(-width // block_n))](
            x, a, row_slot, out, x.shape[1], width,
            x.stride(0), a.stride(0), a.stride(1), a.stride(2), out.stride(0),
            BLOCK_N=block_n, BLOCK_K=min(256, _pow2(x.shape[1], 16)),
        )  # fmt: skip
    return out


@lora_shrink.register_fake
def _(x: torch.Tensor, a: torch.Tensor, row_slot: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], a.shape[1], dtype=a.dtype)


@torch.library.custom_op("queue_tinker::lora_expand_", mutates_args=("y",))
def lora_expand_(
    y: torch.Tensor,
    low: torch.Tensor,
    b: torch.Tensor,
    row_slot: torch.Tensor,
    rank: int,
    ends: list[int],
) -> None:
    """y (rows, out) += each row's low-rank part times its slot's B: b (slots, out, rank);
    `ends` the output ends of fused linears but the last (q, k of a q/k/v GEMM), whose columns
    read their own `rank` columns of `low` (rows, pieces * rank)."""
    first, second = ([*ends, y.shape[1], y.shape[1]])[:2]
    if not runs_triton(y):
        columns = torch.arange(y.shape[1], device=y.device)
        piece = (columns >= first).long() + (columns >= second).long()
        parts = low.reshape(low.shape[0], -1, rank)[:, piece]  # (rows, out, rank)
        update = (parts * b[row_slot.clamp(min=0)]).sum(-1, dtype=torch.float32)
        y.add_((update * (row_slot >= 0)[:, None]).to(y.dtype))
        return
    rows, n = y.shape
    if rows:
        block_n = 64
        kernel(SOURCE, "lora_expand", y)[(rows, -(-n // block_n))](
            low, b, row_slot, y, n, rank, first, second,
            low.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0),
            BLOCK_N=block_n, BLOCK_R=_pow2(rank, 16),
        )  # fmt: skip


@lora_expand_.register_fake
def _(
    y: torch.Tensor,
    low: torch.Tensor,
    b: torch.Tensor,
    row_slot: torch.Tensor,
    rank: int,
    ends: list[int],
) -> None:
    return None
