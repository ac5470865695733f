"""Token choice on the device (token_choice.py): the draws hold to the distribution asked
(temperature, top_k, top_p; a fixed-seed chi-squared test), the cuts keep what a sort would,
a row's token does not depend on its batch mates, ties at a cut are all kept, and the uniforms'
integer hash is the one written out here in plain Python (what a fused kernel must match)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from queue_tinker.workers.sampling import token_choice
from queue_tinker.workers.sampling.token_choice import (
    MASS_BITS,
    STEP_STRIDE,
    UNIFORM_BITS,
    Cuts,
    choose,
    cut_masses,
    draw,
    sample_stream,
    step_uniforms,
)

WORD = 0xFFFF_FFFF


def cuts_of(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> Cuts:
    """The cuts a batch of these settings makes, as the decode loop finds them."""
    return Cuts.of_settings(top_k.tolist(), top_p.tolist(), vocab)


def lowbias32(x: int) -> int:
    """Wellons' lowbias32, in Python integers."""
    x ^= x >> 16
    x = (x * 0x7FEB_352D) & WORD
    x ^= x >> 15
    x = (x * 0x846C_A68B) & WORD
    return x ^ (x >> 16)


def uniform_of(seed: int, sample: int, step: int) -> int:
    high, low = sample_stream(seed, sample)
    return lowbias32(((high + step * STEP_STRIDE) & WORD) ^ low) >> (32 - UNIFORM_BITS)


