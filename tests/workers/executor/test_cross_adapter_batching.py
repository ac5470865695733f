"""Cross-adapter batching: training ops of many models in one model pass equal running them alone.

Engine level: the same ops (several models with their own LoRA configs, loss functions and
sequence lengths) go through `execute_batch` in one engine and `execute`, one at a time, in a
second engine built the same way; results, gradients and weights must agree. Worker level: a
real worker process batching concurrent training clients ends where one without batching ends.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_driver import (
    GRAD_ATOL,
    RTOL,
    WEIGHT_ATOL,
    BatchDriver,
    assert_batched_tensors,
    assert_same_outcome,
    datum,
    make_op,
    rl_datum,
    run_op,
)
from procs import lora_deployment
from sqlalchemy import text

import queue_tinker as tinker
from queue_tinker import types
from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import QueueTinkerError, UserInputError
from queue_tinker.queue.dispatch.dispatcher import Op
from queue_tinker.settings import Settings
from queue_tinker.store.db import make_engine
from queue_tinker.types import OpKind, codec
from queue_tinker.types.requests.sampling import SampleInput, SamplingParams
from queue_tinker.types.requests.training import (
    AdamParams,
    ForwardBackwardInput,
    LoraConfig,
)
from queue_tinker.types.tensors import Datum, ModelInput
from queue_tinker.workers.executor.lora import LoraExecutor
from queue_tinker.workers.executor.rules import LoraOpRules
from queue_tinker.workers.interface import OpResult

BASE = "queue-tinker/tiny-llama"
VOCAB = 259
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01)

Tensors = dict[str, torch.Tensor]


# --- data ----------------------------------------------------------------------------------------
def weighted(text: str) -> Datum:
    n = len(text.encode()) - 1
    return datum(text, weights=np.linspace(-0.5, 1.5, n, dtype=np.float32))


def fb(
    data: list[Datum], loss_fn: str = "cross_entropy", config: dict[str, float] | None = None
) -> dict[str, Any]:
    return ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config).model_dump()


# (model, LoRA config) of the engine-level tests: different ranks, seeds and adapted layers.
MODELS = {
    "m-ce": LoraConfig(rank=4, seed=1),
    "m-is": LoraConfig(rank=8, seed=2, train_mlp=False),
    "m-ppo": LoraConfig(rank=2, seed=3, train_unembed=False),
    "m-bad": LoraConfig(rank=4, seed=4, train_attn=False),
    "m-fwd": LoraConfig(rank=4, seed=5),
}
# Every model's ops, in the order a worker could hand them over (models interleaved; each
# model's own ops in order): (model, kind, body, expected error or None).
STEP_OPS: list[tuple[str, OpKind, Any, str | None]] = [
    (
        "m-ce",
        OpKind.FORWARD_BACKWARD,
        fb([weighted("a short one"), weighted("the quick brown fox jumps over the lazy dog")]),
        None,
    ),
    (
        "m-is",
        OpKind.FORWARD_BACKWARD,
        fb([rl_datum("importance sampled", 1), rl_datum("x y", 2)], "importance_sampling"),
        None,
    ),
    ("m-ce", OpKind.FORWARD_BACKWARD, fb([weighted("accumulates into the same grads")]), None),
    (
        "m-ppo",
        OpKind.FORWARD_BACKWARD,
        fb(
            [rl_datum("clipped ratios everywhere, a longer sequence than most", 3)],
            "ppo",
            {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        ),
        None,
    ),
    (
        "m-bad",
        OpKind.FORWARD_BACKWARD,
        fb(
            [
                datum("fine"),
                Datum(
                    model_input=ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": np.array([2, 3, 300])},
                ),
            ]
        ),
        r"target_tokens.*300",
    ),
    ("m-is", OpKind.FORWARD, fb([rl_datum("forward only, same adapter", 4)], "cispo"), None),
    ("m-ce", OpKind.OPTIM_STEP, ADAM.model_dump(), None),
    (
        "m-bad",
        OpKind.FORWARD_BACKWARD,
        fb([rl_datum("dro after a failure", 5)], "dro", {"beta": 0.3}),
        None,
    ),
    ("m-fwd", OpKind.FORWARD, fb([datum("no gradient here"), datum("nor here")]), None),
    ("m-ppo", OpKind.OPTIM_STEP, ADAM.model_dump(), None),
]


# One pass for everything; and passes cut by a small token cap with only two adapters resident,
# so the ops spread over several passes and adapters are evicted and restored between them.
LAYOUTS = {
    "one-pass": {"max_resident_adapters": 64},
    "tight": {"max_resident_adapters": 2, "train_batch_tokens": 64, "snapshot_every_steps": 1},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batched_step_equals_ops_one_at_a_time(root: Path, layout: str) -> None:
    """Five models' forward_backward / forward / optim_step ops in one execute_batch give the
    results, metrics, logprobs, gradients and (after optim_step) weights of the same ops run
    one at a time; a bad op fails alone with execute's error."""
    batch = BatchDriver(root, f"batch-{layout}", **LAYOUTS[layout])
    alone = BatchDriver(
        root,
        f"alone-{layout}",
        max_resident_adapters=64,
        snapshot_every_steps=LAYOUTS[layout].get("snapshot_every_steps", 20),
    )
    for model_id, config in MODELS.items():
        batch.create(model_id, config)
        alone.create(model_id, config)
    batch_ops = [batch.make(m, kind, body) for m, kind, body, _ in STEP_OPS]
    alone_ops = [alone.make(m, kind, body) for m, kind, body, _ in STEP_OPS]

    got = batch.batched(batch_ops)
    want = alone.one_by_one(alone_ops)
    for (_, kind, _, error), ours, theirs in zip(STEP_OPS, got, want, strict=True):
        if error is not None:
            assert isinstance(ours, UserInputError) and isinstance(theirs, UserInputError)
            assert re.search(error, str(ours)), ours
        assert_same_outcome(ours, theirs, kind)
    # The job record's metrics (not the result) say how many models shared the op's pass. One
    # pass: every model's leading ops in it; tight: no pass over two models, some alone.
    shared = [
        r.metrics["batch_models:max"]
        for r, (_, kind, _, _) in zip(got, STEP_OPS, strict=True)
        if isinstance(r, OpResult) and r.metrics and kind is not OpKind.OPTIM_STEP
    ]
    assert (max(shared), min(shared)) == (
        (len(MODELS), len(MODELS)) if layout == "one-pass" else (2, 1)
    )

    for model_id in MODELS:
        ours_grads, theirs_grads = batch.grads(model_id), alone.grads(model_id)
        assert ours_grads.keys() == theirs_grads.keys()
        if ours_grads:
            assert_batched_tensors(ours_grads, theirs_grads, atol_of_max=GRAD_ATOL)
        assert_batched_tensors(batch.weights(model_id), alone.weights(model_id), atol=WEIGHT_ATOL)
    assert not batch.grads("m-fwd") and not batch.grads("m-ce")  # none from forward / stepped
    assert batch.grads("m-is") and batch.grads("m-bad")

    # One more step for every model (batched: all at once) lands on the same weights.
    steps = [(m, OpKind.OPTIM_STEP, ADAM.model_dump()) for m in MODELS]
    got = batch.batched([batch.make(*s) for s in steps])
    want = alone.one_by_one([alone.make(*s) for s in steps])
    for ours, theirs in zip(got, want, strict=True):
        assert_same_outcome(ours, theirs, OpKind.OPTIM_STEP)
    for model_id in MODELS:
        assert_batched_tensors(batch.weights(model_id), alone.weights(model_id), atol=WEIGHT_ATOL)


