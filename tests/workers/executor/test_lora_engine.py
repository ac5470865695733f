"""The LoRA engine driven in-process, op by op, as a worker would (no Redis, no SQL).

Every op is built the way the client builds it (a msgpack payload of the request type's
model_dump()) and run through `LoraExecutor.execute`. The expected values come from outside the
engine wherever they can: plain PEFT models driven with autograd, a torch AdamW built here,
PeftModel.from_pretrained on the saved directory, or the same op sequence on a second engine.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_driver import (
    ADAM,
    BASE,
    EXACT,
    RANK,
    TEXTS,
    TIGHT,
    Driver,
    Tensors,
    assert_tensors,
    batch,
    datum,
    fb_body,
    make_driver,
    make_op,
    max_diff,
    run_op,
    run_stepped,
)
from peft import PeftModel, get_peft_model
from peft.utils import set_peft_model_state_dict

from queue_tinker.client.custom_loss import forward_data, run_custom_loss
from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import OpCancelledError, UserInputError
from queue_tinker.queue.dispatch.dispatcher import Op
from queue_tinker.types import OpKind, codec
from queue_tinker.types.requests.training import (
    LoraConfig,
)
from queue_tinker.types.tensors import Datum, ModelInput
from queue_tinker.workers.executor.lora import LoraExecutor
from queue_tinker.workers.model.adapters import linear_names, peft_config
from queue_tinker.workers.model.base_model import load_base_model
from queue_tinker.workers.model.checkpoints import META_FILE, snapshot_dir
from queue_tinker.workers.model.families import family_of
from queue_tinker.workers.training.engine import default_seed

VOCAB = 259
CONTEXT = 256


# --- drivers ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def main(scratch: Path, models_dir: Path) -> Driver:
    """Everything stays resident; a periodic snapshot every 2 optimizer steps."""
    return make_driver(
        scratch, models_dir, "storage-main", max_resident_adapters=64, snapshot_every_steps=2
    )


@pytest.fixture(scope="module")
def small(scratch: Path, models_dir: Path) -> Driver:
    """One resident adapter: every switch of model evicts the other to storage."""
    return make_driver(
        scratch, models_dir, "storage-small", max_resident_adapters=1, snapshot_every_steps=1000
    )


def reference_model(models_dir: Path, seed: int, rank: int = RANK) -> torch.nn.Module:
    """An independent PEFT model built as the engine builds an adapter (same config, seed)."""
    base = load_base_model(BASE, "cpu", models_dir)
    base.eval()
    base.name_or_path = BASE  # as the engine does: adapter configs name the public base
    cfg = peft_config(
        linear_names(base), LoraConfig(rank=rank, seed=seed), BASE, family_of(base.config)
    )
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning
        )
        return get_peft_model(base, cfg)


def lora_params(model: torch.nn.Module, name: str = "default") -> dict[str, torch.nn.Parameter]:
    return {n.replace(f".{name}", ""): p for n, p in model.named_parameters() if f".{name}." in n}


def direct_logprobs(model: torch.nn.Module, data: list[Datum]) -> list[torch.Tensor]:
    """log p(target) per datum, one unpadded sequence at a time."""
    out = []
    for d in data:
        ids = torch.tensor([d.model_input.to_ints()])
        targets = torch.from_numpy(np.array(d.loss_fn_inputs["target_tokens"].data))
        logits = model(input_ids=ids, use_cache=False).logits[0, : targets.numel()].float()
        out.append(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0])
    return out


# --- 1. gradient accumulation -----------------------------------------------------------------
def test_gradient_accumulation_over_split_batch_equals_whole_batch(main: Driver) -> None:
    """Two forward_backward calls on halves, then one step, equal one call on the whole batch."""
    for model_id in ("accum-whole", "accum-split"):
        main.create(model_id, seed=3)
        main.train(model_id, 1)  # B starts at zero; one step makes every gradient non-trivial
    whole = main.fb("accum-whole", batch())
    first = main.fb("accum-split", batch()[:2])
    second = main.fb("accum-split", batch()[2:])
    assert first.loss + second.loss == pytest.approx(whole.loss, rel=1e-5)
    assert_tensors(main.grads("accum-split"), main.grads("accum-whole"), rtol=1e-5, atol=1e-6)
    main.step("accum-whole")
    main.step("accum-split")
    assert_tensors(main.weights("accum-split"), main.weights("accum-whole"), rtol=1e-5, atol=1e-7)


# --- 2. forward_backward_custom -----------------------------------------------------------------
def custom_loss(data: list[Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Nonlinear in the logprobs, with per-datum inputs the worker never sees."""
    total = torch.zeros(())
    for d, lp in zip(data, logprobs, strict=True):
        scale = torch.from_numpy(np.array(d.loss_fn_inputs["scale"].data))
        target = float(d.loss_fn_inputs["target_mean"].data[0])
        total = total + torch.logsumexp(scale * lp, dim=0) + (lp.mean() - target) ** 2
    return total, {"n:sum": float(len(data))}


