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

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from queue_tinker.types.checkpoints import META_FILE, PEFT_CONFIG, PEFT_WEIGHTS, CheckpointPath

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


def checkpoint_dir(storage: Path, path: CheckpointPath) -> Path:
    return storage / path.run_id / path.kind.path_segment / path.name


def snapshot_dir(storage: Path, model_id: str) -> Path:
    return storage / model_id / SNAPSHOT


def write_state(
    directory: Path,
    state: AdapterState,
    adapter_config: dict[str, Any],
    *,
    optimizer: bool,
    grads: bool = False,
) -> int:
    """Write `state` to `directory` in one rename (replacing what was there); returns bytes."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        (tmp / PEFT_CONFIG).write_text(json.dumps(adapter_config, indent=2))
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
    return _meta_in(_current(directory))


def read_state(directory: Path, *, optimizer: bool, grads: bool = False) -> AdapterState:
    directory = _current(directory)
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
    the old one is moved aside first because rename() cannot replace a non-empty directory
    (a process that dies between the two renames leaves it there: see _current)."""
    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}-old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
    tmp.rename(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if directory.name == SNAPSHOT:
        _clear_leftovers(directory)


# Only a model's snapshot is ever replaced (named checkpoints are written once), and only its
# directory's siblings are known to be ours alone: the two helpers below look at nothing else.
ABANDONED_AFTER_S = 3600  # far longer than any write takes


def _set_aside(snapshot: Path) -> list[Path]:
    """Earlier versions of a snapshot that writers killed between _replace_dir's two renames
    left moved aside."""
    return list(snapshot.parent.glob(f".{SNAPSHOT}-old-*"))


def _clear_leftovers(snapshot: Path) -> None:
    """Remove what killed writers left beside a snapshot just written: versions moved aside,
    and temporary directories (of writes cut short) once they are long abandoned."""
    for aside in _set_aside(snapshot):
        shutil.rmtree(aside, ignore_errors=True)
    cutoff = time.time() - ABANDONED_AFTER_S
    for leftover in snapshot.parent.glob(f".{SNAPSHOT}-*"):
        with contextlib.suppress(OSError):
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)


def _current(directory: Path) -> Path:
    """Where `directory`'s content is: itself, or, for a snapshot whose replacement was cut
    short between _replace_dir's two renames (its writer was killed there), the previous
    version it had moved aside, which is whole. The next snapshot puts one back in place."""
    if directory.exists() or directory.name != SNAPSHOT:
        return directory
    whole = [
        (meta.seq, aside)
        for aside in _set_aside(directory)
        if (meta := _meta_in(aside)) is not None
    ]
    return max(whole)[1] if whole else directory


def _meta_in(directory: Path) -> CheckpointMeta | None:
    try:
        return CheckpointMeta(**json.loads((directory / META_FILE).read_text()))
    except (FileNotFoundError, NotADirectoryError):
        return None
