"""Tensor parallelism of the base model (model/tensor_parallel.py, lora_shards.py,
sharded_adapters.py): the split itself without processes, then two gloo ranks running the
engine's own ops against one process running them alone."""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import Driver
from group_ranks import make_engine, run_rank, spawned_ranks, train_script
from procs import free_port
from transformers import AutoConfig

from queue_tinker.workers.model import lora_shards
from queue_tinker.workers.model.base_model import ensure_builtin_model
from queue_tinker.workers.model.families import family_of
from queue_tinker.workers.model.memory import Checkpointing
from queue_tinker.workers.model.tensor_parallel import ShardingError, Shards, check_shardable

KEY = "base_model.model.model.layers.0.{}.{}.weight"
PLAN = family_of("llama").tensor_parallel
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize(
    ("layer", "matrix", "dim", "partial"),
    [
        ("self_attn.q_proj", "lora_A", None, True),
        ("self_attn.q_proj", "lora_B", 0, False),
        ("mlp.up_proj", "lora_B", 0, False),
        ("self_attn.o_proj", "lora_A", 1, False),
        ("self_attn.o_proj", "lora_B", None, True),
        ("mlp.down_proj", "lora_A", 1, False),
    ],
)
def test_lora_tensors_follow_their_layers_split(
    layer: str, matrix: str, dim: int | None, partial: bool
) -> None:
    """B of a column-parallel layer and A of a row-parallel one are split; the other is whole
    and its gradient comes in parts; the unembedding's LoRA is whole on every rank."""
    key = KEY.format(layer, matrix)
    assert lora_shards.shard_dim(key, PLAN) == dim
    assert lora_shards.partial_grad(key, PLAN) is partial
    head = "base_model.model.lm_head.lora_B.weight"
    assert lora_shards.shard_dim(head, PLAN) is None and not lora_shards.partial_grad(head, PLAN)


def test_split_parts_join_to_the_whole() -> None:
    """The ranks' parts of a tensor, put side by side, are the tensor."""
    whole = {KEY.format("self_attn.q_proj", "lora_B"): torch.arange(32.0).reshape(8, 4)}
    whole[KEY.format("mlp.down_proj", "lora_A")] = torch.arange(24.0).reshape(4, 6)
    parts = [lora_shards.split(whole, Shards(rank, 2), PLAN) for rank in range(2)]
    for key, tensor in whole.items():
        dim = lora_shards.shard_dim(key, PLAN)
        assert dim is not None
        assert torch.equal(torch.cat([p[key] for p in parts], dim=dim), tensor)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 1}, "num_key_value_heads=1"),
        ({"intermediate_size": 129}, "intermediate_size=129"),
        ({"model_type": "qwen3_moe"}, "mixture-of-experts"),
        ({"model_type": "gpt2"}, "'gpt2'"),
    ],
)
def test_a_model_the_group_cannot_split_is_refused_by_name(
    changes: dict[str, Any], named: str
) -> None:
    """Heads or MLP width not divisible by the ranks, experts, other architectures: refused
    with the setting named."""
    if changes.get("model_type") == "qwen3_moe":
        config = AutoConfig.for_model("qwen3_moe", num_experts=4)
    elif changes.get("model_type") == "gpt2":
        config = AutoConfig.for_model("gpt2")
    else:
        base = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
        config = AutoConfig.for_model("llama", **{**base, **changes})
    with pytest.raises(ShardingError, match=named):
        check_shardable(config, 2)


