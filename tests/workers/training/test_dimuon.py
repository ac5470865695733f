"""Dimuon (workers/training/optimizers.py) against a plain float64 torch reference of its
documented update, and through the LoRA engine: a run created with Dimuon steps with
DimuonParams, refuses AdamParams, and saves and resumes its momentum as AdamW's moments are."""

from __future__ import annotations

import math

import pytest
import torch
from engine_driver import BASE, TEXTS, TIGHT, Driver, assert_tensors, batch, make_driver

from queue_tinker.errors import UserInputError
from queue_tinker.types import OpKind
from queue_tinker.types.enums import Optimizer
from queue_tinker.types.requests.training import AdamParams, DimuonParams, LoraConfig
from queue_tinker.workers.training import optimizers

RANK = 4
PARAMS = DimuonParams(learning_rate=0.02, beta1=0.8, damping=1e-3)


# --- the reference: the module docstring's update, written out in float64 ------------------
def reference_sign(x: torch.Tensor) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    y = x if x.shape[0] <= x.shape[1] else x.T
    y = y / y.norm()
    for _ in range(5):
        gram = y @ y.T
        y = a * y + b * gram @ y + c * gram @ gram @ y
    return y if x.shape[0] <= x.shape[1] else y.T


def reference_step(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    grad: torch.Tensor,
    params: DimuonParams,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(new weight, new momentum), all float64."""
    momentum = params.beta1 * momentum + (1 - params.beta1) * grad
    if not momentum.any():  # LoRA A's first gradient (B starts at zero): no direction
        return weight, momentum
    mean_square = (momentum**2).mean()
    rows = (momentum**2).mean(dim=1, keepdim=True) / mean_square + params.damping
    cols = (momentum**2).mean(dim=0, keepdim=True) / mean_square + params.damping
    sign = reference_sign(momentum / rows**0.25 / cols**0.25)
    step = math.sqrt(rank) * sign / sign.norm()
    lr = params.learning_rate * (32 / rank) ** params.rank_lr_correction_exponent
    return weight - lr * step, momentum


@pytest.mark.parametrize("shape", [(RANK, 24), (24, RANK), (RANK, RANK)])
def test_steps_match_the_float64_reference(shape: tuple[int, int]) -> None:
    """Three steps of momentum, preconditioner, Newton-Schulz sign and rank-corrected
    learning rate equal the reference's, for LoRA A-, B- and square-shaped matrices."""
    gen = torch.Generator().manual_seed(sum(shape))
    weight = torch.nn.Parameter(torch.randn(shape, generator=gen))
    expected, momentum = weight.detach().double().clone(), torch.zeros(shape, dtype=torch.float64)
    state: dict[torch.Tensor, dict] = {}
    for step in range(3):
        grad = torch.randn(shape, generator=gen) * 10.0 ** (step - 2)  # scales vary
        weight.grad = grad.clone()
        optimizers.dimuon_step([weight], state, PARAMS, RANK)
        expected, momentum = reference_step(expected, momentum, grad.double(), PARAMS, RANK)
        torch.testing.assert_close(
            state[weight]["exp_avg"].double(), momentum, rtol=1e-6, atol=1e-9
        )
        torch.testing.assert_close(weight.detach().double(), expected, rtol=1e-5, atol=1e-6)
    assert int(state[weight]["step"]) == 3


def test_the_direction_has_norm_sqrt_rank_and_ignores_the_gradient_scale() -> None:
    """||D||_F = sqrt(rank) exactly; D(c * M) = D(M); D points where the exact matrix sign
    U V^T does (Newton-Schulz's singular values are near, not at, 1)."""
    m = torch.randn(RANK, 32, generator=torch.Generator().manual_seed(7))
    d = optimizers.direction(m, RANK, 1e-4)
    assert float(d.norm()) == pytest.approx(math.sqrt(RANK), rel=1e-5)
    torch.testing.assert_close(optimizers.direction(m * 1e-3, RANK, 1e-4), d, rtol=1e-4, atol=1e-5)
    u, _, vt = torch.linalg.svd(optimizers.preconditioned(m, 1e-4), full_matrices=False)
    exact = u @ vt
    cosine = float((d * exact).sum() / (d.norm() * exact.norm()))
    assert cosine > 0.95


def test_rank_correction_is_relative_to_rank_32() -> None:
    """lr * (32 / rank) ** exponent; exponent 0 turns it off."""
    assert optimizers.learning_rate(PARAMS, 32) == PARAMS.learning_rate
    assert optimizers.learning_rate(PARAMS, 8) == pytest.approx(0.02 * 4**0.175)
    off = PARAMS.model_copy(update={"rank_lr_correction_exponent": 0.0})
    assert optimizers.learning_rate(off, 8) == PARAMS.learning_rate


# --- through the engine ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(scratch: torch.Tensor, models_dir: torch.Tensor) -> Driver:
    return make_driver(
        scratch, models_dir, "storage-dimuon", max_resident_adapters=64, snapshot_every_steps=2
    )


def create_dimuon(driver: Driver, model_id: str, seed: int) -> None:
    lora = LoraConfig(rank=RANK, seed=seed, optimizer=Optimizer.DIMUON).model_dump(mode="json")
    driver.op(
        model_id,
        OpKind.CREATE_MODEL,
        {"lora_config": lora, "tenant_id": "default", "base_model": BASE},
    )


def dimuon_train(driver: Driver, model_id: str, texts: list[str]) -> None:
    driver.fb(model_id, batch(texts))
    driver.op(model_id, OpKind.OPTIM_STEP, PARAMS.model_dump(mode="json"))


def test_an_engine_step_is_the_reference_step_of_its_gradients(engine: Driver) -> None:
    """A Dimuon run's optim_step moves every LoRA tensor as the reference does from the
    gradients its forward_backward left (rank correction at the run's rank)."""
    create_dimuon(engine, "dm-a", seed=3)
    for texts in (TEXTS, TEXTS[1:]):
        before = engine.weights("dm-a")
        momenta = {
            k: v.double() for k, v in engine.moments("dm-a").items() if k.endswith(".exp_avg")
        }
        engine.fb("dm-a", batch(texts))
        grads = engine.grads("dm-a")
        engine.op("dm-a", OpKind.OPTIM_STEP, PARAMS.model_dump(mode="json"))
        after = engine.weights("dm-a")
        for key, grad in grads.items():
            momentum = momenta.get(f"{key}.exp_avg", torch.zeros_like(grad).double())
            expected, _ = reference_step(
                before[key].double(), momentum, grad.double(), PARAMS, RANK
            )
            torch.testing.assert_close(after[key].double(), expected, rtol=1e-5, atol=1e-6)
    assert engine.adapter("dm-a").step == 2
    assert not any(k.endswith("exp_avg_sq") for k in engine.moments("dm-a"))


def test_a_saved_dimuon_state_resumes_exactly(engine: Driver) -> None:
    """save_state, then load it with its optimizer into a new Dimuon run: the next steps are
    the original's (the momentum was saved and restored)."""
    create_dimuon(engine, "dm-b", seed=5)
    dimuon_train(engine, "dm-b", TEXTS)
    path = engine.save("dm-b", "one-step")
    dimuon_train(engine, "dm-b", TEXTS[1:])
    dimuon_train(engine, "dm-b", TEXTS[:2])
    create_dimuon(engine, "dm-c", seed=6)
    engine.load("dm-c", path, optimizer=True)
    dimuon_train(engine, "dm-c", TEXTS[1:])
    dimuon_train(engine, "dm-c", TEXTS[:2])
    assert_tensors(engine.weights("dm-c"), engine.weights("dm-b"), **TIGHT)
    assert_tensors(engine.moments("dm-c"), engine.moments("dm-b"), **TIGHT)


def test_the_other_optimizers_hyperparameters_are_refused(engine: Driver) -> None:
    """AdamParams for a Dimuon run, DimuonParams for an AdamW run: the op fails naming
    optimizer_params and what to send; a Dimuon checkpoint does not load into an AdamW run."""
    create_dimuon(engine, "dm-d", seed=7)
    engine.fb("dm-d", batch())
    with pytest.raises(
        UserInputError,
        match="optimizer_params: this run was created with the dimuon optimizer; send DimuonParams",
    ):
        engine.op("dm-d", OpKind.OPTIM_STEP, AdamParams().model_dump())
    engine.create("adam-d", seed=8, rank=RANK)
    with pytest.raises(UserInputError, match="created with the adamw optimizer; send AdamParams"):
        engine.op("adam-d", OpKind.OPTIM_STEP, PARAMS.model_dump(mode="json"))
    path = engine.save("dm-d", "for-adam")
    with pytest.raises(UserInputError, match="LoRA config"):
        engine.load("adam-d", path, optimizer=True)
