"""The LoRA engine on a mixture-of-experts base (queue-tinker/tiny-moe, Qwen3-MoE): LoRA on
attention and on every expert's weights, op by op and shared across adapters.

References come from outside the engine: PEFT's own forward (its ParamWrapper folds the active
adapter into the experts' weights) in float64 with autograd, central finite differences of that
float64 loss, the same ops run one at a time, PeftModel.from_pretrained on a saved checkpoint.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_driver import (
    ADAM,
    GRAD_ATOL,
    WEIGHT_ATOL,
    BatchDriver,
    Tensors,
    assert_batched_tensors,
    assert_same_outcome,
    batch,
    datum,
    fb_body,
    rl_datum,
    run_op,
)
from peft import PeftModel, get_peft_model

from queue_tinker.errors import UserInputError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.enums import BUILT_IN_LOSSES, LossFn
from queue_tinker.types.requests.sampling import SampleInput, SamplingParams
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.types.tensors import Datum, ModelInput
from queue_tinker.workers.interface import OpResult
from queue_tinker.workers.model.adapters import expert_parameters, linear_names, peft_config
from queue_tinker.workers.model.base_model import load_base_model
from queue_tinker.workers.model.checkpoints import read_state
from queue_tinker.workers.model.families import family_of

MOE = "queue-tinker/tiny-moe"
EXPERT = ".mlp.experts."


@pytest.fixture(scope="module")
def moe(root: Path) -> BatchDriver:
    return BatchDriver(root, "moe", base=MOE, max_resident_adapters=64)


def experts_of(tensors: Tensors) -> Tensors:
    return {k: v for k, v in tensors.items() if EXPERT in k}


# --- gradients against PEFT and finite differences ------------------------------------------
def reference(root: Path, config: LoraConfig, weights: Tensors) -> torch.nn.Module:
    """An independent float64 PEFT model with the engine's adapter weights, run by PEFT's own
    forward (no row blocks) and transformers' eager loop over experts (the engine's default
    is grouped_mm, which has no float64)."""
    base = load_base_model(MOE, "cpu", root / "models")
    base.eval()
    base.config._experts_implementation = "eager"
    cfg = peft_config(
        linear_names(base), config, MOE, family_of(base.config), expert_parameters(base)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = get_peft_model(base, cfg, adapter_name="ref")
    peft.double()
    params = dict(peft.named_parameters())
    with torch.no_grad():
        for key, value in weights.items():
            params[key.replace(".weight", ".ref.weight")].copy_(value.double())
    return peft


def ce_loss(model: torch.nn.Module, data: list[Datum]) -> torch.Tensor:
    """The engine's cross_entropy: the sum of -log p(target) over every datum's tokens."""
    total = torch.zeros((), dtype=torch.float64)
    for d in data:
        ids = torch.tensor([d.model_input.to_ints()])
        targets = torch.as_tensor(np.array(d.loss_fn_inputs["target_tokens"].data))
        logits = model(input_ids=ids).logits[0].double()
        total = total - logits.log_softmax(-1).gather(1, targets[:, None]).sum()
    return total


def test_expert_gradients_match_peft_and_finite_differences(moe: BatchDriver, root: Path) -> None:
    """Every expert LoRA matrix gets a nonzero gradient, equal to float64 PEFT autograd's, and
    along a random direction to a central finite difference of the float64 loss."""
    config = LoraConfig(rank=4, seed=7)
    moe.create("grad", config)  # one step first, so B (and A's gradient) is nonzero
    data = batch()
    moe.engine.execute(moe.make("grad", OpKind.FORWARD_BACKWARD, fb_body(data)))
    state = moe.state("grad")
    grads = state.grads
    experts = experts_of(grads)
    assert len(experts) == 8  # 2 layers x (gate_up, down) x (A, B)
    assert all(float(g.abs().max()) > 0 for g in experts.values())

    ref = reference(root, config, state.weights)
    params = {
        k.replace(".ref.weight", ".weight"): p for k, p in ref.named_parameters() if ".ref." in k
    }
    loss = ce_loss(ref, data)
    loss.backward()
    ref_grads = {k: params[k].grad.float() for k in grads}  # type: ignore[union-attr]
    assert_batched_tensors(grads, ref_grads, atol_of_max=GRAD_ATOL)

    generator = torch.Generator().manual_seed(0)
    direction = {
        k: torch.randn(params[k].shape, generator=generator, dtype=torch.float64) for k in experts
    }
    # transformers computes norms and the router in fp32 whatever the model's dtype, so the
    # float64 loss is fp32-noisy (~1e-5 absolute): a step of 1e-3 keeps the noise and the
    # difference's curvature error each under 1e-3 of the slope (a wrong gradient is off by
    # its own size).
    eps = 1e-3
    with torch.no_grad():
        sides = []
        for sign in (1.0, -1.0):
            for k, v in direction.items():
                params[k].add_(sign * eps * v)
            sides.append(float(ce_loss(ref, data)))
            for k, v in direction.items():
                params[k].sub_(sign * eps * v)
    numeric = (sides[0] - sides[1]) / (2 * eps)
    analytic = sum(float((grads[k].double() * v).sum()) for k, v in direction.items())
    assert analytic == pytest.approx(numeric, rel=1e-2)


def test_every_built_in_loss_trains_the_experts(moe: BatchDriver) -> None:
    """Each built-in loss, with no loss_fn_config: a finite loss, and every expert LoRA
    matrix gets a gradient from that op alone."""
    moe.create("losses", LoraConfig(rank=4, seed=8))
    for loss_fn in BUILT_IN_LOSSES:
        data = [datum("plain targets")] if loss_fn is LossFn.CROSS_ENTROPY else [rl_datum("rl", 9)]
        body = fb_body(data, loss_fn.value)
        out = moe.engine.execute(moe.make("losses", OpKind.FORWARD_BACKWARD, body))
        assert np.isfinite(codec.decode(out.result)["metrics"]["loss:sum"]), loss_fn
        experts = experts_of(moe.grads("losses"))
        assert len(experts) == 8 and all(float(g.abs().max()) > 0 for g in experts.values())
        moe.engine.execute(moe.make("losses", OpKind.OPTIM_STEP, ADAM.model_dump()))


# --- a shared pass equals its ops one at a time ---------------------------------------------
MODELS = {
    "x-ce": LoraConfig(rank=4, seed=1),
    "x-attn": LoraConfig(rank=8, seed=2, train_mlp=False),  # adapts no expert
    "x-ppo": LoraConfig(rank=2, seed=3, train_unembed=False),
}
STEP_OPS: list[tuple[str, OpKind, Any]] = [
    ("x-ce", OpKind.FORWARD_BACKWARD, fb_body([datum("a short one"), datum("the lazy dog")])),
    (
        "x-attn",
        OpKind.FORWARD_BACKWARD,
        fb_body([rl_datum("importance sampled", 1)], "importance_sampling"),
    ),
    (
        "x-ppo",
        OpKind.FORWARD_BACKWARD,
        fb_body([rl_datum("clipped ratios, a longer sequence", 3)], "ppo"),
    ),
    ("x-ce", OpKind.FORWARD, fb_body([rl_datum("forward only", 4)], "cispo")),
    ("x-ce", OpKind.OPTIM_STEP, ADAM.model_dump()),
]


def test_cross_adapter_pass_equals_ops_one_at_a_time(root: Path) -> None:
    """Three adapters (one adapting no expert) in one shared pass: results, gradients and
    weights after optim_step equal the same ops one at a time (fp32 to 1e-5)."""
    shared = BatchDriver(root, "moe-shared", base=MOE, max_resident_adapters=64)
    alone = BatchDriver(root, "moe-alone", base=MOE, max_resident_adapters=64)
    for model_id, config in MODELS.items():
        shared.create(model_id, config)
        alone.create(model_id, config)
    got = shared.batched([shared.make(m, kind, body) for m, kind, body in STEP_OPS])
    want = alone.one_by_one([alone.make(m, kind, body) for m, kind, body in STEP_OPS])
    for (_, kind, _), ours, theirs in zip(STEP_OPS, got, want, strict=True):
        assert_same_outcome(ours, theirs, kind)
    shared_by = [
        r.metrics["batch_models:max"]
        for r, (_, kind, _) in zip(got, STEP_OPS, strict=True)
        if isinstance(r, OpResult) and r.metrics and kind is not OpKind.OPTIM_STEP
    ]
    assert shared_by == [3, 3, 3, 3]  # one pass of all three adapters
    for model_id in MODELS:
        ours_grads, theirs_grads = shared.grads(model_id), alone.grads(model_id)
        assert ours_grads.keys() == theirs_grads.keys()
        if ours_grads:
            assert_batched_tensors(ours_grads, theirs_grads, atol_of_max=GRAD_ATOL)
        assert_batched_tensors(shared.weights(model_id), alone.weights(model_id), atol=WEIGHT_ATOL)
    assert not experts_of(shared.weights("x-attn")) and experts_of(shared.grads("x-ppo"))


def test_samples_of_two_adapters_in_one_loop_equal_each_alone(moe: BatchDriver) -> None:
    """Two checkpoints' samples share decode steps (a block of rows each through the experts)
    and return the tokens and logprobs each returns alone."""
    ops = []
    for i in range(2):
        moe.create(f"smp{i}", LoraConfig(rank=4, seed=20 + i))
        saved = moe.engine.execute(
            moe.make(f"smp{i}", OpKind.SAVE_WEIGHTS_FOR_SAMPLER, {"name": "s", "ttl_seconds": None})
        )
        body = SampleInput(
            prompt=ModelInput.from_ints([5 + i, 6, 7]),
            num_samples=2,
            model_path=codec.decode(saved.result)["path"],
            sampling_params=SamplingParams(max_tokens=8, seed=i, stop=[]),
        )
        ops.append(moe.make(f"sess{i}", OpKind.SAMPLE, body.model_dump()))
    engine = moe.engine
    engine.sampling.join(ops)
    together: dict[str, OpResult | Exception] = {}
    while engine.sampling.stepping():
        together.update((op.job_id, out) for op, out in engine.sampling.step(budget_s=0.0))
    for op in ops:
        result = together[op.job_id]
        assert isinstance(result, OpResult)
        alone = run_op(engine, moe.make(op.model_id, OpKind.SAMPLE, codec.decode(op.payload)))
        got, want = codec.decode(result.result), codec.decode(alone.result)
        for a, b in zip(got["sequences"], want["sequences"], strict=True):
            assert a["tokens"] == b["tokens"]
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-6)


def test_checkpointed_layers_recompute_the_same_expert_gradients(root: Path) -> None:
    """Every decoder layer checkpointed: backward recomputes the experts through the row
    blocks, and two adapters' gradients equal those of a pass that keeps its activations."""
    grads = {}
    for name in ("on", "auto"):
        driver = BatchDriver(root, f"moe-ckpt-{name}", base=MOE, activation_checkpointing=name)
        for i in range(2):
            driver.create(f"c{i}", LoraConfig(rank=4, seed=50 + i))
        ops = [
            driver.make(f"c{i}", OpKind.FORWARD_BACKWARD, fb_body(batch()[i : i + 2]))
            for i in range(2)
        ]
        assert all(isinstance(r, OpResult) for r in driver.batched(ops))
        grads[name] = [driver.grads(f"c{i}") for i in range(2)]
    for on, off in zip(grads["on"], grads["auto"], strict=True):
        assert experts_of(off)
        assert_batched_tensors(on, off, atol_of_max=GRAD_ATOL)