def test_cross_adapter_batching_off_runs_training_alone(root: Path) -> None:
    """With cross_adapter_batch off nothing is batchable; with it on, a model's share of a
    batch is one step: its forward_backward run and the optim_step after it. Samples are never
    batched: they are stepped (the decode loop), either way."""
    off = LoraExecutor(
        BASE, "cpu", root / "off", root / "models", EngineConfig(cross_adapter_batch=False)
    )
    kinds = [
        OpKind.FORWARD_BACKWARD,
        OpKind.FORWARD,
        OpKind.OPTIM_STEP,
        OpKind.FORWARD_BACKWARD,
        OpKind.OPTIM_STEP,
    ]
    backlog = [make_op("m", seq, kind, {}) for seq, kind in enumerate(kinds, start=1)]
    samples = [make_op("s", seq, OpKind.SAMPLE, {}) for seq in range(1, 4)]
    assert not any(off.rules.batchable(op) for op in backlog + samples)
    assert off.rules.stepped(samples[0]) and not any(off.rules.stepped(op) for op in backlog)
    # (ops taken, complete: no op arriving later could join)
    assert off.rules.batch_share(backlog) == (0, True)
    assert off.rules.batch_share(samples) == (0, True)
    off.rules = LoraOpRules(cross_adapter_batch=True)
    assert (off.rules.batch_share(backlog), off.rules.batch_share(samples)) == (
        (3, True),
        (0, True),
    )
    assert off.rules.stepped(samples[0]) and not off.rules.batchable(samples[0])
    assert off.rules.batch_share(backlog[:2]) == (2, False)  # its optim_step may be on its way
    assert off.rules.batch_share(backlog[2:]) == (1, True)  # an optim_step at the head: that step
    assert off.rules.batch_share(backlog[1:2]) == (1, True)  # a forward alone: nothing to await
    save = make_op("m", 6, OpKind.SAVE_STATE, {})
    assert off.rules.batch_share([backlog[0], save, *backlog[1:]]) == (1, True)


