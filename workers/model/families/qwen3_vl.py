"""Qwen3-VL, Tinker's vision family: Qwen2-VL's way of placing images (merged patches over the
placeholders, 3-D rotary positions, its image processor), a Qwen3 language model with
interleaved multimodal RoPE, and "deepstack" features of early tower blocks added to the first
language layers."""

from __future__ import annotations

from typing import Any, cast

from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from queue_tinker.workers.model.families import qwen2_vl
from queue_tinker.workers.model.families.family import Family, VisionTower


def _builtin_config(
    text: dict[str, Any], vision: dict[str, Any], tokens: dict[str, int]
) -> PretrainedConfig:
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokens["image_token_id"],
        video_token_id=tokens["video_token_id"],
        vision_start_token_id=tokens["vision_start_token_id"],
        vision_end_token_id=tokens["vision_end_token_id"],
        tie_word_embeddings=False,
    )


def _model_of(config: PretrainedConfig) -> PreTrainedModel:
    return Qwen3VLForConditionalGeneration(cast(Qwen3VLConfig, config))


FAMILY = Family(
    name="Qwen3-VL",
    model_types=frozenset({"qwen3_vl"}),
    vision=VisionTower(
        model_of=_model_of,
        builtin_config=_builtin_config,
        image_processor=qwen2_vl.pil_image_processor,
    ),
    frozen=("visual",),
    builtins=("queue-tinker/tiny-qwen3-vl",),
)
