"""The per-datum losses: values and per-token gradients against an independent reference.

The reference walks the tokens one at a time in plain Python floats and writes each loss's
gradient d loss / d logp in closed form, so a wrong formula, a missing stop-gradient or a wrong
clipping branch shows up as a mismatch rather than being reproduced.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.losses import LOSSES, batch_loss, datum_loss

LOSS_NAMES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
LO, HI, BETA = 0.8, 1.2, 0.3
CONFIG = {"clip_low_threshold": LO, "clip_high_threshold": HI, "beta": BETA}
TOL = {"rtol": 1e-5, "atol": 1e-6}


def make_datum(seed: int, length: int = 64) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Model logprobs (leaf, with grad) and inputs whose sampling logprobs are off by noise of
    scale 0.5, so that a good share of ratios fall outside [LO, HI] on both sides."""
    gen = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(length, generator=gen)
    inputs = {
        "target_tokens": torch.randint(0, 1000, (length,), generator=gen),
        "weights": torch.randn(length, generator=gen),
        "logprobs": logp + 0.5 * torch.randn(length, generator=gen),
        "advantages": torch.randn(length, generator=gen),
    }
    return logp.requires_grad_(), inputs


def reference(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple:
    """(loss, d loss / d logp) token by token, in floats, with hand-written gradients."""
    total, grads = 0.0, []
    cols = [inputs[k].tolist() for k in ("weights", "logprobs", "advantages")]
    for lp, (w, q, a) in zip(logp.tolist(), zip(*cols, strict=True), strict=True):
        r = math.exp(lp - q)
        r_clip = min(max(r, LO), HI)
        if loss_fn == "cross_entropy":
            term, grad = -w * lp, -w
        elif loss_fn == "importance_sampling":
            term, grad = -r * a, -r * a
        elif loss_fn == "ppo":
            # Pessimistic choice: the clipped objective wins only when strictly smaller, and
            # then it is constant in logp (the ratio sits at a clip bound).
            if r_clip * a < r * a:
                term, grad = -r_clip * a, 0.0
            else:
                term, grad = -r * a, -r * a
        elif loss_fn == "cispo":
            term, grad = -r_clip * a * lp, -r_clip * a
        elif loss_fn == "dro":
            term = -(a * lp - BETA / 2 * (lp - q) ** 2)
            grad = -(a - BETA * (lp - q))
        else:
            raise AssertionError(loss_fn)
        total += term
        grads.append(grad)
    return torch.tensor(total, dtype=torch.float32), torch.tensor(grads, dtype=torch.float32)


def grad_of(loss: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def test_registry_has_every_loss() -> None:
    assert sorted(LOSSES) == sorted(LOSS_NAMES)


def test_data_cover_every_clip_case() -> None:
    """Guard for the reference test: ratios below LO and above HI, with both advantage signs."""
    logp, inputs = make_datum(0)
    ratio = torch.exp(logp.detach() - inputs["logprobs"])
    pos = inputs["advantages"] > 0
    for outside in (ratio < LO, ratio > HI):
        assert (outside & pos).sum() >= 3
        assert (outside & ~pos).sum() >= 3
    assert ((ratio >= LO) & (ratio <= HI)).sum() >= 3


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_and_grad_match_reference(loss_fn: str, seed: int) -> None:
    logp, inputs = make_datum(seed)
    loss = datum_loss(loss_fn, logp, inputs, CONFIG)
    assert loss.shape == ()
    assert loss.dtype == torch.float32
    want_loss, want_grad = reference(loss_fn, logp, inputs)
    torch.testing.assert_close(loss.detach(), want_loss, **TOL)
    torch.testing.assert_close(grad_of(loss, logp), want_grad, **TOL)


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_batch_loss_sums_datum_losses(loss_fn: str) -> None:
    data = [make_datum(seed, length) for seed, length in [(10, 5), (11, 17), (12, 1)]]
    logps = [lp for lp, _ in data]
    inputs = [d for _, d in data]
    total, metrics = batch_loss(loss_fn, logps, inputs, CONFIG)
    want = sum(datum_loss(loss_fn, lp, d, CONFIG).item() for lp, d in data)
    torch.testing.assert_close(total.detach(), torch.tensor(want), **TOL)
    assert metrics["loss:sum"] == pytest.approx(total.item())
    total.backward()
    for lp, d in data:  # each datum's gradient is that of its own loss
        torch.testing.assert_close(lp.grad, reference(loss_fn, lp, d)[1], **TOL)


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_batch_metrics(loss_fn: str) -> None:
    data = [make_datum(seed, length) for seed, length in [(20, 30), (21, 50)]]
    _, metrics = batch_loss(loss_fn, [lp for lp, _ in data], [d for _, d in data], CONFIG)
    ratios = [
        math.exp(lp - q)
        for logp, d in data
        for lp, q in zip(logp.tolist(), d["logprobs"].tolist(), strict=True)
    ]
    if loss_fn == "cross_entropy":
        assert set(metrics) == {"loss:sum"}
        return
    assert metrics["ratio:mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    if loss_fn in ("ppo", "cispo"):
        outside = sum(not LO <= r <= HI for r in ratios) / len(ratios)
        assert metrics["clip_fraction:mean"] == pytest.approx(outside)
        assert 0.0 < outside < 1.0
    else:
        assert "clip_fraction:mean" not in metrics


def test_empty_batch() -> None:
    total, metrics = batch_loss("ppo", [], [], CONFIG)
    assert total.item() == 0.0
    assert metrics == {"loss:sum": 0.0}


def test_unknown_loss_raises_naming_it() -> None:
    logp, inputs = make_datum(0, 4)
    with pytest.raises(ValueError, match="'no_such_loss'"):
        datum_loss("no_such_loss", logp, inputs, CONFIG)
    with pytest.raises(ValueError, match="'no_such_loss'"):
        batch_loss("no_such_loss", [logp], [inputs], CONFIG)


def test_cross_entropy_without_weights_equals_ones() -> None:
    logp, inputs = make_datum(3)
    unweighted = {k: v for k, v in inputs.items() if k != "weights"}
    ones = {**unweighted, "weights": torch.ones_like(logp.detach())}
    loss_none = datum_loss("cross_entropy", logp, unweighted, CONFIG)
    loss_ones = datum_loss("cross_entropy", logp, ones, CONFIG)
    torch.testing.assert_close(loss_none, loss_ones, **TOL)
    torch.testing.assert_close(grad_of(loss_none, logp), grad_of(loss_ones, logp), **TOL)
    torch.testing.assert_close(loss_none.detach(), -logp.detach().sum(), **TOL)


def test_negative_weights_negate_gradient() -> None:
    logp, inputs = make_datum(4)
    negated = {**inputs, "weights": -inputs["weights"]}
    loss = datum_loss("cross_entropy", logp, inputs, CONFIG)
    neg_loss = datum_loss("cross_entropy", logp, negated, CONFIG)
    torch.testing.assert_close(neg_loss, -loss, **TOL)
    neg_grad = grad_of(neg_loss, logp)
    torch.testing.assert_close(neg_grad, -grad_of(loss, logp), **TOL)
    torch.testing.assert_close(neg_grad, inputs["weights"], **TOL)
