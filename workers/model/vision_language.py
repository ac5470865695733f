"""The vision-language side of a base model (its family's vision tower, families/): building the
built-in tiny one, and turning a model input's image chunks into what the model reads.

An image chunk takes `n` positions of the sequence, each the model's image placeholder token
(`image_token_id`), where `n` is what the model's image processor makes of it: its grid of
patches (after resizing to the processor's pixel bounds) over the spatial merge. The vision
tower turns the pixel values into `n` embeddings that replace those placeholders' and the
language model gives them 3-D (time, height, width) rotary positions. The vision tower is
frozen: LoRA adapts the language model's linears only (adapters.py leaves the family's frozen
modules out).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoImageProcessor, PretrainedConfig, PreTrainedModel

from queue_tinker.builtin_models import (
    BOS_ID,
    EOS_ID,
    IMAGE_PAD_ID,
    PAD_ID,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    BuiltinModel,
)
from queue_tinker.errors import UserInputError
from queue_tinker.types.requests.images import refuse_images
from queue_tinker.types.tensors import EncodedTextChunk, ImageChunk, ModelInput
from queue_tinker.workers.model.families import VisionTower, family_of

# Pillow's names of the formats a chunk may say.
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG"}


def is_vl(config: PretrainedConfig) -> bool:
    """Whether a config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


# --- the built-in model ---------------------------------------------------------------------
def tower_of(model_type: str) -> VisionTower:
    """The vision side of a vision-language family (its registry entry)."""
    vision = family_of(model_type).vision
    if vision is None:
        raise ValueError(f"model type {model_type!r}: no vision-language family has it")
    return vision


def builtin_vl_config(spec: BuiltinModel) -> PretrainedConfig:
    assert spec.vision is not None
    text = {**spec.config, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    tokens = {
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
    }
    return tower_of(spec.model_type).builtin_config(text, spec.vision, tokens)


def model_of(config: PretrainedConfig) -> PreTrainedModel:
    return tower_of(config.model_type).model_of(config)


def write_image_processor(spec: BuiltinModel, directory: Path) -> None:
    """The model's image processor (preprocessor_config.json), as its processor would save it."""
    processor = tower_of(spec.model_type).image_processor()
    processor(**(spec.image_processor or {})).save_pretrained(str(directory))


# --- images in a model input ----------------------------------------------------------------
@dataclass(frozen=True)
class ImageInputs:
    """A model input's images as the model reads them, and its token ids with each image's
    placeholders in place."""

    ids: list[int]
    token_id: int  # the image placeholder's id
    merge: int  # the spatial merge: an image's tokens are its grid's (h / merge) x (w / merge)
    pixel_values: torch.Tensor  # (patches, channels x temporal x patch x patch), fp32
    grid_thw: torch.Tensor  # (images, 3): each image's grid of patches


@dataclass(frozen=True)
class Expanded:
    """A model input made ready for the model: exact image positions, ids, and images."""

    model_input: ModelInput  # every image's expected_tokens set to what it takes
    images: ImageInputs | None  # None: no image in it


class Vision:
    """A vision-language base model's image side: its processor and placeholder token."""

    def __init__(self, path: str, config: PretrainedConfig) -> None:
        # from_pretrained(path), as the model itself; Pillow's implementation, as written.
        self.processor: Any = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)

    def expand(self, where: str, model_input: ModelInput) -> Expanded:
        """The input with its images' positions counted (a differing expected_tokens refused,
        naming the chunk), its ids and its images' pixel values."""
        if not model_input.images:
            return Expanded(model_input, None)
        chunks: list[EncodedTextChunk | ImageChunk] = []
        ids: list[int] = []
        pixels, grids = [], []
        for index, chunk in enumerate(model_input.chunks):
            if isinstance(chunk, EncodedTextChunk):
                chunks.append(chunk)
                ids.extend(chunk.tokens)
                continue
            values, grid = self._process(f"{where}.chunks[{index}]", chunk)
            tokens = int(grid.prod()) // self.merge**2
            if chunk.expected_tokens is not None and chunk.expected_tokens != tokens:
                raise UserInputError(
                    f"{where}.chunks[{index}].expected_tokens: {chunk.expected_tokens}, but "
                    f"this model's processor makes {tokens} tokens of this image "
                    f"(a grid of {grid.tolist()} patches, merged {self.merge}x{self.merge})"
                )
            chunks.append(chunk.model_copy(update={"expected_tokens": tokens}))
            ids.extend([self.image_token_id] * tokens)
            pixels.append(values)
            grids.append(grid)
        images = ImageInputs(
            ids,
            self.image_token_id,
            self.merge,
            torch.cat(pixels),
            torch.stack(grids),
        )
        return Expanded(ModelInput(chunks=chunks), images)

    def _process(self, where: str, chunk: ImageChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel values, grid (t, h, w)) of one image; bytes that do not decode as the
        chunk's format are the user's error."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(chunk.data), formats=[_PIL_FORMATS[chunk.format]]) as img:
                rgb = img.convert("RGB")
        except UnidentifiedImageError:  # a header that reads, a body that does not
            raise UserInputError(
                f"{where}.data: cannot be decoded as a {chunk.format} image (cut short or corrupt)"
            ) from None
        except (OSError, ValueError, SyntaxError) as exc:  # a truncated or corrupt file
            raise UserInputError(
                f"{where}.data: cannot be decoded as a {chunk.format} image ({exc})"
            ) from None
        try:
            out = self.processor(images=[rgb], return_tensors="pt")
        except ValueError as exc:  # e.g. Qwen2-VL's: an aspect ratio over 200
            raise UserInputError(
                f"{where}.data: this model's image processor cannot take this "
                f"{rgb.width}x{rgb.height} image ({exc})"
            ) from None
        return out["pixel_values"].float(), out["image_grid_thw"][0].long()


