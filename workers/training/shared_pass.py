"""Forward / forward_backward ops of many adapters in one model pass (cross-adapter batching).

Every op's data goes into one right-padded batch, each op's rows together (a model's ops side by
side), and every LoRA layer adds to each block of rows its own adapter's update (row_blocks.py),
so all ops share the base model's matmuls. Each op's loss comes from its own rows alone, with
its own loss function; the backward ops' losses are summed and differentiated once. An adapter's
parameters touch only its own ops' rows, so the gradient each adapter receives is the sum of its
own ops' gradients: what running them one at a time accumulates in .grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from queue_tinker.types.enums import LossFn
from queue_tinker.types.tensors import Datum
from queue_tinker.types.training import ForwardBackwardOutput
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.row_blocks import blocks_of, row_blocks
from queue_tinker.workers.training.custom_loss_graph import GraphLoss
from queue_tinker.workers.training.model_pass import PassPlan
from queue_tinker.workers.training.optimizers import (
    grads_kept_on_error,
    op_loss,
    rows_for,
    target_logprobs,
)


@dataclass(frozen=True)
class PassOp:
    """One forward / forward_backward op, checked, with its resident adapter."""

    adapter: Adapter
    data: Sequence[Datum]
    loss_fn: LossFn | GraphLoss
    config: dict[str, float]
    backward: bool

    @property
    def width(self) -> int:
        return max(d.model_input.length for d in self.data)


def padded_tokens(ops: Sequence[PassOp]) -> int:
    """Rows x width of the ops' shared batch: what its activations cost."""
    if not ops:
        return 0
    return sum(len(op.data) for op in ops) * max(op.width for op in ops)


def shared_pass(
    pool: AdapterPool, ops: Sequence[PassOp], device: torch.device, plan: PassPlan | None = None
) -> list[ForwardBackwardOutput | Exception]:
    """Run the ops in one forward (and at most one backward) pass of the pool's model; one
    output per op, in order, or the error of an op whose loss failed (that op alone adds no
    gradient). A failure of the pass itself raises."""
    # Every adapter with a backward op trains; a forward-only one does not (its rows then
    # build no graph of their own).
    adapters = {op.adapter.name: op.adapter for op in ops}  # each model once
    trainable = {op.adapter.name for op in ops if op.backward}
    data = [datum for op in ops for datum in op.data]
    plan = plan or PassPlan()
    blocks = blocks_of((op.adapter.name, len(op.data)) for op in ops)  # (adapter, datums)
    rows = rows_for(data, device, plan, groups=[count for _, count in blocks])
    # The row blocks stay in place through backward: checkpointed layers and logit chunks
    # recompute their forward there, through the same LoRA layers.
    with (
        pool.shared(adapters.values(), trainable),
        grads_kept_on_error([adapters[name] for name in trainable]),
        row_blocks(
            pool.lora_layers(),
            [(name, n) for (name, _), n in zip(blocks, rows.group_rows, strict=True)],
        ),
    ):
        with torch.set_grad_enabled(bool(trainable)):
            logprobs = target_logprobs(pool.model, data, rows, plan)
        return _losses_and_backward(ops, logprobs, device)


def _losses_and_backward(
    ops: Sequence[PassOp], logprobs: Sequence[torch.Tensor], device: torch.device
) -> list[ForwardBackwardOutput | Exception]:
    """Each op's loss on its own rows, then one backward of the backward ops' sum."""
    outcomes: list[ForwardBackwardOutput | Exception] = []
    losses: list[torch.Tensor] = []
    start = 0
    for op in ops:
        rows = logprobs[start : start + len(op.data)]
        start += len(op.data)
        try:
            with torch.set_grad_enabled(op.backward):
                loss, out = op_loss(rows, op.data, op.loss_fn, op.config, device)
        except Exception as exc:  # this op's failure; the others go on
            outcomes.append(exc)
            continue
        outcomes.append(out)
        if op.backward:
            losses.append(loss)
    if losses:
        # d(sum of the ops' losses)/d(adapter) is the sum over that adapter's own ops: the
        # other ops' rows never touch its parameters.
        torch.stack(losses).sum().backward()
    return outcomes
