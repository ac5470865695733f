"""The Triton kernels of the fused decode step (decode_ops.py launches them): plain functions,
made jit-compiled or interpreted by launch.py. Imported only where Triton is installed.

One program a row (norm), a row and head (rotary + KV write), a row, key / value head and split
of the row's pages (attention), a row and block of columns (SwiGLU, LoRA). Accumulators start
from tl.full, not tl.zeros, and sums and maxima are tl.reduce over the standard library's
combine functions, not tl.sum / tl.max: those are @jit functions of Triton's standard library,
which the interpreter cannot call when Triton was imported before TRITON_INTERPRET was set (a
test sets it after import), while it runs tl.reduce over these combine functions in numpy."""

import triton.language as tl

SUM = tl.standard._sum_combine
MAX = tl.standard._elementwise_max


def add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n, eps,
    stride_x, stride_r, stride_o, stride_s,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # The residual sum in the model's dtype, as the model adds it, then normed.
        x = (
            x.to(tl.float32)
            + tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        ).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=ok)
    h = x.to(tl.float32)
    variance = tl.reduce(h * h, 0, SUM) / n
    h = (h / tl.sqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * h.to(tl.float32)).to(
        out_ptr.dtype.element_ty
    ), mask=ok)  # fmt: skip


def rope_kv_write_kernel(
    qkv_ptr, pos_ptr, freq_ptr, q_ptr, k_ptr, v_ptr, table_ptr, q_norm_ptr, k_norm_ptr,
    heads, head_dim, attention_scaling, norm_eps,
    stride_qkv, stride_q, stride_kp, stride_kt, stride_kh, stride_table, page_size,
    HALF: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)  # heads query heads, then the key / value heads
    pos = tl.load(pos_ptr + row)
    offs = tl.arange(0, HALF)
    ok = offs < head_dim // 2
    angle = pos.to(tl.float32) * tl.load(freq_ptr + offs, mask=ok, other=0.0)
    dtype = q_ptr.dtype.element_ty
    cos = (tl.cos(angle) * attention_scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * attention_scaling).to(dtype).to(tl.float32)
    source = qkv_ptr + row * stride_qkv + head * head_dim
    x1 = tl.load(source + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(source + head_dim // 2 + offs, mask=ok, other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3: each head RMS-normed over its dim (its q or k weight) before rotary
        variance = (tl.reduce(x1 * x1, 0, SUM) + tl.reduce(x2 * x2, 0, SUM)) / head_dim
        if head < heads:
            w1 = tl.load(q_norm_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(q_norm_ptr + head_dim // 2 + offs, mask=ok, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(k_norm_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(k_norm_ptr + head_dim // 2 + offs, mask=ok, other=0.0).to(tl.float32)
        scale = 1.0 / tl.sqrt(variance + norm_eps)
        x1 = (w1 * (x1 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    first = (x1 * cos - x2 * sin).to(dtype)
    second = (x2 * cos + x1 * sin).to(dtype)
    if head < heads:
        target = q_ptr + row * stride_q + head * head_dim
        tl.store(target + offs, first, mask=ok)
        tl.store(target + head_dim // 2 + offs, second, mask=ok)
    else:
        kv_head = head - heads
        page = tl.load(table_ptr + row * stride_table + pos // page_size).to(tl.int64)
        at = page * stride_kp + (pos % page_size) * stride_kt + kv_head * stride_kh
        tl.store(k_ptr + at + offs, first, mask=ok)
        tl.store(k_ptr + at + head_dim // 2 + offs, second, mask=ok)
        kv_heads = tl.num_programs(1) - heads
        value = qkv_ptr + row * stride_qkv + (heads + kv_heads + kv_head) * head_dim
        v1 = tl.load(value + offs, mask=ok, other=0.0)
        v2 = tl.load(value + head_dim // 2 + offs, mask=ok, other=0.0)
        tl.store(v_ptr + at + offs, v1, mask=ok)
        tl.store(v_ptr + at + head_dim // 2 + offs, v2, mask=ok)


def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, max_ptr, sum_ptr,
    group, head_dim, scale,
    stride_qr, stride_qh, stride_kp, stride_kt, stride_kh, stride_table,
    stride_or, stride_oh, stride_os, stride_mr, stride_mh,
    PAGE: tl.constexpr, DIM: tl.constexpr, BLOCK_G: tl.constexpr, FINAL: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(len_ptr + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, DIM)
    g_ok = g < group
    d_ok = d < head_dim
    heads = kv_head * group + g
    q = tl.load(
        q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    best = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    total = tl.full((BLOCK_G,), 0.0, dtype=tl.float32)
    acc = tl.full((BLOCK_G, DIM), 0.0, dtype=tl.float32)
    # Each row's own pages split evenly (a short row's splits past its pages do nothing).
    pages = (length + PAGE - 1) // PAGE
    per_split = (pages + tl.num_programs(2) - 1) // tl.num_programs(2)
    first = split * per_split
    last = tl.minimum(pages, first + per_split)
    t = tl.arange(0, PAGE)
    for p in range(first, last):
        page = tl.load(table_ptr + row * stride_table + p).to(tl.int64)  # a pool past 2^31
        t_ok = p * PAGE + t < length
        at = page * stride_kp + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        keys = tl.load(k_ptr + at, mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(keys))
        scores = tl.where(t_ok[None, :], scores * scale, float("-inf"))
        new_best = tl.maximum(best, tl.reduce(scores, 1, MAX))
        shrink = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * shrink + tl.reduce(weights, 1, SUM)
        values = tl.load(v_ptr + at, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * shrink[:, None] + tl.dot(weights, values, input_precision="ieee")
        else:
            acc = acc * shrink[:, None] + tl.dot(weights.to(values.dtype), values)
        best = new_best
    out_mask = g_ok[:, None] & d_ok[None, :]
    if FINAL:
        target = out_ptr + row * stride_or + heads[:, None] * stride_oh + d[None, :]
        tl.store(target, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # this split's part: its running max, sum and unnormalised output
        target = out_ptr + row * stride_or + heads[:, None] * stride_oh + split * stride_os
        tl.store(target + d[None, :], acc, mask=out_mask)
        at = row * stride_mr + heads * stride_mh + split
        tl.store(max_ptr + at, best, mask=g_ok)
        tl.store(sum_ptr + at, total, mask=g_ok)


def attention_splits_kernel(
    part_ptr, max_ptr, sum_ptr, out_ptr, splits, head_dim,
    stride_pr, stride_ph, stride_ps, stride_mr, stride_mh, stride_or, stride_oh,
    SPLITS: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, DIM)
    s_ok = s < splits
    d_ok = d < head_dim
    at = row * stride_mr + head * stride_mh + s
    best = tl.load(max_ptr + at, mask=s_ok, other=float("-inf"))
    total = tl.load(sum_ptr + at, mask=s_ok, other=0.0)
    top = tl.reduce(best, 0, MAX)
    # A split past the row's pages has max -inf: weight 0 (top is finite: a row has a token).
    weight = tl.where(s_ok & (best > float("-inf")), tl.exp(best - top), 0.0)
    parts = tl.load(
        part_ptr + row * stride_pr + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.reduce(parts * weight[:, None], 0, SUM) / tl.reduce(total * weight, 0, SUM)
    tl.store(out_ptr + row * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)  # fmt: skip


def silu_mul_kernel(
    gate_up_ptr, out_ptr, width, stride_g, stride_o, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + width + offs, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=ok)


def lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, out_ptr, k, width,
    stride_x, stride_ag, stride_an, stride_ak, stride_o,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:  # a row on the base model reads no adapter (its output is never read)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < width
        acc = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k
            x = tl.load(x_ptr + row * stride_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            at = slot * stride_ag + offs_n[:, None] * stride_an + offs_k[None, :] * stride_ak
            a = tl.load(a_ptr + at, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.reduce(a.to(tl.float32) * x[None, :], 1, SUM)
        tl.store(out_ptr + row * stride_o + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def lora_expand_kernel(
    s_ptr, b_ptr, slot_ptr, y_ptr, n, rank, end1, end2,
    stride_s, stride_bg, stride_bn, stride_br, stride_y,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n
        # Which of the fused linears (q, k, v) an output column is: its columns of the shrink.
        piece = (offs_n >= end1).to(tl.int32) + (offs_n >= end2).to(tl.int32)
        offs_r = tl.arange(0, BLOCK_R)
        mask = n_ok[:, None] & (offs_r < rank)[None, :]
        low = tl.load(
            s_ptr + row * stride_s + piece[:, None] * rank + offs_r[None, :], mask=mask, other=0.0
        )
        b = tl.load(
            b_ptr + slot * stride_bg + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
            mask=mask,
            other=0.0,
        )
        update = tl.reduce(low.to(tl.float32) * b.to(tl.float32), 1, SUM)
        y = tl.load(y_ptr + row * stride_y + offs_n, mask=n_ok, other=0.0)
        tl.store(y_ptr + row * stride_y + offs_n, (y.to(tl.float32) + update).to(y.dtype),
                 mask=n_ok)  # fmt: skip
