"""Fixtures of the engine tests: scratch directories (with one intra-op thread meanwhile) and the
built-in models' directory."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A scratch directory; one intra-op thread meanwhile: on a tiny model, thread hand-offs
    cost more than the math (and on a busy 2-core box, a hundred times more)."""
    path = Path(tempfile.mkdtemp(prefix="qt-lora-engine-"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield path
    torch.set_num_threads(threads)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def models_dir(scratch: Path) -> Path:
    return scratch / "models"


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    """A scratch directory; one intra-op thread meanwhile (tiny model: thread hand-offs cost
    more than the math on a busy 2-core machine)."""
    path = Path(tempfile.mkdtemp(prefix="qt-cross-batch-"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield path
    torch.set_num_threads(threads)
    shutil.rmtree(path, ignore_errors=True)
