"""What rank 0 tells the other ranks of a worker group: each engine call, in order, and each
decision that depends on time (when a decode quantum ends), so every rank does the same work
in the same order and their collectives meet; and, after each call, what every rank came out
of it with, so a failure on one rank alone ends the group instead of parting its states."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from queue_tinker.errors import RanksPartedError

LEADER = 0
# How long a rank whose call failed waits for the others to compare outcomes: ranks that failed
# alike arrive within moments of each other (the same code fails at the same place).
FAILED_WAIT_S = 60.0
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


def outcome(value: object) -> str:
    """What a call came to, comparable across ranks: "ok", or the type of each error, raised
    or returned for one op of several."""
    if isinstance(value, BaseException):
        return type(value).__name__
    if isinstance(value, list | tuple):
        return "[" + ",".join(outcome(item) for item in value) + "]"
    return "ok"


class Channel:
    """Broadcasts from rank 0 over a gloo group (pickled objects and a flag travel through
    host memory whatever the compute's backend)."""

    def __init__(self, rank: int, group: Any = None, failed_wait_s: float = FAILED_WAIT_S) -> None:
        self.rank = rank
        self.group = group
        self.failed_wait_s = failed_wait_s

    @property
    def leads(self) -> bool:
        return self.rank == LEADER

    def call(self, call: Call | None = None) -> Call:
        """Rank 0: send `call`; the others: receive it (blocks until rank 0 sends one)."""
        box: list[Any] = [call]
        dist.broadcast_object_list(box, src=LEADER, group=self.group)
        received: Call = box[0]
        return received

    def agree(self, call: Call, came_to: str, *, failed: bool = False) -> None:
        """Every rank's outcome of `call`, compared: RanksPartedError where they differ (a rank
        that failed alone no longer holds the state the others do). A rank whose call failed
        waits for the others at most `failed_wait_s`: if they did not fail, they may wait at a
        collective of the call it never reached, and never come."""
        outcomes: list[Any] = [None] * dist.get_world_size(self.group)
        if failed:
            self._gather_or_part(call, outcomes, came_to)
        else:
            dist.all_gather_object(outcomes, came_to, group=self.group)
        if len(set(outcomes)) > 1:
            each = ", ".join(f"rank {rank}: {o}" for rank, o in enumerate(outcomes))
            raise RanksPartedError(
                f"{call.part}.{call.method}: the ranks came out of it differently ({each}); "
                "their states no longer match, so the group ends and a new one runs the op again"
            )

    def _gather_or_part(self, call: Call, outcomes: list[Any], came_to: str) -> None:
        done = threading.Event()
        error: list[Exception] = []

        def gather() -> None:
            try:
                dist.all_gather_object(outcomes, came_to, group=self.group)
            except Exception as failure:  # a rank gone: the group ends all the same
                error.append(failure)
            finally:
                done.set()

        # A thread of its own, left behind if the others never come: the rank ends anyway.
        threading.Thread(target=gather, name="qt-agree", daemon=True).start()
        if not done.wait(self.failed_wait_s) or error:
            why = f"({error[0]})" if error else f"within {self.failed_wait_s:.0f} s"
            raise RanksPartedError(
                f"{call.part}.{call.method}: this rank failed ({came_to}) and the other ranks "
                f"did not come to compare {why}: they went on past where it failed, so the "
                "group ends and a new one runs the op again"
            )

    def decide(self, decision: bool = False) -> bool:
        """Rank 0's decision, on every rank."""
        flag = torch.tensor([1 if decision else 0], dtype=torch.int8)
        dist.broadcast(flag, src=LEADER, group=self.group)
        return bool(flag.item())
