"""liger-kernel's Triton kernels in the base model (QT_LIGER_KERNELS): its RMSNorm, RoPE and
SwiGLU in place of transformers' eager ones, for the architectures liger knows (Llama, Qwen,
Mistral, Gemma and others, by `model_type`). At the Llama-3.1-8B shape on an H100 they made the
training pass 1.19x faster on top of the worker's plan (bench.mfu, docs/benchmarks.md). The
unembedding and its loss stay the engine's own: logprobs are computed in chunks there
(model_pass.py), which liger's fused linear cross-entropy would replace with a loss alone.

liger is an optional dependency (the `gpu` extra; Triton, CUDA only). It patches the model
instance's modules (and transformers' rotary function for its architecture) for the life of
the process: a worker serves one base model.

liger's RoPE rotates q and k in place wherever they are contiguous, which they are when they
are a projection's own output (a q_proj without LoRA): a selectively checkpointed layer keeps
that output for backward (training/model_pass.keeps_wide_gemms), and a Triton kernel's write
bumps no version counter, so torch would not see it and the recomputation would rotate the
kept q and k a second time. Here the rotary function gets copies of q and k (rotating_copies):
two copies a layer, far fewer bytes than transformers' eager RoPE moves.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from collections.abc import Callable
from typing import Any, Literal

import torch

from queue_tinker.errors import WorkerFitError
from queue_tinker.workers.model.families import family_of

log = logging.getLogger(__name__)
LigerKernels = Literal["auto", "on", "off"]
# transformers' rotary functions, by the names its modeling modules give them, that liger
# replaces with its in-place kernels.
ROTARY_FUNCTIONS = ("apply_rotary_pos_emb", "apply_multimodal_rotary_pos_emb")


def liger_wanted(setting: LigerKernels, device: torch.device, *, grouped: bool) -> bool:
    """Whether to put liger's kernels in: on asks for them (a clear error where they cannot
    run); auto takes them on CUDA where liger is installed; off never. Not in a worker group's
    ranks, whose decoder layers are split across GPUs (tensor_parallel.py): liger's fused
    modules there are untested."""
    installed = importlib.util.find_spec("liger_kernel") is not None
    if setting == "on" and grouped:
        raise WorkerFitError(
            "QT_LIGER_KERNELS=on is not supported in a worker group (worker --ranks N > 1): "
            "set it to auto or off"
        )
    if setting == "on":
        if device.type != "cuda":
            raise WorkerFitError(
                f"QT_LIGER_KERNELS=on needs a CUDA device (liger's kernels are Triton), not "
                f"{device.type}: set it to auto or off"
            )
        if not installed:
            raise WorkerFitError(
                "QT_LIGER_KERNELS=on needs liger-kernel, which is not installed: "
                "pip install 'queue-tinker[gpu]', or set it to auto or off"
            )
        return True
    return setting == "auto" and device.type == "cuda" and installed and not grouped


def apply_liger(model: torch.nn.Module) -> bool:
    """liger's RMSNorm, RoPE and SwiGLU into this transformers model; False (and a log line)
    for an architecture liger does not know."""
    from liger_kernel.transformers.monkey_patch import (  # type: ignore[import-not-found]
        MODEL_TYPE_TO_APPLY_LIGER_FN,
        _apply_liger_kernel_to_instance,
    )

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = family_of(model_type or "")
    if not family.fused_kernels:
        log.info("liger's kernels do not fit %s models: the model stays as it is", family.name)
        return False
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        log.info("liger has no kernels for model type %s: the model stays as it is", model_type)
        return False
    _apply_liger_kernel_to_instance(
        model,
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )
    rope_on_copies(sys.modules[type(model).__module__])
    log.info("liger's RMSNorm, RoPE and SwiGLU are in the %s model", model_type)
    return True


def rope_on_copies(modeling: Any) -> None:
    """The modeling module's rotary functions that are liger's, given copies of q and k."""
    for name in ROTARY_FUNCTIONS:
        rope = getattr(modeling, name, None)
        if rope is not None and getattr(rope, "__module__", "").startswith("liger_kernel"):
            setattr(modeling, name, rotating_copies(rope))


def rotating_copies(rope: Callable[..., Any]) -> Callable[..., Any]:
    """`rope` applied to copies of q and k, which it may then overwrite: the tensors it is
    given (a projection's output a selective layer keeps) stay as they were."""

    @functools.wraps(rope)
    def rotated(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return rope(q.clone(), k.clone(), *args, **kwargs)

    return rotated
