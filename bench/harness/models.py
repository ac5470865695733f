"""The models benchmarks run: the built-in models as a worker loads them, Llama-shaped models of
random weights (no download), and LoRA adapters through the worker's own AdapterPool."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.base_model import ensure_builtin_model, load_frozen_base

BASE_NAME = "bench/llama-3.1-8b-shaped"  # what adapter configs name as a random model's base


# --- built-in models ---------------------------------------------------------------------------
def ensure_model(name: str, data_dir: Path) -> None:
    """Build a built-in model where the run's workers look for it (once: they then find it)."""
    ensure_builtin_model(name, data_dir / "models")


def frozen_base(name: str, device: str, data_dir: Path) -> PreTrainedModel:
    """A built-in model as a worker loads it: frozen, eval mode, named as users name it."""
    return load_frozen_base(name, device, data_dir / "models", "auto")


# --- random Llamas -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A Llama decoder's sizes."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear of one layer, and of lm_head."""
        d, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, d),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (d, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
            "lm_head": (self.hidden, self.vocab),
        }


def build_model(shape: Shape, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Random weights straight on the device (no CPU copy of 16 GB first); frozen, eval mode."""
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )  # RoPE's settings change no FLOP
    torch.manual_seed(seed)
    with torch.device(device):
        model: torch.nn.Module = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="sdpa"
        )
    model.requires_grad_(False)
    model.eval()  # as the engine does
    model.name_or_path = BASE_NAME  # type: ignore[assignment]
    return model


# --- adapters ----------------------------------------------------------------------------------
def lora_pool(base: torch.nn.Module, base_name: str, adapters: int) -> AdapterPool:
    """The worker's adapter pool on `base`, with room for `adapters`."""
    return AdapterPool(base, base_name, max_resident=adapters)


def add_adapters(pool: AdapterPool, config: LoraConfig, seeds: Iterable[int]) -> list[Adapter]:
    """An adapter per seed (its LoRA A drawn from it, B zero), as a worker adds a new model."""
    return [pool.add(f"bench-{seed}", "bench", config, seed=seed) for seed in seeds]