def kept_by_sorting(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> dict[int, float]:
    """The reference: each kept token's probability, from softmax(logits / temperature)
    sorted, cut to its top_k, renormalised, cut to the smallest prefix holding top_p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    if 0 < top_k < len(order):
        order = order[:top_k]
    total = float(probs[order].sum())
    kept, mass = [], 0.0
    for token in order:
        kept.append(token)
        mass += float(probs[token])
        if mass >= top_p * total:
            break
    kept_mass = float(probs[kept].sum())
    return {token: float(probs[token]) / kept_mass for token in kept}


def chi_square_limit(degrees: int, z: float = 3.72) -> float:
    """The chi-squared value a fair draw exceeds with probability ~1e-4 (Wilson-Hilferty)."""
    h = 2 / (9 * degrees)
    return degrees * (1 - h + z * math.sqrt(h)) ** 3


def row_settings(
    rows: int, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.full((rows,), temperature),
        torch.full((rows,), top_k),
        torch.full((rows,), top_p),
    )


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "select"),
    [
        (1.0, -1, 1.0, False),
        (0.6, -1, 1.0, False),
        (1.4, 8, 1.0, False),
        (1.0, -1, 0.8, False),
        (0.9, 12, 0.7, False),
        (0.9, 12, 0.7, True),
    ],
    ids=["whole", "tempered", "top-k", "top-p", "top-k-and-p", "top-k-and-p-by-select"],
)
def test_draws_hold_to_the_distribution_asked(
    temperature: float, top_k: int, top_p: float, select: bool
) -> None:
    """40,000 draws (200 samples x 200 steps of their streams) from one row's logits: no token
    outside the kept set, and chi-squared over the kept ones within the 1e-4 tail (`select`:
    the nucleus by the radix select over the vocabulary, not among the top_k candidates)."""
    vocab, samples, steps = 48, 200, 200
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    streams = torch.tensor([sample_stream(7, j) for j in range(samples)]).repeat_interleave(
        steps, dim=0
    )
    uniforms = step_uniforms(streams, torch.arange(steps).repeat(samples))
    rows = samples * steps
    settings = row_settings(rows, temperature, top_k, top_p)
    cuts = cuts_of(settings[1], settings[2], vocab)
    cuts = replace(cuts, nucleus_in_top_k=cuts.nucleus_in_top_k and not select)
    tokens = draw(
        logits.expand(rows, vocab), *row_settings(rows, temperature, top_k, top_p), uniforms, cuts
    )
    counts = torch.bincount(tokens, minlength=vocab)
    expected = kept_by_sorting(logits, temperature, top_k, top_p)
    outside = [t for t in range(vocab) if t not in expected and counts[t] > 0]
    assert not outside, f"drawn outside the kept set: {outside}"
    statistic = sum((float(counts[t]) - rows * p) ** 2 / (rows * p) for t, p in expected.items())
    assert statistic < chi_square_limit(len(expected) - 1), (statistic, len(expected))


def test_the_cuts_keep_what_sorting_keeps() -> None:
    """Random logits and settings per row: the tokens with mass are the sorted reference's
    kept set, and their masses its probabilities (to the masses' resolution)."""
    rows, vocab = 64, 300
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn((rows, vocab), generator=generator) * 2
    choices = random.Random(2)
    settings = [
        (
            choices.uniform(0.3, 2.0),
            choices.choice([-1, 1, 5, 40, 299, 300, 1000]),
            choices.choice([1.0, 0.95, 0.5, 0.1, 1e-6]),
        )
        for _ in range(rows)
    ]
    temperature, top_k, top_p = (torch.tensor(column) for column in zip(*settings, strict=True))
    cuts = cuts_of(top_k, top_p, vocab)
    assert cuts.top_k and cuts.top_p and not cuts.nucleus_in_top_k  # the select over the vocab
    masses = cut_masses(logits, temperature, top_k, top_p, cuts)
    # Rows that cut both find their nucleus among the top_k candidates just as well.
    both = (top_k > 0) & (top_k < vocab) & (top_p < 1)
    among = cut_masses(
        *(x[both] for x in (logits, temperature, top_k, top_p)),
        replace(cuts, nucleus_in_top_k=True),
    )
    assert int(both.sum()) > 10 and torch.equal(among, masses[both])
    for row, (t, k, p) in enumerate(settings):
        expected = kept_by_sorting(logits[row], t, k, p)
        kept = masses[row].nonzero().squeeze(1).tolist()
        assert sorted(kept) == sorted(expected), (row, t, k, p)
        shares = masses[row, kept].double() / masses[row].sum()
        want = torch.tensor([expected[token] for token in kept], dtype=torch.float64)
        torch.testing.assert_close(shares, want, rtol=1e-5, atol=2.0**-MASS_BITS * vocab)


def test_a_row_draws_the_same_token_whatever_shares_its_batch() -> None:
    """In a batch, reversed, and alone (its batch's cuts its own: other candidates, or none),
    a row draws the same token."""
    rows, vocab = 40, 500
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(3)) * 3
    temperature = torch.linspace(0.4, 1.6, rows)
    top_k = torch.tensor([[-1, 3, 50, 499][i % 4] for i in range(rows)])
    top_p = torch.tensor([[1.0, 0.9, 0.3][i % 3] for i in range(rows)])
    streams = torch.tensor([sample_stream(11, j) for j in range(rows)])
    steps = torch.arange(rows) * 17
    uniforms = step_uniforms(streams, steps)
    together = draw(logits, temperature, top_k, top_p, uniforms, cuts_of(top_k, top_p, vocab))
    reversed_rows = torch.arange(rows - 1, -1, -1)
    backwards = draw(
        logits[reversed_rows],
        temperature[reversed_rows],
        top_k[reversed_rows],
        top_p[reversed_rows],
        uniforms[reversed_rows],
        cuts_of(top_k[reversed_rows], top_p[reversed_rows], vocab),
    )
    assert torch.equal(backwards.flip(0), together)
    for row in range(rows):
        at = slice(row, row + 1)
        cuts = cuts_of(top_k[at], top_p[at], vocab)
        alone = draw(logits[at], temperature[at], top_k[at], top_p[at], uniforms[at], cuts)
        assert int(alone) == int(together[row]), row
    # Every batch of rows that cut both finds their nuclei among its candidates; a batch with
    # a wider top_k has more of them.
    both = (top_k > 0) & (top_k < vocab) & (top_p < 1)
    cuts = cuts_of(top_k[both], top_p[both], vocab)
    assert cuts.nucleus_in_top_k
    for wider in (cuts, replace(cuts, top_k=vocab)):
        among = draw(*(x[both] for x in (logits, temperature, top_k, top_p, uniforms)), wider)
        assert torch.equal(among, together[both])


def test_ties_at_a_cut_are_all_kept_and_drawn_in_token_order() -> None:
    """Equal logits (frequent in bf16) straddling the k-th place are all kept, with equal
    masses; a uniform sweeping [0, 1) draws the kept tokens in id order, so no sort's order of
    ties can change a draw."""
    vocab = 64
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(4))
    tied = [50, 3, 20]
    logits[tied] = logits.max() + 1
    logits[[7]] = logits.max() + 2  # one above them
    one = torch.ones(1)
    for top_k, top_p in ((2, 1.0), (3, 1.0), (4, 1.0), (-1, 0.7)):
        masses = cut_masses(
            logits[None],
            one,
            torch.tensor([top_k]),
            torch.tensor([top_p]),
            cuts_of(torch.tensor([top_k]), torch.tensor([top_p]), vocab),
        )[0]
        kept = masses.nonzero().squeeze(1).tolist()
        assert set(kept) >= {7, *tied}, (top_k, top_p)
        assert len({int(masses[t]) for t in tied}) == 1
    masses = cut_masses(logits[None], one, torch.tensor([2]), torch.ones(1), Cuts(top_k=2))[0]
    assert masses.nonzero().squeeze(1).tolist() == [3, 7, 20, 50]
    sweep = torch.arange(0, 1 << UNIFORM_BITS, 1 << (UNIFORM_BITS - 10))
    drawn = draw(
        logits.expand(len(sweep), vocab),
        one.expand(len(sweep)),
        torch.full((len(sweep),), 2),
        torch.ones(len(sweep)),
        sweep,
        Cuts(top_k=2),
    )
    assert torch.unique_consecutive(drawn).tolist() == [3, 7, 20, 50]


