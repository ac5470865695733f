"""Adapter state in checkpoint storage: Hugging Face PEFT format plus the optimizer, visible
only once whole (queue_tinker/storage: a directory or an S3 bucket).

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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from queue_tinker.age import encrypt_in_place
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.storage.local import current
from queue_tinker.types.service.checkpoints import (
    META_FILE,
    PEFT_CONFIG,
    PEFT_FILES,
    PEFT_WEIGHTS,
    CheckpointPath,
)

WEIGHTS = PEFT_WEIGHTS
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
    public: bool = False  # published: every tenant may sample from it or load it
    context_cap: int | None = None  # the run's :peft:<tokens> cap (snapshots)
    optimizer_steps: dict[str, int] = field(default_factory=dict)  # per tensor, as AdamW keeps
    # Snapshots written by an op (periodic, load_state): that op's outcome, published from
    # here by the next owner if the writer died before publishing it (lora_engine.py).
    op_result: dict[str, Any] | None = None
    # Snapshots written inside a batch of ops: the outcomes of the model's earlier ops of that
    # batch (seq -> result or error), not yet published then; kept for the same reason.
    batch_results: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class AdapterState:
    """Everything needed to rebuild one adapter, on CPU."""

    meta: CheckpointMeta
    weights: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def checkpoint_key(path: CheckpointPath) -> str:
    """Where a named checkpoint lives in checkpoint storage."""
    return path.storage_key


def snapshot_key(model_id: str) -> str:
    return f"{model_id}/{SNAPSHOT}"


def checkpoint_dir(storage: Path, path: CheckpointPath) -> Path:
    """A named checkpoint's directory in local storage (LocalStore's layout)."""
    return storage / checkpoint_key(path)


def snapshot_dir(storage: Path, model_id: str) -> Path:
    return storage / snapshot_key(model_id)


def write_state(
    store: CheckpointStore,
    key: str,
    state: AdapterState,
    adapter_config: dict[str, Any],
    *,
    optimizer: bool,
    grads: bool = False,
    encrypt_to: Sequence[str] = (),
    expect: str | None = None,
) -> int:
    """Write `state` as the file set at `key` (replacing what was there), visible only once
    complete; the PEFT files encrypted to `encrypt_to` when given; only over the version
    `expect` names, if given (CheckpointStore.commit). Returns bytes written."""
    staged = store.staging(key)
    try:
        (staged / PEFT_CONFIG).write_text(json.dumps(adapter_config, indent=2))
        save_file(_contiguous(state.weights), staged / WEIGHTS)
        if optimizer:
            moments = {f"{k}.exp_avg": v for k, v in state.exp_avg.items()}
            moments |= {f"{k}.exp_avg_sq": v for k, v in state.exp_avg_sq.items()}
            save_file(_contiguous(moments), staged / OPTIMIZER)
        if grads and state.grads:
            save_file(_contiguous(state.grads), staged / GRADS)
        if encrypt_to:
            encrypt_in_place(staged, PEFT_FILES, encrypt_to)
        (staged / META_FILE).write_text(json.dumps(asdict(state.meta), indent=2))
        size = sum(f.stat().st_size for f in staged.iterdir())
    except BaseException:
        store.discard(staged)
        raise
    store.commit(key, staged, expect)
    return size


def stored_meta(store: CheckpointStore, key: str) -> CheckpointMeta | None:
    """The meta of the file set at `key`, as stored now; None if there is none."""
    text = store.read_meta_text(key)
    return CheckpointMeta(**json.loads(text)) if text is not None else None


def stored_meta_version(
    store: CheckpointStore, key: str
) -> tuple[CheckpointMeta | None, str | None]:
    """stored_meta, and the version a write over exactly that set expects."""
    text, version = store.read_meta_version(key)
    return (CheckpointMeta(**json.loads(text)) if text is not None else None), version


def stored_state(
    store: CheckpointStore, key: str, *, optimizer: bool, grads: bool = False
) -> AdapterState:
    """The file set at `key` as adapter state (fetched into the local cache where storage is
    remote); FileNotFoundError if there is none."""
    directory = store.fetch(key)
    if directory is None:
        raise FileNotFoundError(store.location(key))
    return read_state(directory, optimizer=optimizer, grads=grads)


def read_meta(directory: Path) -> CheckpointMeta | None:
    """The meta of a local checkpoint directory (one whose replacement a kill cut short: the
    version it had moved aside)."""
    try:
        return CheckpointMeta(**json.loads((current(directory) / META_FILE).read_text()))
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_state(directory: Path, *, optimizer: bool, grads: bool = False) -> AdapterState:
    """A local checkpoint directory as adapter state."""
    directory = current(directory)
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
