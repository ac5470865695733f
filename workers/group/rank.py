"""One rank of a worker group (started by the launcher): joins the process group, loads its
share of the base model, then serves as the worker (rank 0) or follows rank 0 (the others)."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from queue_tinker.errors import WorkerGroupError
from queue_tinker.settings import Settings, load_settings
from queue_tinker.storage.configured import open_store
from queue_tinker.workers.executor.lora import GroupRank
from queue_tinker.workers.group.channel import STOP, Channel
from queue_tinker.workers.group.follower import follow
from queue_tinker.workers.group.follower_store import FollowerStore
from queue_tinker.workers.group.leader import LeaderEngine
from queue_tinker.workers.interface import Engine
from queue_tinker.workers.main import lora_executor, resolve_device, run_worker
from queue_tinker.workers.model.base_model import resolve_model_path
from queue_tinker.workers.model.tensor_parallel import Shards
from queue_tinker.workers.sampling.sessions import time_is_up

log = logging.getLogger("queue_tinker.worker.group")

# A follower waits for rank 0's next call as long as the worker idles: the channel's group
# never times out. A rank that dies is noticed by the launcher, which ends the group.
NO_TIMEOUT = timedelta(days=3650)
# Inside a call the ranks meet within moments of each other; one waiting this long at a
# collective means the ranks have parted (a failure on one rank alone): it raises, the rank
# ends, and the launcher ends the group. Long enough for one rank's slow read of a checkpoint.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def rank_device(device: str, rank: int, world: int) -> str:
    """cuda: one GPU a rank (cuda:<rank>); cpu as given (auto is resolved before: cuda where
    torch sees a GPU)."""
    if device != "cuda":
        # The node's cores shared out: each rank's threads would otherwise contend with the
        # others' (and gloo's) for every core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        return device
    if torch.cuda.device_count() < world:
        raise WorkerGroupError(
            f"--ranks {world}: a group on cuda needs a GPU a rank, and this node has "
            f"{torch.cuda.device_count()}"
        )
    torch.cuda.set_device(rank)
    return f"cuda:{rank}"


def join_group(rank: int, world: int, port: int, device: str) -> tuple[Shards, Channel]:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    # Whole tensors travel through host memory: a gloo group beside nccl's.
    host = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else None
    calls = dist.new_group(backend="gloo", timeout=NO_TIMEOUT)
    return Shards(rank, world, host_group=host), Channel(rank, calls)


def serve_rank(
    settings: Settings, rank: int, world: int, port: int, base_model: str, device: str
) -> int:
    device = rank_device(resolve_device(device), rank, world)
    shards, channel = join_group(rank, world, port, device)
    if rank == 0:
        resolve_model_path(base_model, settings.models_dir)  # a built-in is made once, here
    dist.barrier(group=channel.group)
    if rank == 0:
        code = lead(settings, base_model, device, shards, channel)
    else:
        code = follow_rank_0(settings, base_model, device, shards, channel)
    leave_group(channel)
    return code


def leave_group(channel: Channel) -> None:
    """Meet the other ranks once more, then take the process groups down. Left to the
    interpreter's exit, a group's threads were torn down still running: "terminate called
    without an active exception", and a stop that went well ended in SIGABRT."""
    dist.barrier(group=channel.group)
    dist.destroy_process_group()


def lead(settings: Settings, base_model: str, device: str, shards: Shards, channel: Channel) -> int:
    """Rank 0: the worker, with an engine that sends each call to the others; then stop them."""

    def quantum_over(began: float, budget_s: float) -> bool:
        return channel.decide(time_is_up(began, budget_s))

    def build() -> Engine:
        built = lora_executor(settings, base_model, device, GroupRank(shards, quantum_over))
        return LeaderEngine(built.engine(), channel).as_engine()

    code = run_worker(settings, base_model=base_model, device=device, build=build)
    channel.call(STOP)
    return code


def follow_rank_0(
    settings: Settings, base_model: str, device: str, shards: Shards, channel: Channel
) -> int:
    """Ranks 1..N-1: the same engine over their shares, storage they only read, rank 0's
    calls and decisions."""

    def quantum_over(began: float, budget_s: float) -> bool:
        return channel.decide()

    store = FollowerStore(open_store(settings))
    group = GroupRank(shards, quantum_over)
    built = lora_executor(settings, base_model, device, group, store=store)
    log.info("rank %d of %d on %s: following rank 0", shards.rank, shards.world, device)
    follow(built.engine(), channel)
    return 0


def die_with_launcher(launcher_pid: int) -> None:
    """Be killed when the launcher dies (Linux's parent-death signal): a group whose launcher
    was killed has nobody left to end it when one of its ranks dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's own exit still ends them
        return
    if os.getppid() != launcher_pid:  # it died before the signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="queue-tinker worker group rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--launcher", type=int, required=True, help="the launcher's pid")
    args = parser.parse_args(argv)
    die_with_launcher(args.launcher)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s",
    )
    if args.rank != 0:
        # Only rank 0 stops on a signal (it hands its models back, then tells the others).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    try:
        code = serve_rank(
            load_settings(), args.rank, args.ranks, args.port, args.base_model, args.device
        )
    except WorkerGroupError as error:
        raise SystemExit(f"worker group refuses to start: {error.message}") from None
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    # Out without the interpreter's teardown, once everything is flushed: C++ threads of the
    # process groups torn down at exit have aborted a rank that had stopped cleanly.
    os._exit(main())
