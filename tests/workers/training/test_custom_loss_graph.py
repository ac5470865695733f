"""Server-side custom losses on the LoRA engine: losses written as users write them, traced and
encoded by the official SDK (create_custom_loss's own code), run by the worker inside one
forward_backward; their values and gradients equal the client-side path (a forward, the loss
under autograd on the client, a linear backward pass). Graphs outside the allow-list are
refused, naming the node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from custom_losses import LOSSES
from engine_driver import (
    GRAD_ATOL,
    TEXTS,
    BatchDriver,
    Driver,
    assert_same_outcome,
    datum,
    make_driver,
)
from engine_driver import assert_batched_tensors as assert_batch_tensors
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss
from torch.fx.node import _get_qualified_name

from queue_tinker.client.custom_loss import forward_data, run_custom_loss
from queue_tinker.errors import UserInputError
from queue_tinker.types import OpKind
from queue_tinker.types.requests.custom_loss import FUNCTIONS, CustomLoss, check_loss
from queue_tinker.types.requests.training import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraConfig,
)
from queue_tinker.types.tensors import Datum
from queue_tinker.workers.interface import OpResult
from queue_tinker.workers.training.custom_loss_graph import FUNCTION_TABLE

RTOL = {"rtol": 1e-5, "atol": 1e-7}
CPU = torch.device("cpu")


def loss_data(names: list[str]) -> list[Datum]:
    rng = np.random.default_rng(len(names))
    data = []
    for text in TEXTS[:3]:
        n = len(text) - 1
        values = {
            "ref_logprobs": -rng.uniform(3, 6, n),
            "old_logprobs": -rng.uniform(4, 7, n),
            "advantages": rng.normal(size=n),
            "weights": rng.uniform(0, 1, n),
            "chosen": (np.arange(n) < n // 2),
            "rejected": (np.arange(n) >= n // 2),
        }
        data.append(datum(text, **{k: values[k].astype(np.float32) for k in names}))
    return data


def traced(name: str) -> tuple[Any, CustomLoss]:
    """The SDK's LossHandle of the loss and the CustomLoss a create_custom_loss upload holds."""
    fn, names = LOSSES[name]
    handle = trace_loss(fn, {"logprobs": 1, **dict.fromkeys(names, 1)}, "sess")
    encoded = encode_graph(handle)
    upload = CustomLoss.model_validate(
        {
            "loss_id": f"sess:loss:{name}",
            "name": name,
            "inputs": [i.model_dump() for i in handle.inputs],
            "graph": encoded.model_dump(),
        }
    )
    check_loss(upload)
    return handle, upload


def client_side_fn(handle: Any, names: list[str]) -> Callable[..., Any]:
    """forward_backward_custom's callable: the traced loss run per datum under autograd."""

    def fn(data: list[Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        losses = []
        for d, lp in zip(data, logprobs, strict=True):
            inputs = [torch.tensor(np.array(d.loss_fn_inputs[n].data)) for n in names]
            losses.append(handle.graph(lp, *inputs)[0])
        return torch.stack(losses).sum(), {}

    return fn


@pytest.fixture(scope="module")
def engine(scratch: Any, models_dir: Any) -> Driver:
    return make_driver(
        scratch, models_dir, "storage-custom", max_resident_adapters=64, snapshot_every_steps=1000
    )


def twin_models(engine: Driver, prefix: str) -> tuple[str, str]:
    """Two models with the same weights, LoRA B non-zero (so every tensor gets a gradient)."""
    ids = (f"{prefix}-server", f"{prefix}-client")
    for model_id in ids:
        engine.create(model_id, seed=21)
        engine.fb(model_id, [datum(t) for t in TEXTS])
        engine.step(model_id, AdamParams(learning_rate=1e-2))
    return ids


@pytest.mark.parametrize("name", list(LOSSES))
def test_server_side_loss_equals_the_client_side_path(engine: Driver, name: str) -> None:
    """One forward_backward with the uploaded graph gives the loss, metrics and gradients of
    the client-side path (forward, the loss under autograd, linear backward), rtol 1e-5."""
    handle, upload = traced(name)
    names = LOSSES[name][1]
    data = loss_data(names)
    server, client = twin_models(engine, name)

    body = ForwardBackwardInput(data=data, loss_fn="custom", custom_loss=upload).model_dump()
    out = ForwardBackwardOutput.model_validate(engine.op(server, OpKind.FORWARD_BACKWARD, body))
    forward = engine.forward(client, forward_data(data))
    linear, loss, _ = run_custom_loss(data, forward, client_side_fn(handle, names))
    engine.fb(client, linear)

    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5)
    for key in ("custom/margin:mean", "custom/clip_fraction:mean", "custom/weight:sum"):
        if key in out.metrics:
            sdk_metrics = expected_metrics(handle, names, data, forward)
            assert out.metrics[key] == pytest.approx(sdk_metrics[key], rel=1e-5)
    server_grads, client_grads = engine.grads(server), engine.grads(client)
    assert server_grads.keys() == client_grads.keys() and server_grads
    for key, grad in client_grads.items():
        assert float(grad.abs().max()) > 0, key
        torch.testing.assert_close(server_grads[key], grad, **RTOL)


def expected_metrics(
    handle: Any, names: list[str], data: list[Datum], forward: ForwardBackwardOutput
) -> dict[str, float]:
    """The SDK's reduction of the loss's metrics over the datums (sum; mean divides)."""
    sums: dict[str, float] = {}
    for d, out in zip(data, forward.loss_fn_outputs, strict=True):
        lp = torch.tensor(np.array(out["logprobs"].data))
        inputs = [torch.tensor(np.array(d.loss_fn_inputs[n].data)) for n in names]
        for key, value in handle.graph(lp, *inputs)[1].items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}


