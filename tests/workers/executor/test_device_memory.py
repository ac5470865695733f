"""A pass that runs out of memory is split and retried, never fatal to the worker; an op that
does not fit alone fails with a message naming its tokens and what fits; unset budgets come
from free device memory; a worker whose model, adapters and budgets cannot fit its device
refuses to start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_driver import BASE
from procs import REPO
from transformers import LlamaConfig

from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import WorkerFitError
from queue_tinker.workers.executor import lora
from queue_tinker.workers.executor.lora import LoraExecutor, check_fit
from queue_tinker.workers.model.fit import FitSettings
from queue_tinker.workers.model.memory import budgets_for, device_memory

GIB = 1 << 30


def test_out_of_memory_splits_the_pass_and_names_what_fits(tmp_path: Path) -> None:
    """Under a real allocation limit (RLIMIT_AS, in a process of its own): a pass of two ops
    that does not fit runs as two passes, with the losses each op gets alone; the pass budget
    drops to what fitted; a four-row op fails alone with DeviceMemoryError naming 8192 padded
    tokens and the 2048 that fit; the engine then runs ops as before."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tests/scripts/out_of_memory_pass.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "ran out of memory: splitting it" in done.stderr
    assert all(isinstance(loss, float) for loss in result["pair"]), result["pair"]
    assert result["pair"] == result["again"]  # each op's loss is what it gets alone
    assert result["budget_after_split"] == 2048
    assert result["too_big_is_memory_error"], result["too_big"]
    assert "4 rows x 2048 tokens (8192 padded tokens) do not fit" in result["too_big"]
    assert "largest pass this worker has run held 2048 padded tokens" in result["too_big"]


