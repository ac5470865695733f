"""Qwen2-VL (and Qwen2.5-VL): a vision tower (`visual`) whose merged patches take the image
placeholders' embeddings, under 3-D (time, height, width) rotary positions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from queue_tinker.workers.model.families.family import Family, VisionTower


def pil_image_processor() -> type[Any]:
    """Qwen2-VL's image processor, the Pillow implementation (torchvision, which the other
    one needs, is no dependency); Qwen3-VL's is the same."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )
    except ImportError:  # transformers before the Pillow / torchvision split: one class
        from transformers import Qwen2VLImageProcessor

        return cast(type[Any], Qwen2VLImageProcessor)
    return cast(type[Any], Qwen2VLImageProcessorPil)


def qwen_vl_tower(
    config_class: Callable[..., PretrainedConfig],
    model_class: Callable[[Any], PreTrainedModel],
) -> VisionTower:
    """The vision side of a family that places images as Qwen2-VL does (its config's text and
    vision parts and special token ids, its image processor), by its config and model
    classes."""

    def builtin_config(
        text: dict[str, Any], vision: dict[str, Any], tokens: dict[str, int]
    ) -> PretrainedConfig:
        return config_class(
            text_config=text,
            vision_config=vision,
            image_token_id=tokens["image_token_id"],
            video_token_id=tokens["video_token_id"],
            vision_start_token_id=tokens["vision_start_token_id"],
            vision_end_token_id=tokens["vision_end_token_id"],
            tie_word_embeddings=False,
        )

    return VisionTower(
        model_of=model_class,
        builtin_config=builtin_config,
        image_processor=pil_image_processor,
    )


FAMILY = Family(
    name="Qwen2-VL",
    model_types=frozenset({"qwen2_vl", "qwen2_5_vl"}),
    vision=qwen_vl_tower(Qwen2VLConfig, Qwen2VLForConditionalGeneration),
    frozen=("visual",),
    fused_kernels=True,
    builtins=("queue-tinker/tiny-vl",),
)
