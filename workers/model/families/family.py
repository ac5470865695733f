"""What a model family declares: everything the worker asks of an architecture that it cannot
read off the model itself. One module of this folder a family, gathered by the registry
(families/__init__.py); the rest of the worker asks `family_of(config)`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from queue_tinker.workers.model.families.fused_decode import FusedDecoder

# The linears of a Llama-style decoder layer, which most families keep.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorParallel:
    """How a decoder layer's linears split over the ranks of a worker group (Megatron-style):
    `column` ones along their output, `row` ones along their input; the rest whole. The fit
    planner counts a rank's share by it whether or not the worker group can run the split
    (Family.shards)."""

    column: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    row: tuple[str, ...] = ("o_proj", "down_proj")


@dataclass(frozen=True)
class VisionTower:
    """A vision-language family's image side: how its tiny built-in is made."""

    # The model of a config (its class itself, so init draws as it always did).
    model_of: Callable[[PretrainedConfig], PreTrainedModel]
    # A built-in's config from its text model's kwargs, its tower's and its special tokens.
    builtin_config: Callable[[dict[str, Any], dict[str, Any], dict[str, int]], PretrainedConfig]
    # The image processor class (Pillow's implementation) its built-in saves.
    image_processor: Callable[[], type[Any]]


@dataclass(frozen=True)
class Family:
    """One architecture family as the worker serves it."""

    name: str  # as people write it ("Llama 3")
    model_types: frozenset[str]  # config.json's model_type values it serves
    # The linear layers Tinker's train_attn / train_mlp / train_unembed adapt (short names).
    attention: tuple[str, ...] = ATTENTION
    mlp: tuple[str, ...] = MLP
    unembed: tuple[str, ...] = ("lm_head",)
    # Stacked experts' 3-D weights (PEFT's target_parameters), adapted with train_mlp.
    experts: bool = False
    tensor_parallel: TensorParallel = TensorParallel()
    shards: bool = False  # whether a worker group splits it (tensor_parallel.shard_decoder)
    vision: VisionTower | None = None
    # Modules that stay frozen, no LoRA under them (a vision tower: `visual`).
    frozen: tuple[str, ...] = ()
    fused_kernels: bool = False  # whether liger's RMSNorm, RoPE and SwiGLU apply
    # Its decode step in the fused kernels for a model (fused_decode.py), None where it has
    # none or the model does not fit it: the sampler's slots run transformers' layers then.
    decoder: Callable[[PreTrainedModel], FusedDecoder | None] | None = None
    builtins: tuple[str, ...] = ()  # its tiny built-in models (queue_tinker.builtin_models)
