"""The ranks of a sharded worker group, driven in-process without Redis: each rank runs the same
ops on its LoraExecutor over its shard of the base model (what the group's broadcast gives it),
and rank 0 reports what it read back. Spawned by tests/workers/model/test_tensor_parallel.py."""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from engine_driver import Driver, batch, run_stepped

from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import RanksPartedError
from queue_tinker.queue.dispatch.dispatcher import Op
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.storage.local import LocalStore
from queue_tinker.types import OpKind, codec
from queue_tinker.types.requests.training import AdamParams
from queue_tinker.types.tensors import ModelInput
from queue_tinker.workers.executor.lora import GroupRank, LoraExecutor
from queue_tinker.workers.group.channel import Channel
from queue_tinker.workers.group.follower import follow
from queue_tinker.workers.group.follower_store import FollowerStore
from queue_tinker.workers.group.leader import LeaderEngine
from queue_tinker.workers.model.memory import Checkpointing
from queue_tinker.workers.model.tensor_parallel import Shards

BASE = "queue-tinker/tiny-llama"


@contextmanager
def spawned_ranks(
    target: Callable[..., None], args: Sequence[tuple[Any, ...]]
) -> Iterator[list[BaseProcess]]:
    """One process a rank, `target(*args[rank])`, started; any still running on the way out
    killed (one left behind would hold the test run open at its exit). Spawned, not forked:
    the test process has threads of its own (torch's, pytest's) that a forked child would
    inherit the locks of, but not the threads."""
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=target, args=rank_args) for rank_args in args]
    for process in ranks:
        process.start()
    try:
        yield ranks
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


def make_engine(
    root: Path, shards: Shards | None, base: str = BASE, checkpointing: Checkpointing = "auto"
) -> LoraExecutor:
    """One process's engine, or a rank's: as in a group, ranks 1..N-1 only read the storage
    (two ranks writing one snapshot's directory raced each other's rename)."""
    store: CheckpointStore = LocalStore(root / "storage")
    if shards is not None and shards.rank != 0:
        store = FollowerStore(store)
    return LoraExecutor(
        base,
        "cpu",
        store,
        root / "models",
        EngineConfig(max_resident_adapters=4, dtype="fp32", activation_checkpointing=checkpointing),
        GroupRank(shards) if shards is not None else None,
    )


def train_script(driver: Driver, steps: int) -> dict[str, Any]:
    """Two models trained a few steps (different seeds and data), grads after each
    forward_backward, whole weights after each step."""
    out: dict[str, Any] = {"losses": [], "grads": [], "weights": []}
    driver.create("a", seed=1)
    driver.create("b", seed=2)
    for step in range(steps):
        for model_id, texts in (("a", batch()[:2]), ("b", batch()[2:])):
            result = driver.fb(model_id, texts)
            out["losses"].append(result.metrics["loss:sum"])
            out["grads"].append(whole(driver, model_id, grads=True))
            driver.step(model_id, AdamParams(learning_rate=1e-2, grad_clip_norm=0.5))
            out["weights"].append(whole(driver, model_id, grads=False))
        del step
    out["saved"] = driver.save("a", "after")
    out["samples"] = greedy_samples(driver, out["saved"])
    return out


