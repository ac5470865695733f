"""Qwen3-VL, Tinker's vision family: Qwen2-VL's way of placing images (merged patches over the
placeholders, 3-D rotary positions, its image processor), a Qwen3 language model with
interleaved multimodal RoPE, and "deepstack" features of early tower blocks added to the first
language layers."""

from __future__ import annotations

from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from queue_tinker.workers.model.families.family import Family
from queue_tinker.workers.model.families.qwen2_vl import qwen_vl_tower

FAMILY = Family(
    name="Qwen3-VL",
    model_types=frozenset({"qwen3_vl"}),
    vision=qwen_vl_tower(Qwen3VLConfig, Qwen3VLForConditionalGeneration),
    frozen=("visual",),
    builtins=("queue-tinker/tiny-qwen3-vl",),
)
