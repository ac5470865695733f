"""The per-datum losses: values and per-token gradients against an independent reference.

The reference walks the tokens one at a time in plain Python floats and writes each loss's
gradient d loss / d logp in closed form, so a wrong formula, a missing stop-gradient or a wrong
clipping branch shows up as a mismatch rather than being reproduced.
"""

from __future__ import annotations

import math

import pytest
import torch

from queue_tinker.types.enums import BUILT_IN_LOSSES, LossFn
from queue_tinker.types.requests.loss_inputs import LOSS_SPECS
from queue_tinker.workers.training.losses import (
    LOSSES,
    STABLE_REINFORCE_TRUNCATION,
    Sequences,
    batch_loss,
    datum_loss,
    joined_batch_loss,
)

LOSS_NAMES = [f.value for f in BUILT_IN_LOSSES]
TOKEN_LOSSES = [name for name in LOSS_NAMES if name != "gspo"]  # one ratio per token
LO, HI, BETA, CAP = 0.8, 1.2, 0.3, STABLE_REINFORCE_TRUNCATION
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
        "sequence_ratio_mask": (torch.rand(length, generator=gen) < 0.6).float(),
    }
    inputs["sequence_ratio_mask"][0] = 1.0  # at least one token in the sequence ratio
    if length >= 4:  # two ratios of e (past stable_reinforce's cap), one per advantage sign
        inputs["logprobs"][2:4] = logp[2:4] - 1.0
        inputs["advantages"][2:4] = torch.tensor([0.7, -0.7])
    return logp.requires_grad_(), inputs


def pessimistic(r: float, a: float) -> tuple[float, float]:
    """PPO's clipped term -min(r·a, clip(r)·a) and its derivative in r·(d r/d logp = r): the
    clipped objective wins only when strictly smaller, and then it is constant in logp (the
    ratio sits at a clip bound)."""
    r_clip = min(max(r, LO), HI)
    if r_clip * a < r * a:
        return -r_clip * a, 0.0
    return -r * a, -r * a