def greedy_base_sample(driver: Driver, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the base model alone, as the engine samples them."""
    session = "s-greedy"
    base = driver.engine.base_model
    driver.op(session, OpKind.CREATE_SAMPLING_SESSION, {"tenant_id": "default", "base_model": base})
    body = {
        "prompt": ModelInput.from_ints(prompt).model_dump(),
        "num_samples": 1,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "stop": []},
    }
    driver.seqs[session] += 1
    op = Op(f"{session}:1", session, driver.seqs[session], OpKind.SAMPLE, codec.encode(body))
    (result,) = run_stepped(driver.engine, [op])
    assert not isinstance(result, Exception), result
    tokens: list[int] = codec.decode(result.result)["sequences"][0]["tokens"]
    return tokens


def greedy_samples(driver: Driver, path: str) -> list[list[int]]:
    """Greedy tokens from the base model and from the saved weights (a sampling session each)."""
    tokens = []
    for session, weights in (("s-base", None), ("s-saved", path)):
        driver.op(
            session,
            OpKind.CREATE_SAMPLING_SESSION,
            {"tenant_id": "default", "base_model": driver.engine.base_model, "model_path": weights},
        )
        body = {
            "prompt": ModelInput.from_ints([72, 101, 108]).model_dump(),
            "num_samples": 1,
            "sampling_params": {"max_tokens": 8, "temperature": 0.0},
        }
        driver.seqs[session] += 1
        seq = driver.seqs[session]
        op = Op(f"{session}:{seq}", session, seq, OpKind.SAMPLE, codec.encode(body))
        (result,) = run_stepped(driver.engine, [op])
        assert not isinstance(result, Exception), result
        tokens += [s["tokens"] for s in codec.decode(result.result)["sequences"]]
    return tokens


def whole(driver: Driver, model_id: str, *, grads: bool) -> dict[str, torch.Tensor]:
    """The adapter's whole tensors (gathered from the ranks in a group)."""
    engine = driver.engine
    adapter = engine.pool.adapters[model_id]
    tensors = {
        k: (p.grad if grads else p).detach().clone()
        for k, p in adapter.params.items()
        if not grads or p.grad is not None
    }
    shards = getattr(engine.pool, "shards", None)
    if shards is None:
        return tensors
    from queue_tinker.workers.model import lora_shards

    return lora_shards.gather(tensors, shards, engine.pool.family.tensor_parallel)


def run_rank(
    rank: int,
    world: int,
    root: str,
    port: int,
    steps: int,
    results: Any,
    base: str = BASE,
    checkpointing: Checkpointing = "auto",
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        engine = make_engine(Path(root), Shards(rank, world), base, checkpointing)
        driver = Driver(engine, Path(root) / "storage", base)
        out = train_script(driver, steps)
        if rank == 0:  # pickled by value: a tensor shared by handle dies with this process
            results.put(pickle.dumps(out))
    finally:
        dist.destroy_process_group()


def run_parting_rank(rank: int, root: str, port: int) -> None:
    """Rank 0 leads, rank 1 follows, as in a worker group; rank 1's storage is a directory of
    its own, so the checkpoint rank 0 saves is not there for it to load. Each rank writes how
    far it got to <root>/rank-<rank>/report (written at once: a rank may end in os._exit) and
    ends with the exit status a group rank would."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    channel = Channel(rank, dist.new_group(backend="gloo"), failed_wait_s=3)
    home = Path(root) / f"rank-{rank}"
    engine = make_engine(home, Shards(rank, 2)).engine()

    def report(line: str) -> None:
        with (home / "report").open("a") as out:
            out.write(line + "\n")

    if rank != 0:
        try:
            follow(engine, channel)
        except RanksPartedError as parted:
            report(f"ended: {parted.message}")
            os._exit(1)
        os._exit(0)
    leader = LeaderEngine(engine, channel)
    seqs = {"a": 0}

    def run(kind: OpKind, body: dict[str, Any]) -> Any:
        seqs["a"] += 1
        op = Op(f"a:{seqs['a']}", "a", seqs["a"], kind, codec.encode(body))
        return codec.decode(leader.execute(op).result)

    lora = {"rank": 4, "seed": 1}
    run(OpKind.CREATE_MODEL, {"lora_config": lora, "tenant_id": "default", "base_model": BASE})
    path = run(OpKind.SAVE_STATE, {"name": "saved", "ttl_seconds": None})["path"]
    report(f"saved {path}")
    run(OpKind.LOAD_STATE, {"path": path, "optimizer": True})
    report("went on past the load")
    os._exit(0)
