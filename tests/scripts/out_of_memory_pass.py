"""Real out-of-memory failures for the device-memory test, in a process of their own.

Usage: out_of_memory_pass.py SCRATCH_DIR
Builds a one-layer Llama with a 32k vocabulary (a pass's memory is then its logits: a few
copies of rows x tokens x vocab fp32, ~1 GiB per 2,048-token row), measures what a one-row
pass adds to the address space, caps the process's address space (RLIMIT_AS) at 1.4 times
that, and runs LoraExecutor batches that do not fit. Prints one JSON object with what happened.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import DeviceMemoryError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.requests.training import ForwardBackwardInput, LoraConfig
from queue_tinker.types.service.ops import Op
from queue_tinker.types.tensors import Datum, ModelInput
from queue_tinker.workers.executor.lora import LoraExecutor

VOCAB = 32_768
TOKENS = 2_048


def build_model(directory: Path) -> None:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4 * TOKENS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))


def data(rows: int, seed: int) -> list[Datum]:
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (rows, TOKENS + 1))
    return [
        Datum(
            model_input=ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:].astype(np.int64)},
        )
        for row in tokens
    ]


class Ops:
    def __init__(self) -> None:
        self.seqs: dict[str, int] = {}

    def op(self, model_id: str, kind: OpKind, body: Any) -> Op:
        self.seqs[model_id] = self.seqs.get(model_id, 0) + 1
        seq = self.seqs[model_id]
        return Op(
            job_id=f"{model_id}:{seq}",
            model_id=model_id,
            seq=seq,
            kind=kind,
            payload=codec.encode(body),
        )

    def fb(self, model_id: str, rows: int, seed: int) -> Op:
        body = ForwardBackwardInput(data=data(rows, seed), loss_fn="cross_entropy")
        return self.op(model_id, OpKind.FORWARD_BACKWARD, body.model_dump())

    def forward(self, model_id: str, rows: int, seed: int) -> Op:
        body = ForwardBackwardInput(data=data(rows, seed), loss_fn="cross_entropy")
        return self.op(model_id, OpKind.FORWARD, body.model_dump())


def loss(outcome: Any) -> float | str:
    if isinstance(outcome, Exception):
        return f"{type(outcome).__name__}: {outcome}"
    return float(codec.decode(outcome.result)["metrics"]["loss:sum"])


def address_space(field: str = "VmSize") -> int:
    """This process's virtual memory now (VmSize) or at its peak (VmPeak), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)  # no thread arenas appearing once the cap is set
    scratch = Path(sys.argv[1])
    build_model(scratch / "model")
    engine = LoraExecutor(
        str(scratch / "model"),
        "cpu",
        scratch / "storage",
        scratch / "models",
        EngineConfig(
            activation_checkpointing="off", logit_chunk_elements=1 << 40, train_batch_tokens=1 << 20
        ),
    )
    ops = Ops()
    for model_id in ("a", "b", "c"):
        create = {
            "lora_config": LoraConfig(rank=4, seed=1).model_dump(),
            "tenant_id": "t",
            "base_model": engine.base_model,
        }
        engine.execute(ops.op(model_id, OpKind.CREATE_MODEL, create))
        engine.execute(ops.fb(model_id, 1, seed=99))  # warm up: every allocation path once
    before = address_space()
    engine.execute(ops.fb("a", 1, seed=98))
    one_row = address_space("VmPeak") - before
    cap = before + int(1.4 * one_row)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))  # the soft limit: lifted again below
    # Two one-row ops: one pass of both does not fit, each alone does.
    pair = engine.training.rounds.execute_batch([ops.fb("a", 1, seed=1), ops.fb("b", 1, seed=2)])
    budget_after_split = engine.training.rounds.guard.train_batch_tokens
    # One op of four rows does not fit even alone.
    too_big = engine.training.rounds.execute_batch([ops.fb("c", 4, seed=3)])
    # The worker goes on: the same data as a's and b's ops, forward only, one at a time.
    again = [
        engine.execute(ops.forward(model_id, 1, seed)) for model_id, seed in (("a", 1), ("b", 2))
    ]
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    print(
        json.dumps(
            {
                "pair": [loss(o) for o in pair],
                "budget_after_split": budget_after_split,
                "too_big": loss(too_big[0]),
                "too_big_is_memory_error": isinstance(too_big[0], DeviceMemoryError),
                "again": [loss(o) for o in again],
                "largest_pass": engine.training.rounds.guard.largest_pass,
                "one_row_bytes": one_row,
            }
        )
    )


if __name__ == "__main__":
    main()
