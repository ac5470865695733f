"""The sampler's reads of device data on the host, every one through `to_host`: each waits for
the device (on CUDA, for all the work queued before it), so a decode step makes one, of its
tokens, logprobs, stop flags and any top-k logprobs asked for, and a test counts them
(`counting`). And its copies of host values to the device, every one through `to_device`: on
CUDA from pinned memory without blocking, so none waits for the work queued before it (a copy
from pageable memory, as `torch.tensor(values, device=cuda)` makes, synchronises the stream),
counted too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Reads:
    """How many host reads of device data (and copies of host values to the device) were made
    while `counting`."""

    count: int = 0
    copies: int = 0


_lock = threading.Lock()
_counters: list[Reads] = []


def to_host(tensor: torch.Tensor) -> Any:
    """`tensor.tolist()`, counted."""
    with _lock:
        for reads in _counters:
            reads.count += 1
    return tensor.tolist()


def to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, or a tensor on the host) as a `dtype` tensor on `device`, counted: on
    CUDA through pinned memory and a non-blocking copy (torch's caching host allocator keeps
    the pinned block until the copy is done), so the host goes on queueing work."""
    with _lock:
        for reads in _counters:
            reads.copies += 1
    if not isinstance(values, torch.Tensor):
        values = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    if device.type != "cuda":
        return values.to(device=device, dtype=dtype)
    return values.to(dtype).pin_memory().to(device, non_blocking=True)


@contextmanager
def counting() -> Iterator[Reads]:
    """The host reads made in the body, from any thread."""
    reads = Reads()
    with _lock:
        _counters.append(reads)
    try:
        yield reads
    finally:
        with _lock:
            _counters.remove(reads)
