"""forward_backward_custom's client half: the user's loss on logprobs, with torch autograd.

The worker's forward pass returns each datum's target logprobs; the user's loss runs here, and
its gradient g = dLoss/dlogprobs goes back as the weights of a cross-entropy pass with
weights -g. That pass's loss is -Σ(-g)·logp = Σ g·logp, whose gradient with respect to the
adapter is exactly the chain rule's Σ g·dlogp/dθ: the same as backpropagating the user's loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from queue_tinker.errors import UserInputError
from queue_tinker.types.requests.training import ForwardBackwardOutput
from queue_tinker.types.tensors import Datum, TensorData

if TYPE_CHECKING:
    import torch

CustomLossFn = Callable[
    [list[Datum], list["torch.Tensor"]], tuple["torch.Tensor", dict[str, float]]
]


def forward_data(data: Sequence[Datum]) -> list[Datum]:
    """The data for the forward pass: the user's loss inputs stay here, only targets travel."""
    stripped = []
    for i, datum in enumerate(data):
        if "target_tokens" not in datum.loss_fn_inputs:
            raise UserInputError(
                f"data[{i}].loss_fn_inputs: missing 'target_tokens'; the custom loss receives "
                "the logprobs of these tokens"
            )
        targets = datum.loss_fn_inputs["target_tokens"]
        stripped.append(
            Datum(model_input=datum.model_input, loss_fn_inputs={"target_tokens": targets})
        )
    return stripped


def run_custom_loss(
    data: Sequence[Datum], forward: ForwardBackwardOutput, loss_fn: CustomLossFn
) -> tuple[list[Datum], float, dict[str, float]]:
    """Run the user's loss; return the linear pass's data, the loss and its metrics."""
    import torch

    logprobs = [
        torch.tensor(out["logprobs"].to_numpy(), dtype=torch.float32, requires_grad=True)
        for out in forward.loss_fn_outputs
    ]
    result = loss_fn(list(data), logprobs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise UserInputError("loss_fn: must return (loss tensor, metrics dict)")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UserInputError(f"loss_fn: the loss must be a scalar tensor, got {loss!r}")
    if not loss.requires_grad:
        raise UserInputError("loss_fn: the loss does not depend on the logprobs (no gradient)")
    loss.backward()
    linear = []
    for datum, lp in zip(data, logprobs, strict=True):
        grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
        weights = TensorData.from_numpy((-grad).numpy().astype(np.float32))
        targets = datum.loss_fn_inputs["target_tokens"]  # present: forward_data checked it
        linear.append(
            Datum(
                model_input=datum.model_input,
                loss_fn_inputs={"target_tokens": targets, "weights": weights},
            )
        )
    return linear, float(loss.item()), {k: _number(k, v) for k, v in dict(metrics).items()}


def _number(key: str, value: Any) -> float:
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        raise UserInputError(f"loss_fn: metric {key!r} is not a number: {value!r}") from None


def custom_output(
    forward: ForwardBackwardOutput, loss: float, metrics: dict[str, float]
) -> ForwardBackwardOutput:
    """What forward_backward_custom returns: the forward pass's logprobs, the user's loss."""
    return ForwardBackwardOutput(
        loss_fn_output_type=forward.loss_fn_output_type,
        loss_fn_outputs=forward.loss_fn_outputs,
        metrics={"loss:sum": loss, **metrics},
    )