def custom_data() -> list[Datum]:
    out = []
    for i, text in enumerate(TEXTS[:3]):
        n = len(text) - 1
        scale = np.linspace(0.5, 2.0, n, dtype=np.float32) * (1 + i)
        out.append(datum(text, scale=scale, target_mean=np.full(n, -4.0 - i, dtype=np.float32)))
    return out


def test_custom_loss_gradient_equals_direct_autograd(main: Driver, models_dir: Path) -> None:
    """forward + run_custom_loss + linear pass gives the custom loss's autograd gradient."""
    model_id, seed = "custom", 11
    main.create(model_id, seed=seed)
    ref = reference_model(models_dir, seed)
    ref_params = lora_params(ref)
    assert_tensors({k: p.detach() for k, p in ref_params.items()}, main.weights(model_id), **EXACT)
    main.train(model_id, 2)  # make lora_B non-zero, so lora_A gets a gradient too
    with torch.no_grad():
        for key, value in main.weights(model_id).items():
            ref_params[key].copy_(value)

    data = custom_data()
    forward = main.forward(model_id, forward_data(data))
    linear, loss, metrics = run_custom_loss(data, forward, custom_loss)
    main.fb(model_id, linear)
    engine_grads = main.grads(model_id)

    ref_loss, _ = custom_loss(data, direct_logprobs(ref, data))
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    ref_grads = {k: p.grad for k, p in ref_params.items()}
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    assert metrics == {"n:sum": 3.0}
    assert all(float(g.abs().max()) > 0 for g in ref_grads.values())
    assert_tensors(engine_grads, ref_grads, rtol=1e-5, atol=1e-6)


# --- 3. eviction ----------------------------------------------------------------------------
def test_eviction_is_invisible(main: Driver, small: Driver) -> None:
    """Two models alternating on a one-slot engine train exactly as when both stay resident."""
    pairs = {"evict-a": 21, "evict-b": 22}
    for model_id, seed in pairs.items():
        main.create(model_id, seed=seed)
        small.create(model_id, seed=seed)
    for round_ in range(5):
        for model_id in pairs:
            data = batch(TEXTS[round_ % 4 :] + TEXTS[: round_ % 4][:1])
            for driver in (main, small):
                driver.fb(model_id, data)
                driver.step(model_id)
    assert len(small.engine.pool.adapters) == 1
    for model_id in pairs:
        small.forward(model_id, batch()[:1])  # restores the evicted one; reads nothing new
        assert small.adapter(model_id).step == main.adapter(model_id).step == 5
        assert_tensors(small.weights(model_id), main.weights(model_id), **EXACT)
        assert_tensors(small.moments(model_id), main.moments(model_id), **EXACT)


def test_pending_gradients_survive_eviction(main: Driver, small: Driver) -> None:
    """forward_backward, eviction, optim_step: the step still uses the accumulated gradient."""
    for driver in (main, small):
        driver.create("pending-a", seed=31)
        driver.train("pending-a", 1)
        driver.fb("pending-a", batch())
    small.create("pending-b", seed=32)  # evicts pending-a with its gradients
    small.train("pending-b", 1)
    assert "pending-a" not in small.engine.pool.adapters
    for driver in (main, small):
        driver.step("pending-a")
    assert_tensors(small.weights("pending-a"), main.weights("pending-a"), **EXACT)
    assert small.grads("pending-a") == {}