# --- checkpoints, bf16, the rank cap ---------------------------------------------------------
def test_checkpoints_are_peft_files_that_reload_exactly(moe: BatchDriver, root: Path) -> None:
    """save_state then load_state into a new model gives the same weights to the bit; the
    sampler checkpoint loads in plain PEFT (target_parameters) and computes the engine's
    logprobs."""
    moe.create("ckpt", LoraConfig(rank=4, seed=30))
    saved = moe.engine.execute(
        moe.make("ckpt", OpKind.SAVE_STATE, {"name": "st", "ttl_seconds": None})
    )
    path = codec.decode(saved.result)["path"]
    moe.create("ckpt2", LoraConfig(rank=4, seed=31))
    moe.engine.execute(moe.make("ckpt2", OpKind.LOAD_STATE, {"path": path, "optimizer": True}))
    want, got = moe.weights("ckpt"), moe.weights("ckpt2")
    assert experts_of(want) and want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)

    sampler = moe.engine.execute(
        moe.make("ckpt", OpKind.SAVE_WEIGHTS_FOR_SAMPLER, {"name": "w", "ttl_seconds": None})
    )
    directory = moe.storage / "ckpt" / "sampler_weights" / "w"
    assert codec.decode(sampler.result)["path"] == "tinker://ckpt/sampler_weights/w"
    on_disk = read_state(directory, optimizer=False).weights
    assert all(torch.equal(on_disk[k], want[k]) for k in want)
    data = batch()[:2]
    forward = moe.engine.execute(moe.make("ckpt", OpKind.FORWARD, fb_body(data)))
    engine_lp = codec.decode(forward.result)["loss_fn_outputs"]
    base = load_base_model(MOE, "cpu", root / "models")
    peft = PeftModel.from_pretrained(base, str(directory)).eval()
    with torch.no_grad():
        for out, d in zip(engine_lp, data, strict=True):
            ids = torch.tensor([d.model_input.to_ints()])
            targets = torch.as_tensor(np.array(d.loss_fn_inputs["target_tokens"].data))
            lp = peft(input_ids=ids).logits[0].float().log_softmax(-1)
            theirs = lp.gather(1, targets[:, None])[:, 0]
            ours = torch.as_tensor(np.array(out["logprobs"]["data"], dtype=np.float32))
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_bf16_step_is_finite_and_keeps_lora_in_fp32(root: Path) -> None:
    """QT_DTYPE=bf16: experts compute in bf16 with the fp32 LoRA update folded in; the loss is
    finite and near fp32's, the step moves every expert matrix, LoRA state stays fp32."""
    bf16 = BatchDriver(root, "moe-bf16", base=MOE, dtype="bf16")
    fp32 = BatchDriver(root, "moe-fp32", base=MOE)
    config = LoraConfig(rank=4, seed=40)
    losses = []
    for driver in (bf16, fp32):
        driver.create("b", config)
        out = driver.engine.execute(driver.make("b", OpKind.FORWARD_BACKWARD, fb_body(batch())))
        losses.append(codec.decode(out.result)["metrics"]["loss:sum"])
    assert np.isfinite(losses[0]) and losses[0] == pytest.approx(losses[1], rel=2e-2)
    before = bf16.weights("b")
    run_op(bf16.engine, bf16.make("b", OpKind.OPTIM_STEP, ADAM.model_dump()))
    after = bf16.weights("b")
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in after.values())
    assert all(not torch.equal(after[k], before[k]) for k in experts_of(after))


