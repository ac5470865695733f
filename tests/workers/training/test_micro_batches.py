"""Micro-batches before recomputation (workers/training/micro_batches.py): a pass that would
checkpoint layers runs as micro-batches split at datum boundaries, with the results of one pass
that keeps every activation: losses, logprobs, metrics (token- or datum-weighted means), LoRA
gradients and the weights after optim_step, for every built-in loss and an uploaded per-datum
loss; fp32 on the CPU, rtol 1e-5, atol 1e-6 (of a gradient's largest entry)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from custom_losses import LOSSES
from engine_driver import (
    GRAD_ATOL,
    WEIGHT_ATOL,
    Driver,
    assert_batched_tensors,
    datum,
    make_driver,
    make_op,
)
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from queue_tinker.errors import UserInputError
from queue_tinker.types import OpKind
from queue_tinker.types.enums import BUILT_IN_LOSSES, LossFn
from queue_tinker.types.requests.custom_loss import CustomLoss, check_loss
from queue_tinker.types.requests.loss_inputs import LOSS_SPECS, resolve_loss_config
from queue_tinker.types.requests.training import AdamParams, ForwardBackwardInput
from queue_tinker.types.requests.training import ForwardBackwardOutput as Output
from queue_tinker.types.tensors import Datum
from queue_tinker.workers.model.adapters import adapter_name
from queue_tinker.workers.model.memory import Recomputation, layer_bytes, pass_bytes_per_token
from queue_tinker.workers.training.micro_batches import (
    Piece,
    micro_batches,
    recomputes_under,
    run_micro_batches,
)
from queue_tinker.workers.training.model_pass import PassPlan
from queue_tinker.workers.training.rounds import prepare_pass
from queue_tinker.workers.training.shared_pass import PassOp, kept_grads, shared_pass

TOL = {"rtol": 1e-5, "atol": 1e-6}
# Where the CPU's plan starts checkpointing every layer (QT_ACTIVATION_CHECKPOINTING_TOKENS):
# the 7 datums below (up to 21 tokens) are one pass of 147 padded tokens.
THRESHOLD = 64
TEXTS = [
    "micro batches add up",
    "every loss is a sum",
    "over its datums!",
    "so gradients accumulate",
    "exactly as one pass",
    "would have made them",
    "no layer recomputed",
]


@pytest.fixture(scope="module")
def split(scratch: Path, models_dir: Path) -> Driver:
    """Auto checkpointing from THRESHOLD padded tokens: passes above it are micro-batched."""
    return make_driver(
        scratch, models_dir, "micro-split", activation_checkpointing_tokens=THRESHOLD
    )


@pytest.fixture(scope="module")
def whole(scratch: Path, models_dir: Path) -> Driver:
    """No checkpointing: every pass runs whole, keeping its activations."""
    return make_driver(scratch, models_dir, "micro-whole", activation_checkpointing="off")


INPUTS = ("logprobs", "old_logprobs", "advantages", "weights", "sequence_ratio_mask")


def loss_data(names: list[str], seed: int) -> list[Datum]:
    """The texts with the loss inputs `names` (of INPUTS), seeded."""
    rng = np.random.default_rng(seed)
    data = []
    for text in TEXTS:
        n = len(text) - 1
        values = {
            "logprobs": -rng.uniform(4, 7, n),
            "old_logprobs": -rng.uniform(4, 7, n),
            "advantages": rng.normal(size=n),
            "weights": rng.uniform(0, 1, n),
            "sequence_ratio_mask": (rng.uniform(size=n) > 0.2),
        }
        data.append(datum(text, **{k: values[k].astype(np.float32) for k in names}))
    return data


def policy_data(loss_fn: str) -> list[Datum]:
    """The texts with every input the built-in loss reads or may read."""
    spec = LOSS_SPECS[LossFn(loss_fn)]
    names = [k for k in (*spec.required, *spec.optional) if k in INPUTS]
    return loss_data(names, seed=7)


def traced(name: str) -> CustomLoss:
    fn, names = LOSSES[name]
    handle = trace_loss(fn, {"logprobs": 1, **dict.fromkeys(names, 1)}, "sess")
    upload = CustomLoss.model_validate(
        {
            "loss_id": f"sess:loss:{name}",
            "name": name,
            "inputs": [i.model_dump() for i in handle.inputs],
            "graph": encode_graph(handle).model_dump(),
        }
    )
    check_loss(upload)
    return upload


def assert_same(a: Output, b: Output) -> None:
    assert a.metrics.keys() == b.metrics.keys()
    for key, value in b.metrics.items():
        assert a.metrics[key] == pytest.approx(value, rel=TOL["rtol"], abs=TOL["atol"]), key
    assert len(a.loss_fn_outputs) == len(b.loss_fn_outputs) == len(TEXTS)
    for got, want in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(got["logprobs"].data, want["logprobs"].data, **TOL)


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """rtol 1e-5, atol 1e-6 of each tensor's largest entry: its sums run in other orders, so
    an entry that cancels to near 0 carries the fp32 rounding of the tensor's large terms
    (seen: 1.4e-7 of the largest), as engine_driver's batched-against-alone checks allow."""
    assert_batched_tensors(a, b, atol_of_max=GRAD_ATOL)