@pytest.mark.parametrize("checkpointing", [True, False])
def test_budgets_scale_with_free_memory(checkpointing: bool) -> None:
    """Twice the free memory gives twice the training tokens and sampling sequences; the
    sampler's cache gets its share in tokens; a checkpointed pass needs less per token, so
    more tokens fit."""
    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    gib = 1 << 30
    small = budgets_for(config, 20 * gib, 2, checkpointing=checkpointing, lora_copy=4)
    large = budgets_for(config, 40 * gib, 2, checkpointing=checkpointing, lora_copy=4)
    assert large.train_batch_tokens == pytest.approx(2 * small.train_batch_tokens, abs=1)
    assert large.sample_batch_sequences == pytest.approx(2 * small.sample_batch_sequences, abs=1)
    # The sampler's cache: 30% of the usable 80%, at 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    # a token (Llama-3.1-8B in bf16: 128 KiB), and a row cap of that at 4K tokens a sequence.
    assert small.sample_cache_tokens == int(20 * gib * 0.8 * 0.3 // (128 << 10)) == 39321
    assert small.sample_batch_sequences == 39321 // 4096
    plain = budgets_for(config, 20 * gib, 2, checkpointing=False, lora_copy=4)
    assert small.train_batch_tokens >= plain.train_batch_tokens
    assert (
        budgets_for(config, 0, 2, checkpointing=checkpointing, lora_copy=4).train_batch_tokens == 1
    )


def pretend_cuda_memory(monkeypatch: pytest.MonkeyPatch, total: int) -> None:
    """What torch.cuda.mem_get_info answers on a device of `total` bytes (no GPU here); and
    loading the base fails the test: the check comes first."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))

    def no_loading(*args: object) -> None:
        raise AssertionError("the base model was loaded before the fit check")

    monkeypatch.setattr(lora.base_models, "load_frozen_base", no_loading)


def test_a_worker_that_cannot_fit_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a (pretend) CUDA device of 1 GiB, 10,000 resident adapters of the tiny model do not
    fit: the executor refuses before loading any weight, naming the model, the device, each
    part in GiB and the most adapters that fit."""
    pretend_cuda_memory(monkeypatch, GIB)
    with pytest.raises(WorkerFitError) as raised:
        LoraExecutor(
            BASE,
            "cuda",
            tmp_path / "storage",
            tmp_path / "models",
            EngineConfig(max_resident_adapters=10_000),
        )
    message = raised.value.message
    assert message.startswith(f"{BASE} on cuda does not fit: A GPU of 1.00 GiB needs ")
    assert "adapters " in message and "10000 resident of rank 32" in message
    assert "It does not fit: " in message and "QT_MAX_RESIDENT_ADAPTERS=" in message


def test_the_fit_check_passes_a_worker_that_fits_and_skips_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same tiny model at the default settings fits a (pretend) 80 GiB device; on the CPU
    no check is made at all, not even a look at device memory."""
    settings = FitSettings(
        max_resident_adapters=32,
        train_batch_tokens=None,
        sample_cache_tokens=None,
        max_tokens_per_datum=32_768,
        activation_checkpointing="auto",
    )
    pretend_cuda_memory(monkeypatch, 80 * GIB)
    plan = check_fit(BASE, torch.device("cuda"), tmp_path / "models", "auto", settings)
    assert plan is not None and plan.fits and plan.ranks == 1
    fp32 = check_fit(BASE, torch.device("cuda"), tmp_path / "models", "fp32", settings)
    assert fp32 is not None and fp32.weights == 2 * plan.weights  # auto is bf16 on CUDA

    def no_memory_query(device: object = None) -> tuple[int, int]:
        raise AssertionError("the CPU has no device memory to ask about")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_memory_query)
    assert check_fit(BASE, torch.device("cpu"), tmp_path / "models", "auto", settings) is None


def test_unset_resident_adapters_are_sized_to_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where 10,000 set adapters refuse to start, the same count as an unset cap starts with
    as many as the (pretend) 1 GiB device holds, and plans them."""
    settings = FitSettings(
        max_resident_adapters=10_000,
        train_batch_tokens=None,
        sample_cache_tokens=None,
        max_tokens_per_datum=32_768,
        activation_checkpointing="auto",
    )
    pretend_cuda_memory(monkeypatch, GIB)
    models = tmp_path / "models"
    with pytest.raises(WorkerFitError):
        check_fit(BASE, torch.device("cuda"), models, "auto", settings)
    plan = check_fit(BASE, torch.device("cuda"), models, "auto", settings, sized=True)
    assert plan is not None and plan.fits
    assert 1 <= plan.demand.settings.max_resident_adapters < 10_000


def test_a_worker_held_to_fewer_gib_plans_and_allocates_as_on_that_card(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QT_DEVICE_MEMORY_GIB on a (pretend) 141 GiB device: torch's allocator is held to the
    cap's share of it before anything is allocated, and the fit check reads the cap as the
    card's size (here 1 GiB, where 10,000 adapters refuse to start naming a GPU of 1.00 GiB);
    free memory is at most what the cap leaves beside what the process holds."""
    pretend_cuda_memory(monkeypatch, 141 * GIB)
    held: list[tuple[float, object]] = []
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda fraction, device=None: held.append((fraction, device)),
    )
    with pytest.raises(WorkerFitError, match=r"on cuda does not fit: A GPU of 1\.00 GiB needs "):
        LoraExecutor(
            BASE,
            "cuda",
            tmp_path / "storage",
            tmp_path / "models",
            EngineConfig(max_resident_adapters=10_000, device_memory_gib=1),
        )
    assert held == [(pytest.approx(1 / 141), torch.device("cuda"))]
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: GIB // 4)
    cuda = torch.device("cuda")
    assert device_memory(cuda, GIB) == (GIB - GIB // 4, GIB)
    assert device_memory(cuda, None) == (141 * GIB, 141 * GIB)  # no cap: the device
    assert device_memory(cuda, 200 * GIB) == (141 * GIB, 141 * GIB)  # a cap above it: the same
