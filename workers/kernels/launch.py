"""How a Triton kernel of this folder is made for a launch: jit-compiled for CUDA tensors,
interpreted for CPU tensors under TRITON_INTERPRET=1 (how CI holds each kernel to its torch
reference). The kernels' sources are plain functions in their own modules, imported only where
Triton is installed (CUDA workers, the tests), so a worker on torch's CPU wheel never needs it."""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

_KERNELS: dict[tuple[str, str, bool], Any] = {}


def interpreting() -> bool:
    """Whether CPU tensors run the Triton kernels under the interpreter (read at each call, so
    a test may set it after import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a kernel launched on x's device runs in Triton: on CUDA, or on the CPU under the
    interpreter; elsewhere (a CPU worker) the caller's torch reference runs."""
    return x.device.type == "cuda" or (x.device.type == "cpu" and interpreting())


def kernel(source: str, name: str, x: torch.Tensor) -> Any:
    """The kernel `name`_kernel of the module `source` of this folder, compiled for CUDA
    tensors, interpreted for CPU ones."""
    interpreted = x.device.type == "cpu"
    if interpreted and not interpreting():
        raise RuntimeError(
            f"the Triton kernel {name} runs on CUDA, or on the CPU under TRITON_INTERPRET=1"
        )
    key = (source, name, interpreted)
    if key not in _KERNELS:
        # Imported here: CUDA workers and the tests have Triton, torch's CPU wheel does not.
        import triton
        from triton.runtime.interpreter import InterpretedFunction

        module = importlib.import_module(f"queue_tinker.workers.kernels.{source}")
        function = getattr(module, f"{name}_kernel")
        _KERNELS[key] = InterpretedFunction(function) if interpreted else triton.jit(function)
    return _KERNELS[key]