def test_a_custom_loss_waits_for_the_device_once_the_pass_is_done(engine: Driver) -> None:
    """A custom loss's value and metrics stay on the device until the pass reads every op's
    numbers at once, after the backward (a read per datum and metric would wait for the
    forward each time): the pass makes no scalar read, and its metrics are the SDK's
    reduction of the loss's own."""
    from aten_calls import AtenCalls

    from queue_tinker.workers.training.custom_loss_graph import GraphLoss
    from queue_tinker.workers.training.shared_pass import PassOp, shared_pass

    handle, upload = traced("dpo")
    names = LOSSES["dpo"][1]
    data = loss_data(names)
    server, client = twin_models(engine, "reads")
    pool = engine.engine.pool
    op = PassOp(pool.adapters[server], data, GraphLoss(upload, CPU), {}, backward=True)
    with AtenCalls() as calls:
        (out,) = shared_pass(pool, [op], CPU)
    assert calls.reads == []
    assert isinstance(out, ForwardBackwardOutput), out
    want = expected_metrics(handle, names, data, engine.forward(client, forward_data(data)))
    assert out.metrics["custom/margin:mean"] == pytest.approx(want["custom/margin:mean"], rel=1e-5)


def test_a_custom_loss_metric_must_be_a_scalar(engine: Driver) -> None:
    """A metric of several values is the user's error, named, and fails the op alone."""
    from queue_tinker.workers.training.custom_loss_graph import GraphLoss, graph_batch_loss

    _, upload = traced("weighted_nll")
    nodes = [n.model_dump() for n in upload.graph.nodes]
    output = nodes[-1]
    # the metric is weights.sum(): make it the weights themselves
    (_, metrics) = output["args"][0]["tuple"]
    (key,) = metrics["dict"]
    summed = metrics["dict"][key]["ref"]
    summand = next(n for n in nodes if n["name"] == summed)["args"][0]
    metrics["dict"][key] = summand
    bad = upload.model_copy(update={"graph": upload.graph.model_validate({"nodes": nodes})})
    logprobs = torch.zeros(4, requires_grad=True)
    inputs = [{"weights": torch.ones(4)}]
    with pytest.raises(UserInputError, match=f"metric '{key}' must be a scalar"):
        graph_batch_loss(GraphLoss(bad, CPU), [logprobs], inputs)


# --- the allow-list --------------------------------------------------------------------------
def test_the_worker_holds_exactly_the_allowed_functions_under_their_wire_names() -> None:
    """Every allowed name maps to the function torch.fx names so (what the SDK sends)."""
    assert set(FUNCTION_TABLE) == FUNCTIONS
    for name, fn in FUNCTION_TABLE.items():
        if name == "getattr":
            continue
        wire = _get_qualified_name(fn).replace("_operator.", "operator.")
        assert wire == name, (name, wire)