def test_a_context_cap_outlives_eviction(small: Driver) -> None:
    """A run created on `Base:peft:<tokens>` keeps its cap once evicted and restored from its
    snapshot (as on another worker): a datum over it is refused naming the cap."""
    small.create("capped-a", seed=41, base=f"{small.engine.base_model}:peft:12")
    small.forward("capped-a", [datum("x" * 13)])  # 12 input tokens: within the cap
    small.create("capped-b", seed=42)  # evicts capped-a
    assert "capped-a" not in small.engine.pool.adapters
    with pytest.raises(UserInputError, match=r"13 tokens is longer than the context cap of 12"):
        small.forward("capped-a", [datum("x" * 14)])
    assert small.adapter("capped-a").context_cap == 12  # restored from its snapshot
    small.forward("capped-b", [datum("x" * 14)])  # the other run has the model's context


# --- 4. save_state / load_state -------------------------------------------------------------
@dataclass(frozen=True)
class Saved:
    path: str
    weights: Tensors  # at the checkpoint
    after_one: Tensors  # the original's weights one step later
    after_two: Tensors  # ... and two


@pytest.fixture(scope="module")
def saved(main: Driver) -> Saved:
    """ckpt-a: 2 steps, save_state, then 2 more steps (the continuation to match)."""
    main.create("ckpt-a", seed=41)
    main.train("ckpt-a", 2)
    path = main.save("ckpt-a", "after-2")
    weights = main.weights("ckpt-a")
    main.train("ckpt-a", 1, batch(TEXTS[1:]))
    after_one = main.weights("ckpt-a")
    main.train("ckpt-a", 1, batch(TEXTS[:2]))
    return Saved(path, weights, after_one, main.weights("ckpt-a"))


def test_load_state_with_optimizer_continues_exactly(main: Driver, saved: Saved) -> None:
    """A new model loaded with optimizer=True takes the same next steps as the original."""
    assert saved.path == "tinker://ckpt-a/weights/after-2"
    main.create("ckpt-b", seed=42)
    main.load("ckpt-b", saved.path, optimizer=True)
    assert_tensors(main.weights("ckpt-b"), saved.weights, **EXACT)
    main.train("ckpt-b", 1, batch(TEXTS[1:]))
    main.train("ckpt-b", 1, batch(TEXTS[:2]))
    assert main.adapter("ckpt-b").step == 4
    assert_tensors(main.weights("ckpt-b"), saved.after_two, **TIGHT)


def test_load_state_without_optimizer_resets_moments(main: Driver, saved: Saved) -> None:
    """After load_state (no optimizer) the next step is a fresh AdamW's from the saved weights."""
    main.create("ckpt-b2", seed=43)
    main.load("ckpt-b2", saved.path, optimizer=False)
    assert_tensors(main.weights("ckpt-b2"), saved.weights, **EXACT)
    assert main.moments("ckpt-b2") == {}
    assert main.adapter("ckpt-b2").step == 0
    main.fb("ckpt-b2", batch(TEXTS[1:]))
    grads = main.grads("ckpt-b2")
    main.step("ckpt-b2")
    assert max_diff(main.weights("ckpt-b2"), saved.after_one) > 1e-4  # not the continuation

    expected = {k: torch.nn.Parameter(v.clone()) for k, v in saved.weights.items()}
    for key, p in expected.items():
        p.grad = grads[key]
    adamw = torch.optim.AdamW(
        list(expected.values()),
        lr=ADAM.learning_rate,
        betas=(ADAM.beta1, ADAM.beta2),
        eps=ADAM.eps,
        weight_decay=ADAM.weight_decay,
    )
    adamw.step()
    assert_tensors(main.weights("ckpt-b2"), {k: p.detach() for k, p in expected.items()}, **TIGHT)