def test_uniforms_are_the_integer_hash_written_out() -> None:
    """step_uniforms is lowbias32 of the stream's counter, as plain Python computes it (steps
    up to 2**31, streams' words up to 2**32 - 1); 24-bit values spread evenly over their
    range."""
    seeds = [0, 1, 2**63, 2**64 - 1, 123456789]
    streams = torch.tensor([sample_stream(seed, j) for seed in seeds for j in range(4)])
    steps = torch.tensor([0, 1, 63, 64, 2**31 - 1, 7, 9, 100] * (len(seeds) * 4 // 8 + 1))
    steps = steps[: len(streams)]
    got = step_uniforms(streams, steps).tolist()
    want = [
        uniform_of(seed, j, int(steps[i]))
        for i, (seed, j) in enumerate((seed, j) for seed in seeds for j in range(4))
    ]
    assert got == want
    samples, length = 64, 1024
    many = step_uniforms(
        torch.tensor([sample_stream(5, j) for j in range(samples)]).repeat_interleave(length, 0),
        torch.arange(length).repeat(samples),
    )
    assert int(many.min()) >= 0 and int(many.max()) < 1 << UNIFORM_BITS
    bins = torch.bincount(many >> (UNIFORM_BITS - 4), minlength=16).double()
    fair = samples * length / 16
    assert float(((bins - fair) ** 2 / fair).sum()) < chi_square_limit(15)
    # Two samples' streams are not one stream shifted: no run of 4 equal draws at any lag.
    first, second = many[:length].tolist(), many[length : 2 * length].tolist()
    runs = {tuple(first[i : i + 4]) for i in range(length - 3)}
    assert not any(tuple(second[i : i + 4]) in runs for i in range(length - 3))


def test_choose_takes_greedy_rows_argmax_and_the_models_logprobs() -> None:
    rows, vocab = 6, 90
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(6)) * 2
    greedy = torch.tensor([True, False, True, False, False, True])
    temperature, top_k, top_p = row_settings(rows, 0.8, 10, 0.9)
    streams = torch.tensor([sample_stream(3, j) for j in range(rows)])
    uniforms = step_uniforms(streams, torch.zeros(rows, dtype=torch.long))
    cuts = cuts_of(top_k, top_p, vocab)
    choices = choose(logits, greedy, temperature, top_k, top_p, uniforms, cuts, [0, 2] * 3)
    drawn = draw(torch.log_softmax(logits, -1), temperature, top_k, top_p, uniforms, cuts)
    assert torch.equal(choices.tokens, torch.where(greedy, logits.argmax(-1), drawn))
    logprobs = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(choices.logprobs, logprobs.gather(1, choices.tokens[:, None])[:, 0])
    assert choices.candidates is not None
    torch.testing.assert_close(choices.candidates[0], logprobs.topk(2, dim=-1).values)
    every_greedy = choose(logits, greedy, temperature, top_k, top_p, None, cuts, [0] * rows)
    assert torch.equal(every_greedy.tokens, logits.argmax(-1))
    assert every_greedy.candidates is None


def test_choices_in_row_chunks_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    rows, vocab = 10, 70
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(8))
    settings = row_settings(rows, 1.1, 20, 0.8)
    uniforms = step_uniforms(
        torch.tensor([sample_stream(1, j) for j in range(rows)]), torch.arange(rows)
    )
    greedy = torch.zeros(rows, dtype=torch.bool)
    cuts = cuts_of(settings[1], settings[2], vocab)
    whole = choose(logits, greedy, *settings, uniforms, cuts, [3] * rows)
    monkeypatch.setattr(token_choice, "CHOICE_CHUNK_ELEMENTS", 3 * vocab)
    chunked = choose(logits, greedy, *settings, uniforms, cuts, [3] * rows)
    assert torch.equal(whole.tokens, chunked.tokens)
    assert torch.equal(whole.logprobs, chunked.logprobs)
