"""Adapter state on disk: Hugging Face PEFT format plus the optimizer, written atomically.

A directory holds
    adapter_config.json, adapter_model.safetensors   what PeftModel.from_pretrained reads
    optimizer.safetensors                             AdamW moments (state checkpoints, snapshots)
    grads.safetensors                                 accumulated gradients (snapshots only)
    qt_meta.json                                      ours: run, seq, step, expiry, ...
Tensors are keyed by PEFT's state-dict names (the adapter name taken out), so a directory
written for one model loads into another with the same LoRA config.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from queue_tinker.types.checkpoints import META_FILE, CheckpointPath

WEIGHTS = "adapter_model.safetensors"
OPTIMIZER = "optimizer.safetensors"
GRADS = "grads.safetensors"
SNAPSHOT = "_snapshot"  # a model's own latest state: eviction, hand-over, periodic


@dataclass
class CheckpointMeta:
    model_id: str
    tenant_id: str
    base_model: str
    lora_config: dict[str, Any]
    seq: int  # the op that wrote it: a replayed save finds its own work already done
    step: int  # optimizer steps taken
    created_at: float
    kind: str = "snapshot"  # "state", "sampler" or "snapshot"
    id: str | None = None  # tinker:// path for named checkpoints
    expires_at: float | None = None
    optimizer_steps: dict[str, int] = field(default_factory=dict)  # per tensor, as AdamW keeps


@dataclass
class AdapterState:
    """Everything needed to rebuild one adapter, on CPU."""

    meta: CheckpointMeta
    weights: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def checkpoint_dir(storage: Path, path: CheckpointPath) -> Path:
    return storage / path.run_id / path.kind.path_segment / path.name


def snapshot_dir(storage: Path, model_id: str) -> Path:
    return storage / model_id / SNAPSHOT


def write_state(
    directory: Path, state: AdapterState, adapter_config: dict[str, Any], *, optimizer: bool,
    grads: bool = False,
) -> int:
    """Write `state` to `directory` in one rename (replacing what was there); returns bytes."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        save_file(_contiguous(state.weights), tmp / WEIGHTS)
        if optimizer:
            moments = {f"{k}.exp_avg": v for k, v in state.exp_avg.items()}
            moments |= {f"{k}.exp_avg_sq": v for k, v in state.exp_avg_sq.items()}
            save_file(_contiguous(moments), tmp / OPTIMIZER)
        if grads and state.grads:
            save_file(_contiguous(state.grads), tmp / GRADS)
        (tmp / META_FILE).write_text(json.dumps(asdict(state.meta), indent=2))
        size = sum(f.stat().st_size for f in tmp.iterdir())
        _replace_dir(tmp, directory)
        return size
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_meta(directory: Path) -> CheckpointMeta | None:
    try:
        return CheckpointMeta(**json.loads((directory / META_FILE).read_text()))
    except FileNotFoundError:
        return None


def read_state(directory: Path, *, optimizer: bool, grads: bool = False) -> AdapterState:
    meta = read_meta(directory)
    if meta is None:
        raise FileNotFoundError(directory / META_FILE)
    state = AdapterState(meta=meta, weights=load_file(directory / WEIGHTS))
    if optimizer and (directory / OPTIMIZER).exists():
        for key, value in load_file(directory / OPTIMIZER).items():
            name, _, moment = key.rpartition(".")
            (state.exp_avg if moment == "exp_avg" else state.exp_avg_sq)[name] = value
    if grads and (directory / GRADS).exists():
        state.grads = load_file(directory / GRADS)
    return state


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def _replace_dir(tmp: Path, directory: Path) -> None:
    """Swap `tmp` in for `directory`. A reader sees the old or the new one, never a mix;
    the old one is moved aside first because rename() cannot replace a non-empty directory."""
    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}-old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
    tmp.rename(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