def test_a_pass_is_not_shared_past_where_it_would_recompute_more(root: Path) -> None:
    """Three models' forward_backward ops and a forward op, 2 x 15 tokens each: where
    checkpointing starts at 64 padded tokens (the CPU's rule), two share a pass that recomputes
    nothing (60 tokens), and the others, each of which would make it checkpoint every layer,
    share the next; where it starts at 128, all four share one pass (120 tokens)."""
    data = [datum("sixteen tokens!!"), datum("and sixteen more")]

    def passes_shared(threshold: int) -> list[float]:
        driver = BatchDriver(
            root,
            f"recompute-{threshold}",
            max_resident_adapters=8,
            activation_checkpointing_tokens=threshold,
            pack_above_padding=1.0,
        )
        for model_id in ("a", "b", "c", "f"):
            driver.create(model_id, LoraConfig(rank=4))
        ops = [driver.make(m, OpKind.FORWARD_BACKWARD, fb(data)) for m in ("a", "b", "c")]
        ops.append(driver.make("f", OpKind.FORWARD, fb(data)))
        results = driver.batched(ops)
        assert all(isinstance(r, OpResult) and r.metrics for r in results), results
        return [r.metrics["batch_models:max"] for r in results]  # type: ignore[union-attr]

    assert passes_shared(64) == [2.0, 2.0, 2.0, 2.0]
    assert passes_shared(128) == [4.0, 4.0, 4.0, 4.0]


def test_outcomes_of_a_batch_survive_in_its_snapshot(root: Path) -> None:
    """An optim_step that snapshots inside a batch keeps the outcomes of its model's earlier
    ops of that batch (results and errors): an owner that died before publishing the batch
    leaves them to the next owner, which publishes them instead of failing or rerunning."""
    first = BatchDriver(root, "kept", snapshot_every_steps=1)
    first.create("m-kept", MODELS["m-ce"])
    ops = [
        first.make("m-kept", kind, body)
        for _, kind, body, _ in [STEP_OPS[0], STEP_OPS[4], STEP_OPS[6]]
    ]  # good fb, bad fb, optim_step (snapshot)
    fb_result, error, step_result = first.batched(ops)
    assert isinstance(fb_result, OpResult) and isinstance(step_result, OpResult)
    assert isinstance(error, UserInputError)

    nxt = LoraExecutor(BASE, "cpu", first.storage, root / "models")  # same storage
    assert nxt.durability.restore_point("m-kept") == ops[-1].seq
    kept = nxt.execute(ops[0])
    assert (kept.result, kept.metrics) == (fb_result.result, fb_result.metrics)
    with pytest.raises(QueueTinkerError, match=r"target_tokens.*300") as info:
        nxt.execute(ops[1])
    assert info.value.category is error.category
    assert nxt.execute(ops[2]).result == step_result.result
    assert nxt.pool.adapters["m-kept"].step == 2  # create()'s step and the batch's, once


