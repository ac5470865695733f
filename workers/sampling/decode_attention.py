"""Attention for the slot decode step (slot_decode.py): one query token per row against its
slot's keys and values, the query heads that share a key / value head attending as one group.

With grouped-query attention (8B: 32 query heads on 8 key / value heads) and a mask, SDPA's
memory-efficient kernel takes no `enable_gqa`, so transformers' sdpa path may copy every key and
value head once per query head sharing it (`repeat_kv`): at 64 rows x 1,280 columns, 1.3 GB
written and read again per layer, more than the step's weights. For one query position the
group's query heads can stand in for query positions instead: queries (rows, kv heads, group,
dim) against keys (rows, kv heads, columns, dim), the row's mask shared by its group, which is
the same attention without the copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "queue_tinker_slot_decode"
# The implementations the slot step stands in for (a flash kernel takes no 4-D mask).
REPLACES = ("sdpa", "eager")


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (rows, heads, 1, dim), key / value (rows, kv
    heads, columns, dim), a boolean mask (rows, 1, 1, columns); (rows, 1, heads, dim) back."""
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    assert length == 1, "the slot step feeds one token a row"
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # head h: kv head h // group
    out = F.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


AttentionInterface.register(NAME, grouped_decode_attention)


def grouped_decode_fits(model: torch.nn.Module) -> bool:
    """Whether a model's decode steps can take the grouped attention under a mask the caller
    makes: full attention in every layer (a sliding window's mask is the model's own) by sdpa
    or eager (a flash kernel takes no 4-D mask), token positions of one axis (a
    vision-language model's are not)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vision_config", None) is not None:
        return False
    text = config.get_text_config(decoder=True)
    if getattr(text, "sliding_window", None) is not None:
        return False
    if any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or []):
        return False
    return getattr(text, "_attn_implementation", None) in REPLACES


@contextmanager
def grouped_decode(model: torch.nn.Module) -> Iterator[None]:
    """Meanwhile the model's attention layers (which read their implementation from its
    config at every call) run `grouped_decode_attention`; the caller passes the 4-D mask (the
    model makes none for an implementation it does not know)."""
    config = model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]
    saved = config._attn_implementation_internal
    config._attn_implementation_internal = NAME
    try:
        yield
    finally:
        config._attn_implementation_internal = saved
