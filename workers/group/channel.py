"""What rank 0 tells the other ranks of a worker group: each engine call, in order, and each
decision that depends on time (when a decode quantum ends), so every rank does the same work
in the same order and their collectives meet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

LEADER = 0
# What a failed collective's RuntimeError names (torch raises no type of its own for gloo's).
COLLECTIVE_BACKENDS = ("gloo", "nccl", "ProcessGroup")


def collective_failed(error: BaseException) -> bool:
    """Whether `error` is a collective that failed (timed out, a peer gone): the ranks can no
    longer meet, and the group must end."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(
        backend in str(error) for backend in COLLECTIVE_BACKENDS
    )


@dataclass(frozen=True)
class Call:
    """One engine method and its arguments, as rank 0 called it."""

    part: str  # the Engine field: ops, batches, stepped, durability
    method: str
    args: tuple[Any, ...]


# Sent when the group stops: the followers leave their loop.
STOP = Call("", "stop", ())


class Channel:
    """Broadcasts from rank 0 over a gloo group (pickled objects and a flag travel through
    host memory whatever the compute's backend)."""

    def __init__(self, rank: int, group: Any = None) -> None:
        self.rank = rank
        self.group = group

    @property
    def leads(self) -> bool:
        return self.rank == LEADER

    def call(self, call: Call | None = None) -> Call:
        """Rank 0: send `call`; the others: receive it (blocks until rank 0 sends one)."""
        box: list[Any] = [call]
        dist.broadcast_object_list(box, src=LEADER, group=self.group)
        received: Call = box[0]
        return received

    def decide(self, decision: bool = False) -> bool:
        """Rank 0's decision, on every rank."""
        flag = torch.tensor([1 if decision else 0], dtype=torch.int8)
        dist.broadcast(flag, src=LEADER, group=self.group)
        return bool(flag.item())