# --- through a real worker -----------------------------------------------------------------------
CLIENTS = 3
STEPS = 3


def client_batch(client: int, step: int) -> list[types.Datum]:
    texts = [f"client {client} step {step}", "x" * (4 + 3 * client), "shared words " * (client + 1)]
    return [datum(t) for t in texts[: 1 + (client + step) % 3]]


def train_together(settings: Settings) -> tuple[list[list[float]], list[str]]:
    """CLIENTS training runs stepping at once (each pipelines forward_backward + optim_step,
    then waits for both): every run's losses, and the model ids."""
    with tinker.ServiceClient(settings) as service:
        runs = [
            service.create_lora_training_client(BASE, rank=4, seed=10 + i) for i in range(CLIENTS)
        ]
        losses: list[list[float]] = [[] for _ in runs]
        for step in range(STEPS):
            pending = [
                (tc.forward_backward(client_batch(i, step), "cross_entropy"), tc.optim_step(ADAM))
                for i, tc in enumerate(runs)
            ]
            for i, (fwd, opt) in enumerate(pending):
                losses[i].append(fwd.result(timeout=60).loss)
                opt.result(timeout=60)
        return losses, [tc.model_id for tc in runs]


async def _pass_sizes(settings: Settings, model_ids: list[str]) -> list[float | None]:
    """The batch_models metric of every finished forward_backward of these runs."""
    engine = make_engine(settings.database_url or "")
    deadline = time.monotonic() + 10
    try:
        while True:
            async with engine.connect() as conn:
                rows = (
                    (
                        await conn.execute(
                            text(
                                "SELECT (metrics->>'batch_models:max')::float FROM requests "
                                "WHERE model_id = ANY(:ids) AND kind = 'forward_backward' "
                                "AND status = 'done'"
                            ),
                            {"ids": model_ids},
                        )
                    )
                    .scalars()
                    .all()
                )
            if len(rows) >= CLIENTS * STEPS or time.monotonic() > deadline:
                return list(rows)
            await asyncio.sleep(0.2)
    finally:
        await engine.dispose()


@pytest.mark.timeout(120)
def test_worker_batches_concurrent_training_runs(redis_url: str, database_url: str) -> None:
    """Training runs stepping at once on one worker share its model passes, and end where the
    same runs end on a worker that runs every op alone (QT_CROSS_ADAPTER_BATCH=0)."""
    results = {}
    for batching in (True, False):
        with lora_deployment(
            redis_url, database_url, BASE, cross_adapter_batch=batching
        ) as settings:
            losses, model_ids = train_together(settings)
            results[batching] = losses, asyncio.run(_pass_sizes(settings, model_ids))
    (batched, sizes), (alone, unbatched_sizes) = results[True], results[False]
    np.testing.assert_allclose(batched, alone, rtol=RTOL)
    assert unbatched_sizes == [None] * (CLIENTS * STEPS)
    assert len(sizes) == CLIENTS * STEPS and max(s or 1 for s in sizes) > 1, sizes


