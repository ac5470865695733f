"""The sampler's reads of device data on the host, every one through `to_host`: each waits for
the device (on CUDA, for all the work queued before it), so a decode step makes one, of its
tokens, logprobs, stop flags and any top-k logprobs asked for, and a test counts them
(`counting`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Reads:
    """How many host reads of device data were made while `counting`."""

    count: int = 0


_lock = threading.Lock()
_counters: list[Reads] = []


def to_host(tensor: torch.Tensor) -> Any:
    """`tensor.tolist()`, counted."""
    with _lock:
        for reads in _counters:
            reads.count += 1
    return tensor.tolist()


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