def sequence_ratio(logp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> float:
    """GSPO's s: exp of the mean of logp - q over the tokens the mask marks, in floats."""
    marked = [
        lp - q
        for lp, q, m in zip(
            logp.tolist(),
            inputs["logprobs"].tolist(),
            inputs["sequence_ratio_mask"].tolist(),
            strict=True,
        )
        if m != 0
    ]
    return math.exp(sum(marked) / len(marked))


def reference(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple:
    """(loss, d loss / d logp) token by token, in floats, with hand-written gradients. Every
    loss scales each token's term by its weight."""
    total, grads = 0.0, []
    cols = [inputs[k].tolist() for k in ("weights", "logprobs", "advantages")]
    s = sequence_ratio(logp, inputs)
    for lp, (w, q, a) in zip(logp.tolist(), zip(*cols, strict=True), strict=True):
        r = math.exp(lp - q)
        if loss_fn == "cross_entropy":
            term, grad = -lp, -1.0
        elif loss_fn == "importance_sampling":
            term, grad = -r * a, -r * a
        elif loss_fn == "ppo":
            term, grad = pessimistic(r, a)
        elif loss_fn == "cispo":
            r_clip = min(max(r, LO), HI)
            term, grad = -r_clip * a * lp, -r_clip * a
        elif loss_fn == "dro":
            term = -(a * lp - BETA / 2 * (lp - q) ** 2)
            grad = -(a - BETA * (lp - q))
        elif loss_fn == "gspo":
            # Every token's ratio is s in value; its gradient is s·d logp (GSPO-token).
            term, grad = pessimistic(s, a)
        elif loss_fn == "stable_reinforce":
            r_cap = min(r, CAP)
            term, grad = -r_cap * a * lp, -r_cap * a
        else:
            raise AssertionError(loss_fn)
        total += w * term
        grads.append(w * grad)
    return torch.tensor(total, dtype=torch.float32), torch.tensor(grads, dtype=torch.float32)


def grad_of(loss: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def test_registry_has_every_loss() -> None:
    """The worker has the math of exactly the closed list of losses."""
    assert sorted(LOSSES) == sorted(LOSS_NAMES)
    assert set(LOSS_SPECS) == set(LossFn)  # the custom loss is checked too, its math uploaded


def test_data_cover_every_clip_case() -> None:
    """Guard for the reference test: ratios below LO and above HI, with both advantage signs."""
    logp, inputs = make_datum(0)
    ratio = torch.exp(logp.detach() - inputs["logprobs"])
    pos = inputs["advantages"] > 0
    for outside in (ratio < LO, ratio > HI):
        assert (outside & pos).sum() >= 3
        assert (outside & ~pos).sum() >= 3
    assert ((ratio >= LO) & (ratio <= HI)).sum() >= 3
    assert ((ratio > CAP) & pos).sum() >= 1 and ((ratio > CAP) & ~pos).sum() >= 1


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
def test_a_loss_over_joined_datums_equals_the_datum_by_datum_batch(loss_fn: str) -> None:
    """joined_batch_loss on the datums' logprobs and inputs joined: the same loss, metrics and
    per-token gradients as batch_loss datum by datum (gspo: each token's ratio its own
    datum's, not one over all of them)."""
    data = [make_datum(seed, length) for seed, length in [(30, 5), (31, 17), (32, 1), (33, 40)]]
    total, metrics = batch_loss(loss_fn, [lp for lp, _ in data], [d for _, d in data], CONFIG)
    total.backward()
    joined_logp = torch.cat([lp.detach() for lp, _ in data]).requires_grad_()
    joined = {key: torch.cat([d[key] for _, d in data]) for key in data[0][1]}
    sequences = Sequences.of([lp.numel() for lp, _ in data], torch.device("cpu"))
    got, got_metrics = joined_batch_loss(loss_fn, joined_logp, joined, CONFIG, sequences)
    torch.testing.assert_close(got.detach(), total.detach(), **TOL)
    assert {k: float(v) for k, v in got_metrics.items()} == pytest.approx(metrics, rel=1e-5)
    got.backward()
    assert joined_logp.grad is not None
    torch.testing.assert_close(joined_logp.grad, torch.cat([lp.grad for lp, _ in data]), **TOL)


def test_sequences_lay_joined_datums_out_and_sum_each() -> None:
    """Sequences.of: each token's datum and place in it; sums: each datum's own, laid out a
    slot a token (no atomic adds, so a GPU adds in the same order every time)."""
    sequences = Sequences.of([3, 1, 2], torch.device("cpu"))
    assert sequences.index.tolist() == [0, 0, 0, 1, 2, 2]
    assert sequences.position.tolist() == [0, 1, 2, 0, 0, 1]
    assert (sequences.count, sequences.width) == (3, 3)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert sequences.sums(values).tolist() == [6.0, 4.0, 11.0]


def test_gspo_marks_its_sequence_ratio_by_selection() -> None:
    """A token that sequence_ratio_mask leaves out does not reach the sequence ratio, even
    with a logprob that is not finite there."""
    logp, inputs = make_datum(3, 8)
    inputs["sequence_ratio_mask"] = torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 1])
    inputs["logprobs"][2] = -math.inf
    loss = datum_loss("gspo", logp, inputs, CONFIG)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.detach(), reference("gspo", logp, inputs)[0], **TOL)


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_batch_metrics(loss_fn: str) -> None:
    """ratio:mean is the token mean of the ratio each term uses (gspo: its sequence's ratio);
    clipped losses add the fraction of tokens whose ratio is outside [LO, HI]."""
    data = [make_datum(seed, length) for seed, length in [(20, 30), (21, 50)]]
    _, metrics = batch_loss(loss_fn, [lp for lp, _ in data], [d for _, d in data], CONFIG)
    if loss_fn == "gspo":
        ratios = [sequence_ratio(logp, d) for logp, d in data for _ in range(logp.numel())]
    else:
        ratios = [
            math.exp(lp - q)
            for logp, d in data
            for lp, q in zip(logp.tolist(), d["logprobs"].tolist(), strict=True)
        ]
    if loss_fn == "cross_entropy":
        assert set(metrics) == {"loss:sum"}
        return
    assert metrics["ratio:mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    if loss_fn in ("ppo", "cispo", "gspo"):
        outside = sum(not LO <= r <= HI for r in ratios) / len(ratios)
        assert metrics["clip_fraction:mean"] == pytest.approx(outside)
        assert loss_fn == "gspo" or 0.0 < outside < 1.0
    else:
        assert "clip_fraction:mean" not in metrics


@pytest.mark.parametrize("shift", [-0.6, 0.0, 0.6])
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_clips_the_sequence_ratio(shift: float, seed: int) -> None:
    """With the sampler's logprobs moved so the sequence ratio is below LO, inside, or above HI,
    gspo's value and per-token gradients equal the reference (both advantage signs occur)."""
    logp, inputs = make_datum(seed)
    inputs["logprobs"] = inputs["logprobs"] + shift
    s = sequence_ratio(logp, inputs)
    expected_side = {-0.6: s > HI, 0.0: LO <= s <= HI, 0.6: s < LO}  # q lower: ratio higher
    assert expected_side[shift], s
    loss = datum_loss("gspo", logp, inputs, CONFIG)
    want_loss, want_grad = reference("gspo", logp, inputs)
    torch.testing.assert_close(loss.detach(), want_loss, **TOL)
    torch.testing.assert_close(grad_of(loss, logp), want_grad, **TOL)
    if shift:  # clipped: the tokens whose advantage makes the clipped term smaller get no grad
        assert (want_grad == 0).any() and (want_grad != 0).any()


def test_gspo_without_a_ratio_mask_takes_every_token() -> None:
    """No sequence_ratio_mask is the same as one marking every token."""
    logp, inputs = make_datum(5)
    inputs["logprobs"] = inputs["logprobs"] - 0.3
    without = {k: v for k, v in inputs.items() if k != "sequence_ratio_mask"}
    every = {**without, "sequence_ratio_mask": torch.ones_like(logp.detach())}
    loss_without = datum_loss("gspo", logp, without, CONFIG)
    torch.testing.assert_close(loss_without, datum_loss("gspo", logp, every, CONFIG), **TOL)
    torch.testing.assert_close(
        grad_of(loss_without, logp), reference("gspo", logp, every)[1], **TOL
    )


@pytest.mark.parametrize("loss_fn", LOSS_NAMES[1:])
def test_policy_losses_without_advantages_take_zeros(loss_fn: str) -> None:
    """A policy loss without advantages equals it with advantages of zero."""
    logp, inputs = make_datum(6)
    without = {k: v for k, v in inputs.items() if k != "advantages"}
    zeros = {**without, "advantages": torch.zeros_like(logp.detach())}
    loss = datum_loss(loss_fn, logp, without, CONFIG)
    torch.testing.assert_close(loss, datum_loss(loss_fn, logp, zeros, CONFIG), **TOL)
    torch.testing.assert_close(grad_of(loss, logp), reference(loss_fn, logp, zeros)[1], **TOL)


@pytest.mark.parametrize("loss_fn", TOKEN_LOSSES)
def test_zero_weights_mask_tokens_out(loss_fn: str) -> None:
    """A token of weight 0 adds nothing to the loss and gets no gradient, on every loss."""
    logp, inputs = make_datum(7, 12)
    inputs["weights"] = torch.tensor([1.0, 0.0] * 6)
    loss = datum_loss(loss_fn, logp, inputs, CONFIG)
    kept = {k: v[::2] for k, v in inputs.items()}
    kept_logp = logp.detach()[::2].clone().requires_grad_()
    torch.testing.assert_close(loss, datum_loss(loss_fn, kept_logp, kept, CONFIG), **TOL)
    grad = grad_of(loss, logp)
    assert torch.all(grad[1::2] == 0)


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
