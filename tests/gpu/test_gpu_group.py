"""A worker group of one rank on CUDA (nccl, with its gloo host group): the group's code path
on the device (the split model, the sharded adapter pool, rank 0's decode quanta) gives the
results a plain engine gives. Lent machines have one GPU; the 2-rank equality is shown on the
CPU with gloo (tests/workers/model/test_tensor_parallel.py).

Skipped where torch sees no CUDA device. On a GPU machine:
    python -m pytest -c tests/gpu/pytest.ini tests/gpu
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from queue_tinker.config.engine import EngineConfig
from queue_tinker.types import OpKind, codec
from queue_tinker.types.requests.training import AdamParams, ForwardBackwardInput, LoraConfig
from queue_tinker.types.service.ops import Op
from queue_tinker.types.tensors import ModelInput
from queue_tinker.workers.executor.lora import GroupRank, LoraExecutor
from queue_tinker.workers.group.rank import join_group
from queue_tinker.workers.model.tensor_parallel import Shards

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (torch.cuda.is_available() is False)",
    ),
]

BASE = "queue-tinker/tiny-llama"


def _ops(engine: LoraExecutor) -> list[float]:
    """create, 3 x (forward_backward, optim_step); the losses."""
    from queue_tinker.types.tensors import Datum

    ids = list(b"a group of one on the gpu")
    datum = Datum(
        model_input=ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": torch.tensor(ids[1:]).numpy()},
    )
    body = {"lora_config": LoraConfig(rank=4, seed=2).model_dump(), "tenant_id": "t"}
    body["base_model"] = BASE
    seq = 0

    def run(kind: OpKind, payload: object) -> object:
        nonlocal seq
        seq += 1
        op = Op(f"m:{seq}", "m", seq, kind, codec.encode(payload))
        return codec.decode(engine.execute(op).result)

    run(OpKind.CREATE_MODEL, body)
    losses = []
    for _ in range(3):
        out = run(
            OpKind.FORWARD_BACKWARD,
            ForwardBackwardInput(data=[datum], loss_fn="cross_entropy").model_dump(),
        )
        losses.append(out["metrics"]["loss:sum"])  # type: ignore[index]
        run(OpKind.OPTIM_STEP, AdamParams(learning_rate=1e-2).model_dump())
    return losses


def test_a_one_rank_group_on_cuda_trains_as_a_plain_engine() -> None:
    """nccl joins, the split model and the group's adapter pool train to a plain engine's
    losses (fp32, 1e-5)."""
    root = Path(tempfile.mkdtemp(prefix="qt-gpu-group-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        shards, _ = join_group(0, 1, port, "cuda:0")
        assert isinstance(shards, Shards)
        plain = LoraExecutor(
            BASE, "cuda:0", root / "a", root / "models", EngineConfig(dtype="fp32")
        )
        group = LoraExecutor(
            BASE,
            "cuda:0",
            root / "b",
            root / "models",
            EngineConfig(dtype="fp32"),
            GroupRank(shards),
        )
        torch.testing.assert_close(_ops(group), _ops(plain), rtol=1e-5, atol=1e-5)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
