"""Base models for workers: built-ins are made on first use; all load through from_pretrained.

A built-in name (see `queue_tinker.builtin_models`) resolves to a local directory that is created
once (tokenizer + fixed-seed random weights) and then loaded like any downloaded checkpoint; any
other name is passed to `from_pretrained` unchanged (a Hub id or a local path).
"""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from peft import PeftModel
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    FineGrainedFP8Config,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.utils import logging as transformers_logging
from transformers.utils.quantization_config import Mxfp4Config, QuantizationConfigMixin

from queue_tinker.builtin_models import (
    BOS_ID,
    BUILTIN_MODELS,
    EOS_ID,
    IMAGE_PROCESSOR_FILES,
    MODEL_FILES,
    PAD_ID,
    TOKENIZER_FILES,
    builtin_dir,
    has_files,
    is_builtin,
    publish_dir,
    staging_dir,
    write_tokenizer,
)
from queue_tinker.workers.model import vision_language

# The built-in weights are a pure function of (config, seed): every machine makes the same model.
INIT_SEED = 0


def builtin_config(name: str) -> PretrainedConfig:
    spec = BUILTIN_MODELS[name]
    if spec.vision is not None:
        return vision_language.builtin_vl_config(spec)
    return AutoConfig.for_model(
        spec.model_type,
        **spec.config,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def ensure_builtin_model(name: str, models_dir: Path) -> Path:
    """Make sure the built-in model's directory is complete (tokenizer + weights); return it."""
    if not is_builtin(name):
        raise ValueError(f"not a built-in model: {name!r}")
    final = builtin_dir(name, models_dir)
    spec = BUILTIN_MODELS[name]
    processor_files = IMAGE_PROCESSOR_FILES if spec.vision is not None else ()
    if has_files(final, (*TOKENIZER_FILES, *processor_files, *MODEL_FILES)):
        return final
    config = builtin_config(name)
    staging = staging_dir(final)
    try:
        write_tokenizer(staging, spec.special_tokens)
        if spec.vision is not None:
            vision_language.write_image_processor(spec, staging)
        # Init runs on the CPU generator only; fork_rng restores the caller's stream afterwards
        # (and devices=[] keeps CUDA out of it).
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(INIT_SEED)
            model = _model_of(config).float()  # fp32 whatever the default dtype is
        # transformers >= 4.35 (and 5.x, which dropped the flag) saves model.safetensors.
        model.save_pretrained(str(staging))
        del model
        publish_dir(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # left over only if publishing failed
    return final


def _model_of(config: PretrainedConfig) -> PreTrainedModel:
    """A fresh model of the config's architecture: its class itself (not from_config), so
    init draws as it always did."""
    if vision_language.is_vl(config):
        return vision_language.model_of(config)
    architecture = cast(type[PreTrainedModel], MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    return architecture(config)


def resolve_model_path(base_model: str, models_dir: Path) -> str:
    """What to hand to from_pretrained: the built-in directory, else the name unchanged."""
    if is_builtin(base_model):
        return str(ensure_builtin_model(base_model, models_dir))
    return base_model


COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """QT_DTYPE as a torch dtype: auto is bf16 on CUDA (its tensor cores' format) and fp32
    elsewhere (CPUs without bf16 units emulate it, slower than fp32)."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return COMPUTE_DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype: {dtype!r} is not one of auto, {', '.join(COMPUTE_DTYPES)}"
        ) from None


def load_base_model(
    base_model: str,
    device: str,
    models_dir: Path,
    dtype: str = "auto",
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """Load the frozen base model on `device` in `dtype` (auto: bf16 on CUDA, fp32 elsewhere).
    `prepare` gets the model in host memory before it moves to `device` (a worker group's rank
    keeps its share there, so no GPU ever holds the whole model).

    Train/eval mode is left to the caller; dropout is switched off through the config instead,
    so it stays off in either mode.
    """
    path = resolve_model_path(base_model, models_dir)
    config = load_config(path)
    if device.startswith("cuda") and resolve_dtype(dtype, device) == torch.float32:
        # fp32 means fp32: cuDNN's convolutions (a vision tower's patch embedding) default to
        # TF32, whose 10-bit mantissa moved tiny-vl's LoRA gradients 4e-4 from the CPU's.
        torch.backends.cudnn.allow_tf32 = False
    # Typed as a plain Module: transformers' wrapped `.to` confuses type checkers.
    # A vision-language model (a vision_config) is an image-text-to-text model to transformers.
    auto = AutoModelForImageTextToText if vision_language.is_vl(config) else AutoModelForCausalLM
    quantized = dequantized(config)
    model: torch.nn.Module = auto.from_pretrained(
        path,
        config=config,
        dtype=resolve_dtype(dtype, device),
        **({"quantization_config": quantized} if quantized is not None else {}),
    )
    if prepare is not None:
        prepare(model)
    model.to(device)
    model.requires_grad_(False)
    return model


# Quantized checkpoints LoRA cannot train through (transformers refuses to train MXFP4 experts,
# and FP8 blocks have no backward), by their quant_method: their weights are dequantized to the
# compute dtype as they load. Left to itself, transformers keeps MXFP4 where the `kernels`
# package is installed, and dequantizes only where it is not.
_DEQUANTIZED: dict[str, type[QuantizationConfigMixin]] = {
    "mxfp4": Mxfp4Config,
    "fp8": FineGrainedFP8Config,
}


def dequantized(config: PretrainedConfig) -> QuantizationConfigMixin | None:
    """The quantization config to load a checkpoint with, dequantizing; None for a checkpoint
    not quantized (or in a format transformers trains through as it is)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    settings = quantization if isinstance(quantization, dict) else quantization.to_dict()
    kind = _DEQUANTIZED.get(str(settings.get("quant_method")))
    return None if kind is None else kind.from_dict({**settings, "dequantize": True})


def load_config(path: str) -> PretrainedConfig:
    """The config of the model at `path` (from resolve_model_path), dropout off: what the fit
    planner reads before any weight is loaded."""
    config = AutoConfig.from_pretrained(path)
    _zero_dropout(config)
    return config


def _zero_dropout(config: PretrainedConfig) -> None:
    """Set every dropout probability the config declares to 0 (LoRA adds its own dropout)."""
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float) and value != 0.0:
            setattr(config, key, 0.0)


def _config(model: torch.nn.Module) -> PretrainedConfig:
    return cast(PreTrainedModel, model).config


def context_length(model: torch.nn.Module) -> int:
    # get_text_config: a vision-language model's context is its language model's.
    return int(_config(model).get_text_config().max_position_embeddings)


def vocab_size(model: torch.nn.Module) -> int:
    """The width of the logits (the output embedding's rows; config.vocab_size as a fallback)."""
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    if isinstance(head, torch.nn.Module) and isinstance(head.weight, torch.Tensor):
        return int(head.weight.shape[0])
    return int(_config(model).vocab_size)


# A model class's forward parameters, read once per class (a decode step asks every step).
_FORWARD_PARAMETERS: dict[type, frozenset[str]] = {}


def forward_takes(model: torch.nn.Module, keyword: str) -> bool:
    """Whether the model under any PEFT wrapper names `keyword` among its forward's parameters
    (transformers' generation models take `logits_to_keep`; a custom one may not)."""
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    parameters = _FORWARD_PARAMETERS.get(type(inner))
    if parameters is None:
        try:
            parameters = frozenset(inspect.signature(type(inner).forward).parameters)
        except (TypeError, ValueError):
            parameters = frozenset()
        _FORWARD_PARAMETERS[type(inner)] = parameters
    return keyword in parameters


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its KV cache by: `cache` from transformers 5.24
    on (which deprecates `past_key_values`, to be removed in 5.40), `past_key_values` before
    (5.17 on the GPU machines)."""
    return "cache" if forward_takes(model, "cache") else "past_key_values"


def load_frozen_base(
    base_model: str,
    device: str,
    models_dir: Path,
    dtype: str,
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> PreTrainedModel:
    """The base model as a worker serves it: eval mode (no dropout anywhere, so a step is a
    pure function of its inputs), named as users name it (adapter_config.json records that,
    not a local path)."""
    transformers_logging.disable_progress_bar()  # per-shard bars are noise in worker logs
    # A transformers model (from_pretrained), typed as a Module by the loader.
    base = cast(PreTrainedModel, load_base_model(base_model, device, models_dir, dtype, prepare))
    base.eval()
    base.name_or_path = base_model
    return base