@dataclass(frozen=True)
class ImageSupport:
    """What a worker's base model does with image chunks: expands them (a vision-language
    model's `vision`), or refuses them naming the chunk (a text-only model)."""

    base_model: str = "this base model"
    vision: Vision | None = None

    def expand(self, where: str, model_input: ModelInput) -> Expanded:
        if self.vision is not None:
            return self.vision.expand(where, model_input)
        refuse_images(where, model_input, self.base_model)
        return Expanded(model_input, None)

    @property
    def image_token_id(self) -> int:
        assert self.vision is not None, "a text-only model has no image token"
        return self.vision.image_token_id


# --- the model call -------------------------------------------------------------------------
@dataclass(frozen=True)
class RowImages:
    """The images of a batch's rows, in row order, as the model's keyword arguments."""

    kwargs: dict[str, torch.Tensor]  # pixel_values, image_grid_thw
    token_id: int
    merge: int


def joined(
    images: Sequence[ImageInputs | None], device: torch.device, dtype: torch.dtype
) -> RowImages | None:
    """The images of rows (None: a row without any), for one model call; None if no row
    has one."""
    present = [i for i in images if i is not None]
    if not present:
        return None
    return RowImages(
        kwargs={
            "pixel_values": torch.cat([i.pixel_values for i in present]).to(device, dtype),
            "image_grid_thw": torch.cat([i.grid_thw for i in present]).to(device),
        },
        token_id=present[0].token_id,
        merge=present[0].merge,
    )


def hidden_states(
    lm: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor | None, images: RowImages
) -> torch.Tensor:
    """The final hidden states of rows whose image placeholders take the images' embeddings,
    at their 3-D rotary positions."""
    model = cast(Any, lm).model  # the multimodal model under the LM head
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=rope_positions(ids, mask, images),
        use_cache=False,
        **images.kwargs,
    )
    return cast(torch.Tensor, out.last_hidden_state)


def rope_positions(ids: torch.Tensor, mask: torch.Tensor | None, images: RowImages) -> torch.Tensor:
    """(3, rows, width) rotary positions (time, height, width) of rows holding images, padding
    (0 in `mask`) at 0: a text token's are its running position on all three axes; an image's
    tokens sit at the running position plus their (time, row, column) in its merged grid, and
    the text after it goes on from the running position plus its larger side. Qwen2-VL's
    rule (its get_rope_index), computed here so the call does not depend on that method's
    signature, which changed between transformers releases."""
    grids = iter(images.kwargs["image_grid_thw"].tolist())
    positions = torch.zeros((3, *ids.shape), dtype=torch.long)
    real = mask.bool().cpu() if mask is not None else torch.ones(ids.shape, dtype=torch.bool)
    for row, (row_ids, row_real) in enumerate(zip(ids.tolist(), real, strict=True)):
        tokens = [t for t, keep in zip(row_ids, row_real.tolist(), strict=True) if keep]
        axes: list[list[int]] = []
        position = at = 0
        while at < len(tokens):
            if tokens[at] != images.token_id:
                axes.append([position] * 3)
                position, at = position + 1, at + 1
                continue
            t, h, w = next(grids)
            h, w = h // images.merge, w // images.merge
            axes += [
                [position + i, position + j, position + k]
                for i in range(t)
                for j in range(h)
                for k in range(w)
            ]
            position, at = position + max(h, w), at + t * h * w
        positions[:, row, row_real] = torch.tensor(axes, dtype=torch.long).T.reshape(3, -1)
    return positions.to(ids.device)
