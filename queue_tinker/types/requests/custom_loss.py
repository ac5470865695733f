"""Server-side custom losses: the tinker SDK's `create_custom_loss` uploads a per-datum loss
traced by torch.fx as plain data (`CustomLossGraph`), and `forward_backward_custom` then names
it by its `loss_id` in an ordinary forward_backward (loss_fn "custom"), so the loss runs on the
worker inside the same forward/backward pass as a built-in loss.

Nothing in a graph is executable. The worker rebuilds it node by node from the closed lists
below, each name mapped to a torch function it holds itself (workers/custom_loss.py); there is
no import, no attribute outside ATTRIBUTES, no callable from the request. `check_graph` refuses
anything else when the graph is uploaded, naming the node. This module has no torch: the
gateway checks graphs without it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from queue_tinker.errors import UserInputError

# call_function targets, by the name the SDK sends (torch.fx's qualified name; Python's
# operators as operator.<name>). Pure tensor math only: nothing that reads or writes outside
# its arguments, nothing in place.
FUNCTIONS = frozenset(
    {
        "operator.add",
        "operator.sub",
        "operator.mul",
        "operator.truediv",
        "operator.floordiv",
        "operator.pow",
        "operator.neg",
        "operator.pos",
        "operator.abs",
        "operator.getitem",
        "operator.lt",
        "operator.le",
        "operator.gt",
        "operator.ge",
        "operator.eq",
        "operator.ne",
        "operator.and_",
        "operator.or_",
        "operator.xor",
        "operator.invert",
        "operator.matmul",
        "torch.exp",
        "torch.log",
        "torch.log1p",
        "torch.expm1",
        "torch.sqrt",
        "torch.rsqrt",
        "torch.abs",
        "torch.square",
        "torch.sigmoid",
        "torch.tanh",
        "torch.sign",
        "torch.clamp",
        "torch.clip",
        "torch.minimum",
        "torch.maximum",
        "torch.where",
        "torch.sum",
        "torch.mean",
        "torch.logsumexp",
        "torch.softmax",
        "torch.log_softmax",
        "torch.stack",
        "torch.cat",
        "torch.zeros_like",
        "torch.ones_like",
        "torch.full_like",
        "torch.isfinite",
        "torch.nan_to_num",
        "torch.cumsum",
        "torch.dot",
        "torch._C._nn.log_sigmoid",
        "torch._C._nn.softplus",
        "torch.nn.functional.relu",
        "math.log",
        "math.exp",
        "math.sqrt",
        "getattr",  # attribute reads: only the names in ATTRIBUTES
    }
)
# call_method targets: torch.Tensor methods of the same kind.
METHODS = frozenset(
    {
        "exp",
        "log",
        "log1p",
        "expm1",
        "sqrt",
        "rsqrt",
        "abs",
        "neg",
        "square",
        "pow",
        "sigmoid",
        "tanh",
        "sign",
        "clamp",
        "clip",
        "sum",
        "mean",
        "max",
        "min",
        "amax",
        "amin",
        "logsumexp",
        "softmax",
        "log_softmax",
        "cumsum",
        "detach",
        "float",
        "double",
        "to",
        "type_as",
        "unsqueeze",
        "squeeze",
        "reshape",
        "view",
        "flatten",
        "t",
        "size",
        "dim",
        "numel",
        "add",
        "sub",
        "mul",
        "div",
        "minimum",
        "maximum",
        "masked_fill",
        "where",
        "gather",
        "isfinite",
        "nan_to_num",
        "dot",
        "float_power",
    }
)
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T"})
DTYPES = frozenset({"float32", "float64", "int64", "int32", "bool"})
NODE_OPS = ("placeholder", "call_function", "call_method", "output")  # no get_attr/call_module
MAX_NODES = 4_096
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
MAX_INPUTS = 16


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CustomLossInput(_Wire):
    name: str
    rank: Literal[0, 1, 2]


class CustomLossNode(_Wire):
    op: str
    name: str
    target: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class CustomLossGraph(_Wire):
    format: Literal[1] = 1
    nodes: list[CustomLossNode]


class CustomLoss(_Wire):
    """A stored loss as a forward_backward op carries it to the worker."""

    loss_id: str
    name: str
    inputs: list[CustomLossInput]
    graph: CustomLossGraph

    @property
    def input_names(self) -> list[str]:
        """The loss_fn_inputs it reads, after logprobs, in order."""
        return [i.name for i in self.inputs[1:]]


# --- the check ----------------------------------------------------------------------------------
def check_loss(loss: CustomLoss) -> None:
    """Refuse a loss the worker would not run, naming the field or node."""
    _check_inputs(loss.inputs)
    nodes = loss.graph.nodes
    if not nodes or len(nodes) > MAX_NODES:
        raise UserInputError(f"graph.nodes: must hold 1 to {MAX_NODES} nodes, got {len(nodes)}")
    seen: set[str] = set()
    placeholders = []
    for index, node in enumerate(nodes):
        where = f"graph.nodes[{index}] ({node.name!r})"
        _check_node(where, node, seen)
        if node.name in seen:
            raise UserInputError(f"{where}: the name is used by an earlier node")
        seen.add(node.name)
        if node.op == "placeholder":
            placeholders.append(node.target)
        if node.op == "output" and index != len(nodes) - 1:
            raise UserInputError(f"{where}: the output must be the last node")
    if nodes[-1].op != "output":
        raise UserInputError("graph.nodes: the last node must be the output")
    names = [i.name for i in loss.inputs]
    if placeholders != names:
        raise UserInputError(
            f"graph: its inputs {placeholders} are not the declared inputs {names}"
        )
    _check_output(nodes[-1])


def _check_inputs(inputs: list[CustomLossInput]) -> None:
    if not inputs or inputs[0].name != "logprobs" or len(inputs) > MAX_INPUTS:
        raise UserInputError(
            f"inputs: logprobs first, then at most {MAX_INPUTS - 1} loss_fn_inputs names"
        )
    for index, item in enumerate(inputs):
        if not INPUT_NAME.fullmatch(item.name):
            raise UserInputError(f"inputs[{index}].name: {item.name!r} is not a lowercase name")
        # Every loss_fn_inputs tensor of a datum is per token here (checked with the batch).
        if item.rank != 1:
            raise UserInputError(
                f"inputs[{index}].rank: {item.name} has rank {item.rank}; "
                "this service runs custom losses over per-token ([T]) "
                "inputs only"
            )
    if len({i.name for i in inputs}) != len(inputs):
        raise UserInputError("inputs: names must be distinct")


def _check_node(where: str, node: CustomLossNode, seen: set[str]) -> None:
    if node.op not in NODE_OPS:
        raise UserInputError(
            f"{where}: {node.op} nodes are not allowed (only "
            f"{', '.join(NODE_OPS)}): a loss may not read modules or "
            "captured tensors"
        )
    if node.op == "call_function" and node.target not in FUNCTIONS:
        raise UserInputError(
            f"{where}: calls {node.target!r}, which is not an allowed "
            "function (pure torch, math and operator functions only)"
        )
    if node.op == "call_method" and node.target not in METHODS:
        raise UserInputError(
            f"{where}: calls method {node.target!r}, which is not an allowed tensor method"
        )
    if node.op == "call_function" and node.target == "getattr":
        attribute = node.args[1] if len(node.args) == 2 else None
        if attribute not in ATTRIBUTES:
            raise UserInputError(
                f"{where}: reads attribute {attribute!r}; only {sorted(ATTRIBUTES)} may be read"
            )
    for arg in [*node.args, *node.kwargs.values()]:
        _check_arg(where, arg, seen)


def _check_arg(where: str, arg: Any, seen: set[str]) -> None:
    """An encoded argument: JSON scalars and lists, or one of the SDK's one-key objects."""
    if arg is None or isinstance(arg, bool | int | float | str):
        return
    if isinstance(arg, list):
        for item in arg:
            _check_arg(where, item, seen)
        return
    if not (isinstance(arg, dict) and len(arg) == 1):
        raise UserInputError(f"{where}: argument {arg!r} is not an encoded value")
    _check_encoded(where, arg, seen)


