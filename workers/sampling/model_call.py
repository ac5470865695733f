"""The decode loop's model call (its runner's forward): logits of (rows, positions) ids under
each row's adapter, one step's LoRA layers and their matmuls' dtype held for the step. The
prefill helpers (prefix_prefill.py, image_prefill.py) are handed this object, not the loop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from peft import PeftModel
from transformers import DynamicCache

from queue_tinker.workers.model.base_model import cache_keyword, forward_takes
from queue_tinker.workers.model.lora.row_blocks import LoraLayer, blocks_of, row_blocks


@dataclass(frozen=True)
class ModelCall:
    """One step's model call."""

    layers: Sequence[LoraLayer] = ()  # the model's LoRA layers (row_blocks.lora_layers_of)
    lora_compute: torch.dtype | None = None  # their matmuls' dtype (None: the adapters' own)

    def __call__(
        self,
        model: torch.nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        adapters: list[str],
        last_only: bool = False,
        extra: Mapping[str, object] | None = None,
    ) -> torch.Tensor:
        kwargs: dict[str, object] = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": positions,
            cache_keyword(model): cache,
            "use_cache": True,
            **(extra or {}),  # a prompt's images (image_prefill.py)
        }
        if last_only and forward_takes(model, "logits_to_keep"):
            kwargs["logits_to_keep"] = 1  # the prompt's other logits are never read
        if not isinstance(model, PeftModel):
            return model(**kwargs).logits
        # PeftModel.forward uses its active adapter: row_blocks replaces every LoRA layer's
        # forward meanwhile, so each row gets its own adapter's update (the base's: none).
        with row_blocks(self.layers, blocks_of((name, 1) for name in adapters), self.lora_compute):
            return model(**kwargs).logits