def test_optimizer_steps_of_many_adapters_equal_torch_adamw_one_at_a_time() -> None:
    """optim_steps (what a batch's optim_steps run as: one AdamW over every adapter sharing
    hyperparameters) equals torch.optim.AdamW stepping each adapter alone: adapters at
    different step counts, two hyperparameter sets, clipping per adapter, a tensor without a
    gradient left alone."""
    from queue_tinker.workers.model.adapters import Adapter, new_optimizer
    from queue_tinker.workers.training.optimizers import optim_steps

    torch.manual_seed(0)
    hyper = [
        AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0),
        AdamParams(learning_rate=3e-3, beta2=0.999),
    ]
    adapters, references = [], []
    for i in range(5):
        params = {f"t{j}": torch.nn.Parameter(torch.randn(4 + j, 3)) for j in range(3)}
        adapters.append(
            Adapter(
                model_id=f"m{i}",
                name=f"a{i}",
                tenant_id="t",
                config=LoraConfig(),
                params=params,
                optimizer=new_optimizer(params.values()),
            )
        )
        copies = {k: torch.nn.Parameter(p.detach().clone()) for k, p in params.items()}
        references.append((copies, torch.optim.AdamW(list(copies.values()))))
    for round_ in range(4):
        # Adapter i steps in rounds >= i % 3 only, so step counts differ within a call.
        stepping = [i for i in range(5) if round_ >= i % 3]
        for i in stepping:
            for j, (key, p) in enumerate(adapters[i].params.items()):
                if (i, j) == (4, 2):
                    continue  # no gradient: AdamW must leave it alone
                grad = torch.randn_like(p) * (10 if i % 2 else 0.1)  # some clip, some do not
                p.grad = grad.clone()
                references[i][0][key].grad = grad.clone()
        ours = optim_steps([(adapters[i], hyper[i % 2]) for i in stepping])
        for i, metrics in zip(stepping, ours, strict=True):
            params, reference = references[i]
            adam = hyper[i % 2]
            trainable = [p for p in params.values() if p.grad is not None]
            norm = float(
                torch.nn.utils.clip_grad_norm_(trainable, adam.grad_clip_norm or float("inf"))
            )
            for group in reference.param_groups:
                group.update(
                    lr=adam.learning_rate,
                    betas=(adam.beta1, adam.beta2),
                    eps=adam.eps,
                    weight_decay=adam.weight_decay,
                )
            reference.step()
            reference.zero_grad(set_to_none=True)
            assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-6)
            assert metrics["step:max"] == adapters[i].step
    for adapter, (params, _) in zip(adapters, references, strict=True):
        for key, p in adapter.params.items():
            torch.testing.assert_close(p.detach(), params[key].detach(), rtol=1e-6, atol=0)
            assert p.grad is None
    assert [a.step for a in adapters] == [4, 3, 2, 4, 3]


def test_optim_steps_read_every_adapters_norm_back_at_once() -> None:
    """The gradient norms of a batch's adapters come back to the host together, not with a
    device sync per adapter (no scalar read per norm): each equal to torch's total norm, the
    gradients clipped where asked and finite, a non-finite norm left unclipped, an adapter
    without gradients at 0."""
    from aten_calls import AtenCalls

    from queue_tinker.workers.model.adapters import Adapter, new_optimizer
    from queue_tinker.workers.training.optimizers import _clip_all

    torch.manual_seed(1)
    grads = [[torch.randn(4, 3) * 10], [torch.randn(5, 2)], [torch.full((2, 2), float("inf"))], []]
    adapters = []
    for i, tensors in enumerate(grads):
        shapes = [g.shape for g in tensors] or [torch.Size((4, 3))]
        params = {f"t{j}": torch.nn.Parameter(torch.randn(shape)) for j, shape in enumerate(shapes)}
        for p, g in zip(params.values(), tensors, strict=False):
            p.grad = g.clone()
        adapters.append(
            Adapter(f"m{i}", f"a{i}", "t", LoraConfig(), params, new_optimizer(params.values()))
        )
    clip = AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)
    with AtenCalls() as calls:
        norms = _clip_all([(a, clip) for a in adapters])
    assert calls.reads == []
    want = [float(torch.nn.utils.get_total_norm(g)) for g in grads[:3]]
    assert norms[:2] == pytest.approx(want[:2], rel=1e-6) and norms[2] == float("inf")
    assert norms[3] == 0.0
    clipped = float(torch.linalg.vector_norm(adapters[0].params["t0"].grad))
    assert clipped == pytest.approx(1.0, rel=1e-5)  # was about 35
    assert torch.isinf(adapters[2].params["t0"].grad).all()  # left for the step to skip


