"""Llama 3 (and Mistral, the same layer): the family the others are measured against; its
decode step in the fused kernels (`LlamaDecoder`, fused_decode.py says what it stands on)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from queue_tinker.workers.kernels.decode_ops import (
    add_rms_norm_,
    decode_attention,
    rms_norm,
    rope_kv_write,
    silu_mul,
)
from queue_tinker.workers.model.families.family import Family
from queue_tinker.workers.model.families.fused_decode import (
    FusedDecoder,
    SlotLora,
    attention_splits,
    base_weight,
    fused_bias,
    fused_rows,
    linear,
    plain_linear,
)

# Rotary embeddings whose frequencies change with the sequence's length: not the fused step's.
DYNAMIC_ROPE = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights as the fused step reads them; each fused GEMM's first
    module keys its LoRA slots."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_module: torch.nn.Module
    o_module: torch.nn.Module
    gate_up_module: torch.nn.Module
    down_module: torch.nn.Module
    q_norm: torch.Tensor | None  # each head's norm before rotary (Qwen3's), else None
    k_norm: torch.Tensor | None
    qkv_bias: torch.Tensor | None  # q/k/v's biases (Qwen2's), else None


class LlamaDecoder:
    """A Llama decoder's step for one token a row, per layer: add + RMSNorm, the q/k/v GEMM,
    rotary + the KV write, attention over the row's pages, the o GEMM, add + RMSNorm, the
    gate/up GEMM, SwiGLU, the down GEMM (9 kernels; with LoRA slots 2 more a GEMM). A family
    of the same layer with q / k norms (Qwen3) or q/k/v biases (Qwen2) subclasses it with
    QK_NORM or QKV_BIAS."""

    MODEL_TYPES: frozenset[str] = frozenset({"llama", "mistral"})
    QK_NORM = False  # whether each head's q and k are RMS-normed before rotary
    QKV_BIAS = False  # whether q, k and v have biases (no other linear may)

    @classmethod
    def of(cls, model: PreTrainedModel) -> FusedDecoder | None:
        """The fused decode step of a model of this layer, or None where it does not fit."""
        return cls(model) if cls.fits(model) else None

    def __init__(self, model: PreTrainedModel) -> None:
        causal: Any = _causal_lm(model)
        inner = causal.model
        config = causal.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.eps = float(inner.norm.variance_epsilon)
        attention = inner.layers[0].self_attn
        self.norm_eps = float(attention.q_norm.variance_epsilon) if self.QK_NORM else 0.0
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head_module = causal.lm_head
        self.lm_head = base_weight(causal.lm_head)
        self.inv_freq = inner.rotary_emb.inv_freq
        self.attention_scaling = float(inner.rotary_emb.attention_scaling)
        self.layers = [_layer(layer) for layer in inner.layers]

    @classmethod
    def fits(cls, model: torch.nn.Module) -> bool:
        """Whether the fused step computes what this model does: Llama's layer (SiLU MLP,
        linears without bias, plain RMSNorm; q / k norms exactly where QK_NORM), rotary
        frequencies fixed for every length."""
        causal: Any = _causal_lm(model)
        config = getattr(causal, "config", None)
        if config is None or getattr(config, "model_type", None) not in cls.MODEL_TYPES:
            return False
        inner = getattr(causal, "model", None)
        rotary = getattr(inner, "rotary_emb", None)
        if inner is None or rotary is None or getattr(rotary, "rope_type", "") in DYNAMIC_ROPE:
            return False
        if getattr(config, "hidden_act", None) != "silu":
            return False
        linears = [causal.lm_head]
        biased = []
        for layer in inner.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if (getattr(attention, "q_norm", None) is not None) != cls.QK_NORM:
                return False
            biased += [getattr(attention, n) for n in ("q_proj", "k_proj", "v_proj")]
            linears += [attention.o_proj]
            linears += [getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        return all(plain_linear(module) for module in linears) and all(
            plain_linear(module, bias=cls.QKV_BIAS) for module in biased
        )

    @torch.inference_mode()
    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pages: Sequence[tuple[torch.Tensor, torch.Tensor]],
        table: torch.Tensor,
        lora: SlotLora | None,
    ) -> torch.Tensor:
        rows = tokens.shape[0]
        lengths = positions + 1
        splits = attention_splits(rows, self.kv_heads, table.shape[1])
        residual = F.embedding(tokens, self.embed)
        normed = rms_norm(residual, self.layers[0].input_norm, self.eps)
        for index, layer in enumerate(self.layers):
            keys, values = pages[index]
            qkv = linear(normed, layer.qkv, layer.qkv_module, lora, layer.qkv_bias)
            q = rope_kv_write(
                qkv, positions, self.inv_freq, self.attention_scaling, self.heads, self.head_dim,
                keys, values, table, layer.q_norm, layer.k_norm, self.norm_eps,
            )  # fmt: skip
            attended = decode_attention(
                q.view(rows, self.heads, self.head_dim), keys, values, table, lengths,
                self.scale, splits,
            )  # fmt: skip
            out = linear(attended.view(rows, -1), layer.o, layer.o_module, lora)
            normed = add_rms_norm_(out, residual, layer.post_norm, self.eps)
            gate_up = linear(normed, layer.gate_up, layer.gate_up_module, lora)
            down = linear(silu_mul(gate_up), layer.down, layer.down_module, lora)
            after = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.norm
            normed = add_rms_norm_(down, residual, after, self.eps)
        return linear(normed, self.lm_head, self.lm_head_module, lora)


def _causal_lm(model: torch.nn.Module) -> Any:
    """The causal LM under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _layer(layer: Any) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    return _Layer(
        input_norm=layer.input_layernorm.weight,
        qkv=fused_rows([attention.q_proj, attention.k_proj, attention.v_proj]),
        o=base_weight(attention.o_proj),
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=fused_rows([mlp.gate_proj, mlp.up_proj]),
        down=base_weight(mlp.down_proj),
        qkv_module=attention.q_proj,
        o_module=attention.o_proj,
        gate_up_module=mlp.gate_proj,
        down_module=mlp.down_proj,
        q_norm=attention.q_norm.weight if hasattr(attention, "q_norm") else None,
        k_norm=attention.k_norm.weight if hasattr(attention, "k_norm") else None,
        qkv_bias=fused_bias([attention.q_proj, attention.k_proj, attention.v_proj]),
    )


FAMILY = Family(
    name="Llama 3",
    model_types=frozenset({"llama", "mistral"}),
    shards=True,
    fused_kernels=True,
    builtins=("queue-tinker/tiny-llama", "queue-tinker/llama-100m"),
    decoder=LlamaDecoder.of,
)
