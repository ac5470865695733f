"""The model families the worker serves, one module each, and the registry that the rest of
the worker asks (`family_of`): no family's name appears outside this folder.

A family declares (family.Family) which linears Tinker's train_attn / train_mlp /
train_unembed adapt, whether stacked experts are adapted with the MLP, its tensor-parallel
split and whether a worker group runs it, its vision tower, whether liger's fused kernels
apply, its fused decode step (fused_decode.py), and its tiny built-ins. A new family is one
module here and a line in FAMILIES. What a model's own structure says (its decoder layers,
routers, expert weights, KV cache layers) is read off the model, not declared.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from queue_tinker.workers.model.families import (
    deepseek_v3,
    generic,
    gpt_oss,
    llama,
    qwen2_vl,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_vl,
)
from queue_tinker.workers.model.families.family import Family, TensorParallel, VisionTower

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    qwen2_vl.FAMILY,
    qwen3_vl.FAMILY,
    gpt_oss.FAMILY,
    deepseek_v3.FAMILY,
    qwen3_5.FAMILY,
)
GENERIC = generic.FAMILY
_BY_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}

__all__ = ["FAMILIES", "GENERIC", "Family", "TensorParallel", "VisionTower", "family_of"]


def family_of(config: PretrainedConfig | str) -> Family:
    """The family of a model's config (or of its model_type); GENERIC for any other."""
    model_type = config if isinstance(config, str) else getattr(config, "model_type", "")
    return _BY_TYPE.get(model_type, GENERIC)


def shardable_families() -> list[str]:
    """The names of the families a worker group splits, for a refusal to name them."""
    return [family.name for family in FAMILIES if family.shards]