def train_both(
    split: Driver, whole: Driver, model_id: str, body: dict[str, Any], caplog: Any
) -> None:
    """The same op and an optim_step on twin models of each engine: equal outputs, gradients
    and weights after the step; the split engine said it micro-batched."""
    for driver in (split, whole):
        driver.create(model_id, seed=5)
        driver.train(model_id, 1, [datum(t) for t in TEXTS[:2]])  # LoRA B non-zero
    with caplog.at_level(logging.DEBUG, logger="queue_tinker.workers.training.rounds"):
        caplog.clear()
        split_out = Output.model_validate(split.op(model_id, OpKind.FORWARD_BACKWARD, body))
    assert "runs as 3 micro-batches recomputing none" in caplog.text, caplog.text
    assert "would have 2 of 2 layers checkpointed" in caplog.text
    whole_out = Output.model_validate(whole.op(model_id, OpKind.FORWARD_BACKWARD, body))
    assert_same(split_out, whole_out)
    assert_grads_close(split.grads(model_id), whole.grads(model_id))
    for driver in (split, whole):
        driver.step(model_id, AdamParams(learning_rate=1e-2))
    assert_batched_tensors(split.weights(model_id), whole.weights(model_id), atol=WEIGHT_ATOL)


@pytest.mark.parametrize("loss_fn", sorted(BUILT_IN_LOSSES))
def test_a_micro_batched_op_equals_one_pass(
    split: Driver, whole: Driver, loss_fn: str, caplog: Any
) -> None:
    data = policy_data(loss_fn)
    config = resolve_loss_config(LossFn(loss_fn), None)
    body = ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config).model_dump()
    train_both(split, whole, f"micro-{loss_fn}", body, caplog)


@pytest.mark.parametrize("name", ["clipped_policy", "weighted_nll"])
def test_a_micro_batched_uploaded_loss_equals_one_pass(
    split: Driver, whole: Driver, name: str, caplog: Any
) -> None:
    """An uploaded loss runs per datum: its ':mean' metrics are means over datums, weighted
    by each micro-batch's datums when joined."""
    data = loss_data(LOSSES[name][1], seed=11)
    body = ForwardBackwardInput(data=data, loss_fn="custom", custom_loss=traced(name))
    train_both(split, whole, f"micro-custom-{name}", body.model_dump(), caplog)


def pass_op(driver: Driver, model_id: str, data: list[Datum]) -> PassOp:
    """A forward_backward op of the model's, checked as the rounds check it."""
    driver.seqs[model_id] += 1
    body = ForwardBackwardInput(data=data, loss_fn="cross_entropy").model_dump()
    op = make_op(model_id, driver.seqs[model_id], OpKind.FORWARD_BACKWARD, body)
    rounds = driver.engine.training.rounds
    adapter = driver.adapter(model_id)
    return prepare_pass(op, adapter, rounds.limits, rounds.request_limits, driver.engine.device)


def from_64_tokens(tokens: int, backward: bool, ranks: dict[str, int]) -> int:
    """The CPU's plan at THRESHOLD, on the 2-layer model."""
    return 2 if backward and tokens >= THRESHOLD else 0


