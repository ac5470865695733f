"""Runs an uploaded custom loss (queue_tinker/types/requests/custom_loss.py) on the worker: the
graph is interpreted node by node, each function and method looked up in this module's own
tables, which hold exactly the names the upload check allows. Nothing from the request is
imported, evaluated or called; a name outside the tables stops the loss (the check at upload
already refused it)."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from queue_tinker.errors import UserInputError
from queue_tinker.types.requests.custom_loss import (
    ATTRIBUTES,
    DTYPES,
    FUNCTIONS,
    METHODS,
    CustomLoss,
)


def _getattr(value: Any, name: str) -> Any:
    if name not in ATTRIBUTES:
        raise UserInputError(f"custom loss: reading attribute {name!r} is not allowed")
    return getattr(value, name)


def _op_table() -> dict[str, Callable[..., Any]]:
    ops = [
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "pow",
        "neg",
        "pos",
        "abs",
        "getitem",
        "lt",
        "le",
        "gt",
        "ge",
        "eq",
        "ne",
        "and_",
        "or_",
        "xor",
        "invert",
        "matmul",
    ]
    table: dict[str, Callable[..., Any]] = {f"operator.{n}": getattr(operator, n) for n in ops}
    names = [
        "exp",
        "log",
        "log1p",
        "expm1",
        "sqrt",
        "rsqrt",
        "abs",
        "square",
        "sigmoid",
        "tanh",
        "sign",
        "clamp",
        "clip",
        "minimum",
        "maximum",
        "where",
        "sum",
        "mean",
        "logsumexp",
        "softmax",
        "log_softmax",
        "stack",
        "cat",
        "zeros_like",
        "ones_like",
        "full_like",
        "isfinite",
        "nan_to_num",
        "cumsum",
        "dot",
    ]
    table |= {f"torch.{n}": getattr(torch, n) for n in names}
    table |= {
        "torch._C._nn.log_sigmoid": F.logsigmoid,
        "torch._C._nn.softplus": F.softplus,
        "torch.nn.functional.relu": F.relu,
        "math.log": math.log,
        "math.exp": math.exp,
        "math.sqrt": math.sqrt,
        "getattr": _getattr,
    }
    return table


FUNCTION_TABLE = _op_table()
assert set(FUNCTION_TABLE) == FUNCTIONS, "the worker's functions are the allowed ones"
TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
assert set(TORCH_DTYPES) == DTYPES, "the worker's dtypes are the allowed ones"


class GraphLoss:
    """One uploaded loss, ready to run on a datum's logprobs and inputs."""

    def __init__(self, loss: CustomLoss, device: torch.device) -> None:
        self.loss = loss
        self.device = device

    def __call__(
        self, logprobs: torch.Tensor, inputs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        env: dict[str, Any] = {}
        feed = iter([logprobs, *inputs])
        for node in self.loss.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(feed)
                continue
            args = [self._value(a, env) for a in node.args]
            kwargs = {k: self._value(v, env) for k, v in node.kwargs.items()}
            if node.op == "output":
                loss, metrics = args[0]
                return loss, dict(metrics)
            env[node.name] = self._call(node.op, node.target, args, kwargs)
        raise UserInputError(f"custom loss {self.loss.name!r}: the graph has no output")

    def _call(self, op: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if op == "call_function" and target in FUNCTION_TABLE:
            return FUNCTION_TABLE[target](*args, **kwargs)
        if op == "call_method" and target in METHODS and isinstance(args[0], torch.Tensor):
            return getattr(args[0], target)(*args[1:], **kwargs)
        raise UserInputError(f"custom loss {self.loss.name!r}: {op} {target!r} is not allowed")

    def _value(self, arg: Any, env: Mapping[str, Any]) -> Any:
        """An encoded argument decoded (tinker.types.CustomLossNode.args says how)."""
        if isinstance(arg, list):
            return [self._value(a, env) for a in arg]
        if not isinstance(arg, dict):
            return arg
        ((kind, value),) = arg.items()
        decode = _DECODERS.get(kind)
        return None if decode is None else decode(self, value, env)


# How each kind of encoded argument decodes. Any other kind (a layout or a memory format)
# decodes to None: torch's defaults.
_DECODERS: dict[str, Callable[[GraphLoss, Any, Mapping[str, Any]], Any]] = {
    "ref": lambda loss, value, env: env[value],
    "tuple": lambda loss, value, env: tuple(loss._value(a, env) for a in value),
    "dict": lambda loss, value, env: {k: loss._value(v, env) for k, v in value.items()},
    "slice": lambda loss, value, env: slice(*(loss._value(a, env) for a in value)),
    "float": lambda loss, value, env: float(value),
    "dtype": lambda loss, value, env: TORCH_DTYPES[value],
    # The worker's device: a loss runs where its logprobs are.
    "device": lambda loss, value, env: loss.device,
    "ellipsis": lambda loss, value, env: ...,
}


def graph_batch_loss(
    loss: GraphLoss, logprobs: Sequence[torch.Tensor], inputs: Sequence[Mapping[str, torch.Tensor]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sum of the datums' losses and the metrics, as the SDK's client-side run of the same
    loss reports them: each custom metric summed over the datums (':mean' ones divided by their
    count) and loss:sum. The metrics are 0-d fp32 tensors left on the loss's device: nothing
    here waits for it (a read per datum and metric would wait for the forward each time)."""
    losses: list[torch.Tensor] = []
    sums: dict[str, list[torch.Tensor]] = {}
    for lp, datum_inputs in zip(logprobs, inputs, strict=True):
        value, metrics = loss(lp, [datum_inputs[name] for name in loss.loss.input_names])
        if not isinstance(value, torch.Tensor) or value.ndim != 0:
            raise UserInputError(f"custom loss {loss.loss.name!r}: must return a scalar loss")
        losses.append(value)
        for key, metric in metrics.items():
            as_tensor = torch.as_tensor(metric, device=lp.device).detach().float()
            if as_tensor.numel() != 1:
                raise UserInputError(
                    f"custom loss {loss.loss.name!r}: metric {key!r} must be a scalar, "
                    f"got shape {tuple(as_tensor.shape)}"
                )
            sums.setdefault(key, []).append(as_tensor.reshape(()))
    total = torch.stack(losses).sum()
    out = {
        key: torch.stack(values).sum() / (len(losses) if key.endswith(":mean") else 1)
        for key, values in sums.items()
    }
    out["loss:sum"] = total.detach()
    return total, out