def mutated(name: str, index: int, **change: Any) -> CustomLoss:
    _, upload = traced(name)
    nodes = [n.model_dump() for n in upload.graph.nodes]
    nodes[index] = {**nodes[index], **change}
    return upload.model_copy(update={"graph": upload.graph.model_validate({"nodes": nodes})})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"target": "os.system", "args": ["rm -rf /"]},
            "calls 'os.system', which is not an allowed",
        ),
        ({"target": "eval", "args": ["1"]}, "calls 'eval'"),
        ({"target": "open", "args": ["/etc/passwd"]}, "calls 'open'"),
        ({"target": "builtins.__import__", "args": ["os"]}, "calls 'builtins.__import__'"),
        (
            {"target": "getattr", "args": [{"ref": "logprobs"}, "__class__"]},
            "reads attribute '__class__'",
        ),
        ({"target": "getattr", "args": [{"ref": "logprobs"}, "_C"]}, "reads attribute '_C'"),
        ({"op": "call_method", "target": "backward"}, "calls method 'backward'"),
        ({"op": "get_attr", "target": "torch"}, "get_attr nodes are not allowed"),
        ({"op": "call_module", "target": "os"}, "call_module nodes are not allowed"),
        ({"args": [{"ref": "not_a_node"}]}, "refers to 'not_a_node'"),
    ],
)
def test_a_graph_outside_the_allow_list_is_refused_naming_the_node(
    change: dict[str, Any], message: str
) -> None:
    """os.system, eval, open, a module's or object's attributes, in-place or backward calls,
    references to no earlier node: refused with the node's index and name."""
    with pytest.raises(UserInputError, match=r"graph\.nodes\[3\] \('sub'\): " + message):
        check_loss(mutated("clipped_policy", 3, **change))


def test_inputs_other_than_per_token_are_refused() -> None:
    """The service's loss_fn_inputs are per token: a declared rank 0 or 2 input is refused."""
    _, upload = traced("weighted_nll")
    inputs = [upload.inputs[0], upload.inputs[1].model_copy(update={"rank": 2})]
    with pytest.raises(UserInputError, match=r"inputs\[1\]\.rank: weights has rank 2"):
        check_loss(upload.model_copy(update={"inputs": inputs}))


# --- in a cross-adapter pass -----------------------------------------------------------------
def test_custom_losses_run_in_a_shared_cross_adapter_pass(root: Any) -> None:
    """Ops of three models (two uploaded losses, one built-in) in one execute_batch give the
    results and gradients of the same ops run one at a time."""
    batch, alone = (
        BatchDriver(root, "cl-batch", max_resident_adapters=64),
        BatchDriver(root, "cl-alone", max_resident_adapters=64),
    )
    plan = [("cl-dpo", "dpo"), ("cl-clip", "clipped_policy"), ("cl-ce", None)]
    for driver in (batch, alone):
        for model_id, _ in plan:
            driver.create(model_id, LoraConfig(rank=4, seed=31))
    bodies = []
    for model_id, name in plan:
        if name is None:
            body = ForwardBackwardInput(
                data=[datum(t) for t in TEXTS], loss_fn="cross_entropy"
            ).model_dump()
        else:
            body = ForwardBackwardInput(
                data=loss_data(LOSSES[name][1]), loss_fn="custom", custom_loss=traced(name)[1]
            ).model_dump()
        bodies.append((model_id, OpKind.FORWARD_BACKWARD, body))
    got = batch.batched([batch.make(*b) for b in bodies])
    want = alone.one_by_one([alone.make(*b) for b in bodies])
    for ours, theirs in zip(got, want, strict=True):
        assert_same_outcome(ours, theirs, OpKind.FORWARD_BACKWARD)
    assert all(
        isinstance(r, OpResult) and r.metrics and r.metrics["batch_models:max"] == 3 for r in got
    )  # one pass held all three models
    for model_id, _ in plan:
        assert_batch_tensors(batch.grads(model_id), alone.grads(model_id), atol_of_max=GRAD_ATOL)