def test_a_rank_above_the_moe_cap_is_refused_at_create(moe: BatchDriver) -> None:
    with pytest.raises(UserInputError, match=r"lora_config\.rank: 64 exceeds the max LoRA rank 32"):
        moe.create("too-big", LoraConfig(rank=64, seed=0))


# --- routing metrics --------------------------------------------------------------------------
def routing_reference(root: Path, data: list[Datum]) -> dict[str, float]:
    """Tinker's MoE metrics by their definitions, from the experts the base model's own
    routers pick (its router logits, top 2 of 4) over every token of the data."""
    base = load_base_model(MOE, "cpu", root / "models")
    chosen: list[list[np.ndarray]] = []
    with torch.no_grad():
        for d in data:
            out = base(input_ids=torch.tensor([d.model_input.to_ints()]), output_router_logits=True)
            chosen.append(
                [lg.softmax(-1).topk(2, dim=-1).indices.numpy() for lg in out.router_logits]
            )
    per_layer = []
    for layer in range(len(chosen[0])):
        picked = np.concatenate([c[layer].ravel() for c in chosen])
        counts = np.bincount(picked, minlength=4).astype(np.float64)
        fair = picked.size / 4
        per_layer.append(
            (
                (counts > 0).mean(),
                (counts > fair).mean(),
                (counts.max() - fair) / fair,
                (counts.min() - fair) / fair,
            )
        )
    table = np.array(per_layer)
    return {
        "e_frac_with_tokens:mean": table[:, 0].mean(),
        "e_frac_oversubscribed:mean": table[:, 1].mean(),
        "e_max_violation:mean": table[:, 2].mean(),
        "e_max_violation:max": table[:, 2].max(),
        "e_min_violation:mean": table[:, 3].mean(),
    }


def test_forward_backward_reports_the_routing_metrics_tinker_documents(root: Path) -> None:
    """Each op of a shared pass reports the e_* routing metrics of its own tokens: equal to
    their definitions applied to the experts the base model's routers pick (the adapters
    adapt only the unembedding, after every router), whatever else shares the pass."""
    driver = BatchDriver(root, "moe-routing", base=MOE, max_resident_adapters=64)
    ops = {
        "short": [datum("a short one"), datum("the lazy dog jumps")],
        "long": [datum("routing many more tokens through four experts, two at a time")],
    }
    for model_id in ops:
        driver.create(model_id, LoraConfig(rank=4, seed=5, train_attn=False, train_mlp=False))
    results = driver.batched(
        [driver.make(m, OpKind.FORWARD_BACKWARD, fb_body(data)) for m, data in ops.items()]
    )
    for (model_id, data), result in zip(ops.items(), results, strict=True):
        assert isinstance(result, OpResult)
        metrics = codec.decode(result.result)["metrics"]
        assert result.metrics is not None and result.metrics["batch_models:max"] == 2
        for key, value in routing_reference(root, data).items():
            assert metrics[key] == pytest.approx(value, abs=1e-9), (model_id, key)