# --- 5. sampler weights ---------------------------------------------------------------------
def test_sampler_checkpoint_loads_in_plain_peft(main: Driver, models_dir: Path) -> None:
    """PeftModel.from_pretrained on a sampler checkpoint computes what the engine computes."""
    main.create("sampler", seed=51)
    main.train("sampler", 3)
    path = main.save("sampler", "s1", OpKind.SAVE_WEIGHTS_FOR_SAMPLER)
    assert path == "tinker://sampler/sampler_weights/s1"
    directory = main.storage / "sampler" / "sampler_weights" / "s1"
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE
    assert config["r"] == RANK

    data = batch()
    engine_lp = [o["logprobs"].to_torch() for o in main.forward("sampler", data).loss_fn_outputs]
    base = load_base_model(BASE, "cpu", models_dir)
    with torch.no_grad():
        base_lp = direct_logprobs(base, data)
        peft = PeftModel.from_pretrained(base, str(directory))
        peft.eval()
        peft_lp = direct_logprobs(peft, data)
    for ours, theirs, untrained in zip(engine_lp, peft_lp, base_lp, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert float((ours - untrained).abs().max()) > 1e-3  # the adapter does matter


# --- 6. bad input ---------------------------------------------------------------------------
def _bad_datum(tokens: list[int], targets: list[int], **extra: Any) -> Datum:
    inputs = {"target_tokens": np.array(targets, dtype=np.int64), **extra}
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _fb(
    data: list[Datum],
    loss_fn: str = "cross_entropy",
    config: dict | None = None,
    kind: OpKind = OpKind.FORWARD_BACKWARD,
) -> tuple[OpKind, dict[str, Any]]:
    return kind, fb_body(data, loss_fn, config)


def _unknown_loss() -> tuple[OpKind, dict[str, Any]]:
    kind, body = _fb(batch()[:1])
    return kind, {**body, "loss_fn": "mean_squared_error"}


_Q = np.full(4, -1.0, dtype=np.float32)
_A = np.array([1.0, math.nan, 0.5, 0.0], dtype=np.float32)
Setup = list[tuple[OpKind, dict[str, Any]]]

# (id, setup ops, bad op (model id -> (kind, body)), pattern its message must match)
BAD_CASES: list[tuple[str, Setup, Any, str]] = [
    (
        "vocab-input",
        [],
        lambda m: _fb([_bad_datum([1, 2, VOCAB], [2, 3, 4])]),
        r"data\[0\]\.model_input: token id 259 at position 2 is outside the vocabulary",
    ),
    (
        "vocab-target",
        [],
        lambda m: _fb([_bad_datum([1, 2, 3], [2, 300, 4])]),
        r"\['target_tokens'\]: token id 300 at position 1 is outside the vocabulary",
    ),
    (
        "vocab-target-forward",
        [],
        lambda m: _fb([_bad_datum([1, 2, 3], [2, 3, 1000])], kind=OpKind.FORWARD),
        r"\['target_tokens'\]: token id 1000 at position 2",
    ),
    (
        "too-long",
        [],
        lambda m: _fb([_bad_datum([7] * (CONTEXT + 1), [7] * CONTEXT)]),
        r"257 tokens is longer than the model's context of 256",
    ),
    (
        "weights-length",
        [],
        lambda m: _fb([_bad_datum([1, 2, 3], [2, 3, 4], weights=np.ones(2, np.float32))]),
        r"weights has 2 values but target_tokens has 3",
    ),
    (
        "ppo-no-logprobs",
        [],
        lambda m: _fb([_bad_datum([1, 2, 3, 4], [2, 3, 4, 5], advantages=_Q)], "ppo"),
        r"missing 'logprobs', required by ppo",
    ),
    (
        "nan-advantages",
        [],
        lambda m: _fb(
            [_bad_datum([1, 2, 3, 4], [2, 3, 4, 5], logprobs=_Q, advantages=_A)],
            "importance_sampling",
        ),
        r"\['advantages'\]: value at position 1 is nan; must be finite",
    ),
    ("empty-batch", [], lambda m: _fb([]), r"the batch is empty"),
    ("unknown-loss", [], lambda m: _unknown_loss(), r"^loss_fn: .*'cross_entropy'"),
    (
        "gspo-empty-ratio-mask",
        [],
        lambda m: _fb(
            [
                _bad_datum(
                    [1, 2, 3, 4],
                    [2, 3, 4, 5],
                    logprobs=_Q,
                    sequence_ratio_mask=np.zeros(4, np.float32),
                )
            ],
            "gspo",
        ),
        r"\['sequence_ratio_mask'\]: marks no token",
    ),
    (
        "duplicate-name",
        [(OpKind.SAVE_STATE, {"name": "dup", "ttl_seconds": None})],
        lambda m: (OpKind.SAVE_STATE, {"name": "dup", "ttl_seconds": None}),
        r"'dup' is already a state checkpoint",
    ),
    (
        "load-missing",
        [],
        lambda m: (OpKind.LOAD_STATE, {"path": f"tinker://{m}/weights/nope", "optimizer": False}),
        r"no checkpoint at tinker://.*/weights/nope",
    ),
    (
        "load-sampler-optimizer",
        [(OpKind.SAVE_WEIGHTS_FOR_SAMPLER, {"name": "samp", "ttl_seconds": None})],
        lambda m: (
            OpKind.LOAD_STATE,
            {"path": f"tinker://{m}/sampler_weights/samp", "optimizer": True},
        ),
        r"holds weights only",
    ),
    (
        "rank-mismatch",
        [],
        lambda m: (OpKind.LOAD_STATE, {"path": "tinker://rank8/weights/r8", "optimizer": False}),
        r"has LoRA config .*'rank': 8.*this model has .*'rank': 4",
    ),
]


@pytest.fixture(scope="module")
def after_good_step(main: Driver) -> Tensors:
    """What every bad-input model's weights must be after its (unharmed) first step; also
    makes the rank-8 checkpoint the rank-mismatch case loads."""
    main.create("rank8", seed=0, rank=8)
    main.save("rank8", "r8")
    main.create("bad-reference", seed=0)
    main.train("bad-reference", 1)
    return main.weights("bad-reference")


@pytest.mark.parametrize(
    ("case", "setup", "bad_op", "pattern"), BAD_CASES, ids=[c[0] for c in BAD_CASES]
)
def test_bad_input_fails_only_that_op(
    main: Driver, after_good_step: Tensors, case: str, setup: Setup, bad_op: Any, pattern: str
) -> None:
    """Bad input fails only its op, with a message naming the problem; the model is unharmed."""
    model_id = f"bad-{case}"
    main.create(model_id, seed=0)
    main.fb(model_id, batch())
    for kind, body in setup:
        main.op(model_id, kind, body)
    before = (main.weights(model_id), main.grads(model_id), main.adapter(model_id).step)
    kind, body = bad_op(model_id)
    with pytest.raises(UserInputError, match=pattern):
        main.op(model_id, kind, body)
    assert_tensors(main.weights(model_id), before[0], **EXACT)
    assert_tensors(main.grads(model_id), before[1], **EXACT)
    assert main.adapter(model_id).step == before[2]
    main.step(model_id)
    assert_tensors(main.weights(model_id), after_good_step, **EXACT)


def test_ops_after_unload_fail(main: Driver, small: Driver) -> None:
    """After unload_model every op of that model fails with a UserInputError."""
    for driver in (main, small):
        driver.create("unloaded", seed=0)
        driver.train("unloaded", 1)
        assert driver.op("unloaded", OpKind.UNLOAD_MODEL, {}) == {
            "model_id": "unloaded",
            "type": "unload_model",
        }
        assert not snapshot_dir(driver.storage, "unloaded").exists()
        attempts = [
            (OpKind.FORWARD, fb_body(batch())),
            (OpKind.FORWARD_BACKWARD, fb_body(batch())),
            (OpKind.OPTIM_STEP, ADAM.model_dump()),
            (OpKind.SAVE_STATE, {"name": "late", "ttl_seconds": None}),
        ]
        for kind, body in attempts:
            with pytest.raises(UserInputError, match="unloaded"):
                driver.op("unloaded", kind, body)


# --- 7. default seed ------------------------------------------------------------------------
def test_default_seed_comes_from_the_model_id(main: Driver, small: Driver) -> None:
    """Without a seed, a model initialises the same on every engine, and differently per id."""
    main.create("seedless-x", seed=None)
    main.create("seedless-y", seed=None)
    x, y = main.weights("seedless-x"), main.weights("seedless-y")
    small.create("seedless-x", seed=None)
    assert_tensors(small.weights("seedless-x"), x, **EXACT)
    main.create("seeded-x", seed=default_seed("seedless-x"))
    assert_tensors(main.weights("seeded-x"), x, **EXACT)
    a_keys = [k for k in x if "lora_A" in k]
    assert a_keys
    assert all(not torch.equal(x[k], y[k]) for k in a_keys)


# --- 8. snapshots, persist, drop ------------------------------------------------------------
def test_periodic_snapshot_and_persist_drop_restore(main: Driver) -> None:
    """Every 2nd step is snapshotted; persist + drop + next op restores the state exactly."""
    model_id = "snap"
    main.create(model_id, seed=61)
    assert (
        main.engine.durability.durable_seq(model_id) == 1
    )  # created: the model survives its worker
    main.train(model_id, 1)
    assert main.engine.durability.durable_seq(model_id) == 1
    main.train(model_id, 1)
    step_seq = main.seqs[model_id]
    assert main.engine.durability.durable_seq(model_id) == step_seq
    meta = json.loads((snapshot_dir(main.storage, model_id) / META_FILE).read_text())
    assert (meta["seq"], meta["step"]) == (step_seq, 2)

    main.fb(model_id, batch())
    before = (main.weights(model_id), main.moments(model_id), main.grads(model_id))
    main.engine.durability.persist(model_id)
    assert main.engine.durability.durable_seq(model_id) == main.seqs[model_id]
    main.engine.durability.drop(model_id)
    assert model_id not in main.engine.pool.adapters
    assert main.engine.durability.durable_seq(model_id) is None

    main.forward(model_id, batch()[:1])
    assert main.adapter(model_id).step == 2
    assert_tensors(main.weights(model_id), before[0], **EXACT)
    assert_tensors(main.moments(model_id), before[1], **EXACT)
    assert_tensors(main.grads(model_id), before[2], **EXACT)


def test_snapshot_restore_then_step_matches_uninterrupted(main: Driver) -> None:
    """A step after persist + drop + restore equals the same step with no interruption."""
    for model_id in ("resume-kept", "resume-dropped"):
        main.create(model_id, seed=71)
        main.train(model_id, 3)
        main.fb(model_id, batch()[1:])
    main.engine.durability.persist("resume-dropped")
    main.engine.durability.drop("resume-dropped")
    for model_id in ("resume-kept", "resume-dropped"):
        main.step(model_id)
        main.train(model_id, 1)
    assert_tensors(main.weights("resume-dropped"), main.weights("resume-kept"), **EXACT)


def test_reference_model_matches_engine_forward(main: Driver, models_dir: Path) -> None:
    """The engine's padded batch forward gives each datum's unpadded reference logprobs."""
    main.create("padding", seed=81)
    main.train("padding", 1)
    ref = reference_model(models_dir, 81)
    set_peft_model_state_dict(ref, main.weights("padding"))
    with torch.no_grad():
        expected = direct_logprobs(ref, batch())
    out = main.forward("padding", batch())
    for got, want in zip(out.loss_fn_outputs, expected, strict=True):
        torch.testing.assert_close(got["logprobs"].to_torch(), want, rtol=1e-5, atol=1e-5)
    assert out.loss == pytest.approx(-float(sum(w.sum() for w in expected)), rel=1e-5)


def test_base_model_samples_after_the_last_adapter_is_released(
    scratch: Path, models_dir: Path
) -> None:
    """Once a worker's only adapter is released (idle past QT_LINGER_MS), base-model samples
    still run and equal a fresh worker's; a new run then trains on a fresh adapter."""

    def sample(driver: Driver, session: str) -> Any:
        driver.op(
            session,
            OpKind.CREATE_SAMPLING_SESSION,
            {"tenant_id": "default", "base_model": BASE, "model_path": None},
        )
        params = {"max_tokens": 4, "temperature": 0.0}
        return driver.op(
            session,
            OpKind.SAMPLE,
            {
                "prompt": ModelInput.from_ints([72, 101, 108]).model_dump(),
                "num_samples": 1,
                "sampling_params": params,
            },
        )

    released = make_driver(scratch, models_dir, "storage-released", max_resident_adapters=4)
    released.create("only-run", seed=5)
    released.train("only-run", 1)
    released.engine.durability.persist("only-run")
    released.engine.durability.drop("only-run")  # what the worker does once the run lingered out
    fresh = make_driver(scratch, models_dir, "storage-fresh", max_resident_adapters=4)
    assert sample(released, "base-sampler") == sample(fresh, "base-sampler")
    released.create("next-run", seed=5)
    released.train("next-run", 1)
    assert released.engine.pool.adapters.keys() == {"next-run"}


def diverging(texts: list[str], logprob: float, advantage: float) -> list[Datum]:
    """importance_sampling data whose sampler logprobs and advantages make the loss or the
    gradient overflow (logprob -1e4: a ratio of e^1e4; advantages 1e30: a norm past fp32)."""
    out = []
    for text in texts:
        n = len(text.encode()) - 1
        out.append(
            datum(
                text,
                logprobs=np.full(n, logprob, dtype=np.float32),
                advantages=np.full(n, advantage, dtype=np.float32),
            )
        )
    return out


@pytest.mark.parametrize(("logprob", "advantage"), [(-1e4, 1.0), (-1.0, 1e30)])
def test_a_step_with_non_finite_gradients_is_skipped(
    main: Driver, logprob: float, advantage: float, caplog: pytest.LogCaptureFixture
) -> None:
    """A diverging step (a ratio of e^1e4, or advantages of 1e30) is not applied: weights,
    AdamW moments and step count stay, gradients are cleared, its metrics say so; the run
    then trains exactly as one that never saw it."""
    diverged, clean = f"diverge-{advantage:g}", f"clean-{advantage:g}"
    for model_id in (diverged, clean):
        main.create(model_id, seed=91)
        main.train(model_id, 2)
    before = (main.weights(diverged), main.moments(diverged), main.adapter(diverged).step)
    main.fb(diverged, diverging(TEXTS[:2], logprob, advantage), "importance_sampling")
    with caplog.at_level(logging.WARNING, logger="queue_tinker.workers.training.optimizers"):
        metrics = main.step(diverged)["metrics"]
    assert f"model {diverged}: optim_step skipped" in caplog.text
    assert metrics["skipped_nonfinite:sum"] == 1.0
    assert not math.isfinite(metrics["grad_norm:mean"])
    assert metrics["step:max"] == before[2] == 2
    assert_tensors(main.weights(diverged), before[0], **EXACT)
    assert_tensors(main.moments(diverged), before[1], **EXACT)
    assert main.grads(diverged) == {}
    for model_id in (diverged, clean):
        main.train(model_id, 2)
    assert_tensors(main.weights(diverged), main.weights(clean), **EXACT)
    assert main.step(clean)["metrics"]["skipped_nonfinite:sum"] == 0.0


# --- stopping a running sample ------------------------------------------------------------------
def sample_op(job_id: str, session: str, seq: int, n: int, max_tokens: int, seed: int) -> Op:
    body = {
        "prompt": ModelInput.from_ints(list(b"stop me")).model_dump(),
        "num_samples": n,
        "sampling_params": {"max_tokens": max_tokens, "seed": seed, "stop": []},
    }
    return Op(
        job_id=job_id, model_id=session, seq=seq, kind=OpKind.SAMPLE, payload=codec.encode(body)
    )


def test_a_stopped_sample_leaves_the_loop_and_the_others_sample_as_alone(main: Driver) -> None:
    """Two samples share the decode loop; one is stopped after a few steps: it comes out of the
    next step failed with the reason given, the other goes on to exactly the tokens and
    logprobs it gets alone, and the loop then serves a new sample."""
    engine = main.engine
    for session in ("stop-a", "stop-b"):
        main.op(
            session, OpKind.CREATE_SAMPLING_SESSION, {"tenant_id": "default", "base_model": BASE}
        )
    kept, doomed = (
        sample_op("kept", "stop-a", 2, 2, 40, 7),
        sample_op("doomed", "stop-b", 2, 8, 200, 8),
    )
    (alone,) = run_stepped(engine, [sample_op("kept-alone", "stop-a", 3, 2, 40, 7)])
    engine.sampling.join([kept, doomed])
    finished: dict[str, Any] = {}
    for _ in range(3):
        finished.update((op.job_id, r) for op, r in engine.sampling.step(budget_s=0.0))
    assert not finished and engine.sampling._loop is not None
    assert engine.sampling._loop.rows == 10  # both are in the loop, mid-way
    engine.sampling.stop({"doomed": "cancelled by the test while it ran", "unknown": "ignored"})
    out = engine.sampling.step(budget_s=0.0)
    assert [op.job_id for op, _ in out] == ["doomed"]
    error = out[0][1]
    assert isinstance(error, OpCancelledError) and error.category.value == "user"
    assert error.message == "cancelled by the test while it ran"
    assert engine.sampling._loop.rows == 2
    while engine.sampling.stepping():
        finished.update((op.job_id, r) for op, r in engine.sampling.step(budget_s=float("inf")))
    assert list(finished) == ["kept"]
    got, want = codec.decode(finished["kept"].result), codec.decode(alone.result)
    for one, other in zip(got["sequences"], want["sequences"], strict=True):
        assert one["tokens"] == other["tokens"]  # batched rows sum in another order: logprobs
        np.testing.assert_allclose(one["logprobs"], other["logprobs"], rtol=1e-5, atol=1e-6)
    (after,) = run_stepped(engine, [sample_op("after", "stop-b", 3, 1, 4, 9)])
    assert len(codec.decode(after.result)["sequences"][0]["tokens"]) == 4


def test_the_sample_cache_budget_reaches_the_decode_loop(
    main: Driver, scratch: Path, models_dir: Path
) -> None:
    """An engine given sample_cache_tokens (QT_SAMPLE_CACHE_TOKENS) runs three samples of 37
    cache tokens each (7 prompt + 30 new) one at a time under a budget of 40, where an engine
    without one runs them together; the samples are the same."""
    capped = make_driver(
        scratch, models_dir, "storage-capped", max_resident_adapters=4, sample_cache_tokens=40
    )
    results = []
    for driver in (capped, main):
        driver.op(
            "budget", OpKind.CREATE_SAMPLING_SESSION, {"tenant_id": "default", "base_model": BASE}
        )
        (result,) = run_stepped(driver.engine, [sample_op("budgeted", "budget", 2, 3, 30, 5)])
        results.append(result)
    assert [r.metrics["batch_sequences:max"] for r in results] == [1.0, 3.0]
    got, want = (codec.decode(r.result)["sequences"] for r in results)
    assert [s["tokens"] for s in got] == [s["tokens"] for s in want]


def test_a_worker_decoding_on_slots_samples_as_one_decoding_padded(
    scratch: Path, models_dir: Path
) -> None:
    """QT_DECODE_STEP=slots reaches the decode loop: samples of two checkpoints and the base
    model, joined at once, run on KV and LoRA slots and equal a padded worker's on the same
    storage (tokens, and logprobs to float32 rounding)."""
    padded = make_driver(scratch, models_dir, "storage-slots", max_resident_adapters=4)
    for seed, model_id in enumerate(("slot-a", "slot-b")):
        padded.create(model_id, seed=60 + seed)
        padded.train(model_id, 2)
        padded.save(model_id, "s", OpKind.SAVE_WEIGHTS_FOR_SAMPLER)
    slotted = LoraExecutor(
        BASE, "cpu", padded.storage, models_dir, EngineConfig(decode_step="slots")
    )
    paths = [None, "tinker://slot-a/sampler_weights/s", "tinker://slot-b/sampler_weights/s"]
    outcomes = []
    for engine in (padded.engine, slotted):
        ops = []
        for index, path in enumerate(paths):
            session = f"slots-{index}"
            create = make_op(
                session,
                1,
                OpKind.CREATE_SAMPLING_SESSION,
                {"tenant_id": "default", "base_model": BASE, "model_path": path},
            )
            run_op(engine, create)
            op = sample_op(f"{session}-{id(engine)}", session, 2, 2, 12, seed=index)
            body = {**codec.decode(op.payload), "model_path": path}
            ops.append(replace(op, payload=codec.encode(body)))
        outcomes.append([codec.decode(r.result) for r in run_stepped(engine, ops)])  # type: ignore[union-attr]
    loop = slotted.sampling._loop
    assert loop is not None and loop.slots is not None and loop.slots.adapters is not None
    assert sum(name is not None for name in loop.slots.adapters.names) == 2  # both held
    for got, want in zip(*outcomes, strict=True):
        for one, other in zip(got["sequences"], want["sequences"], strict=True):
            assert one["tokens"] == other["tokens"]
            np.testing.assert_allclose(one["logprobs"], other["logprobs"], rtol=1e-5, atol=1e-5)