def _check_encoded(where: str, arg: dict[str, Any], seen: set[str]) -> None:
    """One of the SDK's one-key objects: a reference to an earlier node, a tuple, slice or
    dict of further arguments, or an allowed constant."""
    ((kind, value),) = arg.items()
    if kind == "ref":
        if value not in seen:
            raise UserInputError(f"{where}: refers to {value!r}, which is not an earlier node")
    elif kind in ("tuple", "slice"):
        _check_arg(where, value, seen)
    elif kind == "dict" and isinstance(value, dict):
        _check_arg(where, list(value.values()), seen)
    elif not _allowed_constant(kind, value):
        raise UserInputError(f"{where}: argument {arg!r} is not an allowed value")


def _allowed_constant(kind: str, value: Any) -> bool:
    """The SDK's encodings of a float that JSON cannot hold and of torch constants."""
    if kind == "float":
        return value in ("inf", "-inf", "nan")
    if kind == "dtype":
        return value in DTYPES
    return kind in ("ellipsis", "device", "layout", "memory_format")


def _check_output(node: CustomLossNode) -> None:
    where = f"graph.nodes[-1] ({node.name!r})"
    value = node.args[0] if len(node.args) == 1 else None
    pair = value.get("tuple") if isinstance(value, dict) else value
    if not (
        isinstance(pair, list)
        and len(pair) == 2
        and isinstance(pair[1], dict)
        and isinstance(pair[1].get("dict"), dict)
    ):
        raise UserInputError(f"{where}: the loss must return (loss, metrics dict)")
    for key in pair[1]["dict"]:
        if not METRIC_KEY.fullmatch(key):
            raise UserInputError(
                f"{where}: metric {key!r} must be named custom/<name>:sum or custom/<name>:mean"
            )
