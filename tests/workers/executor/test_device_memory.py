"""A pass that runs out of memory is split and retried, never fatal to the worker; an op that
does not fit alone fails with a message naming its tokens and what fits; unset budgets come
from free device memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from procs import REPO
from transformers import LlamaConfig

from queue_tinker.workers.model.memory import budgets_for


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
    small = budgets_for(config, 20 * gib, 2, checkpointing=checkpointing)
    large = budgets_for(config, 40 * gib, 2, checkpointing=checkpointing)
    assert large.train_batch_tokens == pytest.approx(2 * small.train_batch_tokens, abs=1)
    assert large.sample_batch_sequences == pytest.approx(2 * small.sample_batch_sequences, abs=1)
    # The sampler's cache: 30% of the usable 80%, at 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    # a token (Llama-3.1-8B in bf16: 128 KiB), and a row cap of that at 4K tokens a sequence.
    assert small.sample_cache_tokens == int(20 * gib * 0.8 * 0.3 // (128 << 10)) == 39321
    assert small.sample_batch_sequences == 39321 // 4096
    plain = budgets_for(config, 20 * gib, 2, checkpointing=False)
    assert small.train_batch_tokens >= plain.train_batch_tokens
    assert budgets_for(config, 0, 2, checkpointing=checkpointing).train_batch_tokens == 1
