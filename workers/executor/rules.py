"""How the LoRA executor runs each op: pings inline, samples stepped (the decode loop),
training steps batched across models (cross-adapter batching, unless turned off), the rest
alone. No torch here, so the worker's scheduling is tested with the real rules
(tests/workers/runtime/test_scheduling.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from queue_tinker.types import OpKind
from queue_tinker.types.service.ops import Op
from queue_tinker.workers.interface import TRAIN_BATCH_KINDS, BatchShare, is_inline_ping


@dataclass(frozen=True)
class LoraOpRules:
    cross_adapter_batch: bool = True

    def runs_inline(self, op: Op) -> bool:
        return is_inline_ping(op)

    def batchable(self, op: Op) -> bool:
        return self.cross_adapter_batch and op.kind in TRAIN_BATCH_KINDS

    def stepped(self, op: Op) -> bool:
        return op.kind is OpKind.SAMPLE

    def batch_share(self, backlog: Iterable[Op]) -> BatchShare:
        """One training step: the leading forward / forward_backward ops and the optim_step
        after them (complete once that is there); a client that pipelines many steps then hears
        of each as it finishes, not of all of them once the last is done. A share of forwards
        alone is complete too: no optim_step belongs with them, so a lone forward (RL's scoring
        and logprob calls) starts at once instead of after the arrivals' quiet gap."""
        taken = 0
        forwards_only = True
        for op in backlog:
            if not self.batchable(op):
                return BatchShare(taken, complete=True)
            taken += 1
            if op.kind is OpKind.OPTIM_STEP:
                return BatchShare(taken, complete=True)
            forwards_only = forwards_only and op.kind is OpKind.FORWARD
        return BatchShare(taken, complete=taken > 0 and forwards_only)