@pytest.mark.timeout(300)  # two fresh interpreters import torch: ~30 s beside a busy suite
@pytest.mark.parametrize(
    ("base", "checkpointing"),
    [("queue-tinker/tiny-llama", "auto"), ("queue-tinker/tiny-qwen3", "selective")],
)
def test_two_ranks_train_and_sample_as_one_process(
    scratch: Path, base: str, checkpointing: Checkpointing
) -> None:
    """Two gloo ranks, each with half of every attention and MLP matrix, run the same ops as
    one process: losses, whole LoRA gradients (clipped), weights after AdamW and greedy
    samples from the base and from saved weights equal one process's (fp32, 1e-5), and the
    saved checkpoint's files hold the same tensors. On Llama and on Qwen3 (whose q / k norms
    over each head's width a rank's share of the heads keeps whole), the latter with every
    layer checkpointed selectively: backward remakes each layer's elementwise work, and the
    collectives in it, on both ranks alike."""
    ensure_builtin_model(base, scratch / "models")  # made once, not raced
    home = scratch / base.rsplit("/", 1)[-1]  # one a base: the module's scratch is shared
    home.mkdir()
    group_root, alone_root = home / "group", home / "alone"
    for root in (group_root, alone_root):
        root.mkdir()
        (root / "models").symlink_to(scratch / "models")
    results = multiprocessing.get_context("spawn").Queue()
    port = free_port()
    args = [(rank, 2, str(group_root), port, 2, results, base, checkpointing) for rank in range(2)]
    with spawned_ranks(run_rank, args) as ranks:
        alone_engine = make_engine(alone_root, None, base, checkpointing)
        alone_driver = Driver(alone_engine, alone_root / "storage", base)
        alone = train_script(alone_driver, 2)
        group = pickle.loads(results.get(timeout=240))
        for process in ranks:
            process.join(timeout=30)
            assert process.exitcode == 0
    torch.testing.assert_close(group["losses"], alone["losses"], **CLOSE)
    for name in ("grads", "weights"):
        for got, want in zip(group[name], alone[name], strict=True):
            assert got.keys() == want.keys()
            for key in want:
                torch.testing.assert_close(got[key], want[key], **CLOSE)
    assert group["samples"] == alone["samples"]
    saved = (
        lora_shards_files(group_root, group["saved"]),
        lora_shards_files(alone_root, alone["saved"]),
    )
    assert saved[0].keys() == saved[1].keys()
    for key in saved[1]:
        torch.testing.assert_close(saved[0][key], saved[1][key], **CLOSE)


def lora_shards_files(root: Path, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (weights,) = (root / "storage").rglob(f"*{path.rsplit('/', 1)[-1]}*/adapter_model.safetensors")
    return load_file(str(weights))


def _lone_pool(models_dir: Path, shards: Shards | None) -> Any:
    """An adapter pool on the tiny model: plain, or a group's of one rank (no process group:
    a group of one needs no collective)."""
    import copy

    from queue_tinker.workers.model.adapters import AdapterPool
    from queue_tinker.workers.model.base_model import load_frozen_base
    from queue_tinker.workers.model.sharded_adapters import ShardedAdapterPool
    from queue_tinker.workers.model.tensor_parallel import shard_decoder

    base = load_frozen_base("queue-tinker/tiny-llama", "cpu", models_dir, "fp32")
    if shards is None:
        return AdapterPool(base, "queue-tinker/tiny-llama", 4)
    whole = copy.deepcopy(base.config)
    shard_decoder(base, shards)
    return ShardedAdapterPool(base, "queue-tinker/tiny-llama", 4, shards, whole)


def test_a_fresh_adapter_in_a_group_starts_where_one_process_starts(models_dir: Path) -> None:
    """A group's first weights come from PEFT's draws on a weightless model of the whole
    shapes: the same tensors a one-process pool draws from the seed, for a first adapter and
    for one added beside it."""
    from queue_tinker.types.requests.training import LoraConfig

    plain, grouped = _lone_pool(models_dir, None), _lone_pool(models_dir, Shards(0, 1))
    for model_id, seed in (("first", 3), ("second", 4)):
        config = LoraConfig(rank=4, seed=seed, train_unembed=True)
        want = plain.add(model_id, "t", config, seed).params
        got = grouped.add(model_id, "t", config, seed).params
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_a_group_refuses_dimuon_runs_by_name(models_dir: Path) -> None:
    """Dimuon orthogonalises whole LoRA matrices, which a group splits: create_model fails as
    the user's, naming the field."""
    from queue_tinker.errors import UserInputError
    from queue_tinker.types.enums import Optimizer
    from queue_tinker.types.requests.training import LoraConfig

    grouped = _lone_pool(models_dir, Shards(0, 1))
    with pytest.raises(UserInputError, match=r"lora_config\.optimizer: 'dimuon'"):
        grouped.add("m", "t", LoraConfig(rank=4, seed=1, optimizer=Optimizer.DIMUON), 1)
