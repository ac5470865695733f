"""What a rank takes for ranks that can no longer meet (workers/group/channel.py): a collective
that timed out, a peer gone; not an op's own errors."""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from procs import free_port

from queue_tinker.errors import UserInputError
from queue_tinker.workers.group.channel import collective_failed


def _parted_rank(rank: int, port: int) -> None:
    """Rank 1 waits at an all-reduce rank 0 never makes; exit 0 if what it raised counts as
    a failed collective, 1 if not, 2 if nothing was raised."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=1))
    if rank == 0:
        time.sleep(3)
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(2))
    except Exception as error:
        os._exit(0 if collective_failed(error) else 1)
    os._exit(2)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_collective_the_other_rank_never_makes_counts_as_the_group_failing() -> None:
    """Ranks at different collectives: the one waiting times out, and the error it gets is
    taken for the group's failure (a follower ends on it, and the launcher ends the group)."""
    port = free_port()
    fork = multiprocessing.get_context("fork")
    ranks = [fork.Process(target=_parted_rank, args=(rank, port)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=30)
    assert [p.exitcode for p in ranks] == [0, 0]


def test_an_ops_own_errors_are_not_the_groups() -> None:
    """Errors an op raises alike on every rank leave the group running."""
    assert not collective_failed(UserInputError("data: empty"))
    assert not collective_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not collective_failed(KeyError("checkpoint lacks 2 adapter tensors"))
