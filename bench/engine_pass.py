"""One forward / forward_backward on a model's active adapter, from the engine's own pieces
(workers/training/shared_pass.py): rows, logprobs through the chunked unembedding, the loss,
one backward. The benchmarks time it beside the bare PEFT loop."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from queue_tinker.types.enums import LossFn
from queue_tinker.types.tensors import Datum
from queue_tinker.types.training import ForwardBackwardOutput
from queue_tinker.workers.training.model_pass import PassPlan
from queue_tinker.workers.training.shared_pass import op_loss, rows_for, target_logprobs


def forward_backward(
    model: torch.nn.Module,
    data: Sequence[Datum],
    loss_fn: LossFn,
    config: dict[str, float],
    device: torch.device,
    *,
    backward: bool,
    plan: PassPlan | None = None,
) -> ForwardBackwardOutput:
    plan = plan or PassPlan()
    with torch.set_grad_enabled(backward):
        logprobs = target_logprobs(model, data, rows_for(data, device, plan), plan)
        loss, out = op_loss(logprobs, data, loss_fn, config, device)
        if backward:
            loss.backward()
    return out
