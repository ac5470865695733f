"""Counting what a piece of engine code asks of torch: every aten call (a kernel launch each on
a GPU) and the reads that wait for the device (a scalar read, or a copy from a CUDA tensor to
the host). Reads made by transformers' own code (its attention-mask check) are not the
engine's and are left out."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class AtenCalls(TorchDispatchMode):
    """Meanwhile: `count` aten calls; `reads`, where each device-waiting read was made."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default or _to_host(out, args):
            stack = traceback.extract_stack()
            if not any("transformers/" in frame.filename for frame in stack):
                caller = next(f for f in reversed(stack) if _engines(f.filename))
                self.reads.append(f"{func} at {caller.name}:{caller.lineno}")
        return out


def _engines(filename: str) -> bool:
    return "torch/" not in filename and filename != __file__


def _to_host(out: Any, args: tuple[Any, ...]) -> bool:
    return (
        isinstance(out, torch.Tensor)
        and out.device.type == "cpu"
        and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    )