def test_the_split_is_the_fewest_micro_batches_that_recompute_nothing(split: Driver) -> None:
    """Consecutive datums fill a micro-batch while it recomputes nothing; a datum that alone
    recomputes is a micro-batch of its own; a pass that recomputes nothing stays whole."""
    split.create("pieces-a", seed=1)
    split.create("pieces-b", seed=2)
    a = pass_op(split, "pieces-a", [datum("x" * n) for n in (11, 21, 11, 11)])
    b = pass_op(split, "pieces-b", [datum("y" * n) for n in (71, 6, 6)])
    assert micro_batches([a, b], from_64_tokens) == [
        [Piece(0, 0, 3)],  # 3 x 20 = 60 tokens
        [Piece(0, 3, 4)],  # with b's 70-token datum it would recompute
        [Piece(1, 0, 1)],  # recomputes alone
        [Piece(1, 1, 3)],
    ]
    small = pass_op(split, "pieces-a", [datum("z" * 11)] * 2)
    assert micro_batches([small], from_64_tokens) == [[Piece(0, 0, 2)]]


def test_an_op_failing_in_a_later_micro_batch_adds_no_gradient(split: Driver) -> None:
    """Two models' ops in one split pass; the second fails in its second micro-batch, after
    its first added gradients: it fails whole, the pass runs again without it, and the first
    model's gradients are those of its op alone while the second's are as they were (none)."""
    engine = split.engine
    plan = engine.training.rounds.plan
    for model_id in ("fail-a", "fail-b"):
        split.create(model_id, seed=9)
    ops = [pass_op(split, m, [datum(t) for t in TEXTS]) for m in ("fail-a", "fail-b")]
    batches = micro_batches(ops, from_64_tokens)
    second = [i for i, batch in enumerate(batches) if any(p.index == 1 for p in batch)][1]
    assert any(p.index == 1 for p in batches[second - 1])  # b's first piece came before
    ran = 0

    def failing_in_the_second(pieces: Sequence[PassOp]) -> list[Output | Exception]:
        nonlocal ran
        ran += 1
        outs = shared_pass(engine.pool, pieces, engine.device, plan)
        if ran == second + 1:  # the batch of b's second piece, the first time through
            outs = [
                UserInputError("data: b fails here") if p.adapter is ops[1].adapter else out
                for p, out in zip(pieces, outs, strict=True)
            ]
        return outs

    def kept(pieces: Sequence[PassOp]) -> Any:
        return kept_grads({p.adapter.name: p.adapter for p in pieces}.values())

    outcomes = run_micro_batches(ops, batches, failing_in_the_second, kept)
    assert isinstance(outcomes[1], UserInputError) and isinstance(outcomes[0], Output)
    assert ran > len(batches)  # it ran again
    assert split.grads("fail-b") == {}
    after = {k: v.clone() for k, v in split.grads("fail-a").items()}
    for p in split.adapter("fail-a").params.values():
        p.grad = None
    shared_pass(engine.pool, [ops[0]], engine.device, plan)
    assert_grads_close(after, split.grads("fail-a"))


def test_a_grouped_pass_is_planned_with_its_own_columns_not_stacked(split: Driver) -> None:
    """Planning a pass on a CUDA device, the LoRA of several adapters counts as stacked (every
    token computing every adapter's columns) only where the pass would stack it: two rank-4
    adapters group (a row's own columns), so a budget that holds the pass without extra
    columns plans no recomputation; a rank-4 and a rank-8 adapter do not group and stack.
    Without the LoRA layers the planner takes the upper bound, stacked."""
    for model_id, rank in (("plan-a", 4), ("plan-b", 4), ("plan-c", 8)):
        split.create(model_id, rank=rank)
    pool = split.engine.pool
    config = pool.base.config
    layers = config.num_hidden_layers
    per_layer = layer_bytes(config, 4, lora_copy=4)
    tokens = 512
    budget = tokens * pass_bytes_per_token(layers, Recomputation(), per_layer)
    plan = PassPlan(activation_budget=budget, layer_bytes=per_layer)
    cuda = torch.device("cuda")  # its type alone decides the form
    known = recomputes_under(plan, cuda, layers, pool.lora_layers())
    bound = recomputes_under(plan, cuda, layers)
    a, b, c = (adapter_name(f"plan-{x}") for x in "abc")
    assert not known(tokens, True, {a: 4, b: 4})
    assert known(tokens, True, {a: 4, c: 8})
    assert bound(tokens, True, {a: 4, b: 4})
    assert not known(tokens, True, {a: 4}) and not bound(tokens, True, {a: 4})