def test_a_pass_that_fails_in_backward_leaves_every_models_gradients_as_they_were(
    root: Path,
) -> None:
    """A shared pass whose backward fails half-way (a hook raising on one tensor stands in for
    running out of memory) fails its ops and puts back every model's gradients: pending ones
    from an earlier op, and none where there were none; later ops then run as if it never
    happened."""
    driver = BatchDriver(root, "failing-pass")
    for model_id in ("m-held", "m-fresh"):
        driver.create(model_id, LoraConfig(rank=4, seed=7))
    driver.engine.execute(
        driver.make("m-held", OpKind.FORWARD_BACKWARD, fb([datum("pending before the pass")]))
    )
    before = {k: p.grad.clone() for k, p in driver.engine.pool.adapters["m-held"].params.items()}
    fresh = driver.engine.pool.adapters["m-fresh"]
    assert not fresh.has_grads()

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")

    # The base model's lowest LoRA tensor: its gradient comes last, after others were added.
    victim = next(p for k, p in fresh.params.items() if "layers.0." in k and "lora_A" in k)
    trains = victim.requires_grad
    victim.requires_grad_(True)  # a hook needs it; the pass makes it so anyway
    hook = victim.register_hook(fail)
    victim.requires_grad_(trains)
    try:
        results = driver.batched(
            [
                driver.make("m-held", OpKind.FORWARD_BACKWARD, fb([datum("in the failing pass")])),
                driver.make("m-fresh", OpKind.FORWARD_BACKWARD, fb([datum("also failing")])),
            ]
        )
    finally:
        hook.remove()
    assert all(isinstance(r, RuntimeError) and "simulated" in str(r) for r in results)
    held = driver.engine.pool.adapters["m-held"]
    for key, p in held.params.items():
        assert p.grad is not None and torch.equal(p.grad, before[key]), key
    assert not fresh.has_grads()


def sample_op(
    driver: BatchDriver, session: str, path: str | None, seed: int, prompt: list[int]
) -> Op:
    body = SampleInput(
        prompt=ModelInput.from_ints(prompt),
        num_samples=2,
        model_path=path,
        sampling_params=SamplingParams(max_tokens=10, seed=seed, stop=[]),
    )
    return driver.make(session, OpKind.SAMPLE, body.model_dump())


def test_stepped_samples_keep_their_checkpoints_and_leave_with_their_session(root: Path) -> None:
    """Sample ops joined to the engine's decode loop, on more checkpoints than stay resident:
    one waits until an op on a checkpoint in use is done (no adapter is evicted under a
    running row), and each returns what it returns alone; a bad op fails at the next step;
    dropping a session forgets its ops."""
    driver = BatchDriver(root, "stepped", max_resident_adapters=2)
    paths = []
    for i in range(3):
        driver.create(f"r{i}", LoraConfig(rank=4, seed=i))
        saved = driver.engine.execute(
            driver.make(
                f"r{i}", OpKind.SAVE_WEIGHTS_FOR_SAMPLER, {"name": "s", "ttl_seconds": None}
            )
        )
        paths.append(codec.decode(saved.result)["path"])
    ops = [sample_op(driver, f"s{i}", path, i, [5 + i, 6, 7]) for i, path in enumerate(paths)]
    bad = driver.make("s0", OpKind.SAMPLE, {"prompt": ModelInput.from_ints([]).model_dump()})
    gone = sample_op(driver, "gone", None, 9, [8, 9])
    engine = driver.engine
    assert all(engine.rules.stepped(op) for op in [*ops, bad, gone])
    engine.sampling.join([*ops, bad, gone])
    first = engine.sampling.step(budget_s=0.0)
    assert [(op.job_id, type(out)) for op, out in first] == [(bad.job_id, UserInputError)]
    # Two checkpoints fit: the third one's op waits for room, and the op behind it too.
    assert len(engine.sampling._joined) == 2
    engine.durability.drop("gone")
    outcomes: dict[str, OpResult | Exception] = {}
    while engine.sampling.stepping():
        outcomes.update((op.job_id, out) for op, out in engine.sampling.step(budget_s=0.0))
    assert set(outcomes) == {op.job_id for op in ops}  # "gone" never comes back
    for op in ops:
        result = outcomes[op.job_id]
        assert isinstance(result, OpResult)
        alone = run_op(engine, driver.make(op.model_id, OpKind.SAMPLE, codec.decode(op.payload)))
        got, want = codec.decode(result.result), codec.decode(alone.result)
        for a, b in zip(got["sequences"], want["sequences"], strict=True):
            assert a["tokens"] == b["tokens"]
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-6)
