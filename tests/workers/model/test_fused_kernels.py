"""QT_LIGER_KERNELS where liger's kernels cannot run: on refuses at start-up, naming the
setting and what is missing, before any weight is loaded; auto and off leave the model as it
is. (That the kernels compute what the eager model computes is tests/gpu's to show.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import WorkerFitError
from queue_tinker.settings import Settings
from queue_tinker.workers.executor.lora import LoraExecutor
from queue_tinker.workers.model.fused_kernels import liger_wanted

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
INSTALLED = importlib.util.find_spec("liger_kernel") is not None


def test_on_refuses_without_cuda_in_a_group_or_without_liger() -> None:
    with pytest.raises(WorkerFitError, match=r"QT_LIGER_KERNELS=on needs a CUDA device.*cpu"):
        liger_wanted("on", CPU, grouped=False)
    with pytest.raises(WorkerFitError, match=r"QT_LIGER_KERNELS=on is not supported in a worker"):
        liger_wanted("on", CUDA, grouped=True)
    if not INSTALLED:
        with pytest.raises(WorkerFitError, match=r"needs liger-kernel.*queue-tinker\[gpu\]"):
            liger_wanted("on", CUDA, grouped=False)


def test_auto_takes_them_only_on_cuda_alone_where_installed() -> None:
    # auto is the deployment's default: the GPU suite held the kernels to the eager model
    assert Settings.model_fields["liger_kernels"].default == "auto"
    assert liger_wanted("auto", CPU, grouped=False) is False
    assert liger_wanted("auto", CUDA, grouped=True) is False
    assert liger_wanted("auto", CUDA, grouped=False) is INSTALLED
    assert liger_wanted("off", CUDA, grouped=False) is False


def test_a_cpu_worker_asked_for_them_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(WorkerFitError, match="QT_LIGER_KERNELS=on"):
        LoraExecutor(
            "queue-tinker/tiny-llama",
            "cpu",
            tmp_path / "storage",
            tmp_path / "models",
            EngineConfig(liger_kernels="on"),
        )
    assert not (tmp_path / "models").exists()  # refused before any model was made or loaded
