"""Top-k and target prompt logprobs: equal to a reference computed from the full logits of the
prompt run alone, both for the function on one left-padded row and through the sampling loop
in a mixed batch (padding, requests that ask for nothing)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from queue_tinker.builtin_models import load_tokenizer
from queue_tinker.errors import UserInputError
from queue_tinker.settings import Settings
from queue_tinker.types.requests.request_limits import RequestLimits
from queue_tinker.types.requests.sampling import NO_TARGET, SamplingParams, sample_input
from queue_tinker.workers.model.base_model import load_base_model
from queue_tinker.workers.sampling import prompt_scores as module
from queue_tinker.workers.sampling.decode_loop import GenerationRequest, generate
from queue_tinker.workers.sampling.prompt_scores import prompt_scores

BASE = "queue-tinker/tiny-llama"
TOL = {"rtol": 1e-5, "atol": 1e-6}
SEEDED = SamplingParams(seed=0)


@dataclass(frozen=True)
class Ask:
    prompt: list[int]
    prompt_logprobs: bool = False
    prompt_topk: int = 0
    prompt_targets: list[list[int]] | None = None
    prompt_alt_k: int = 0
    params: SamplingParams = SEEDED


def reference(
    logits: torch.Tensor, prompt: list[int], k: int, targets: list[list[int]] | None
) -> tuple[list, list]:
    """Top-k (id, logprob) per position and the targets' logprobs, from the full softmax."""
    full = torch.log_softmax(logits[: len(prompt) - 1].double(), dim=-1)
    topk = []
    for row in full:
        order = torch.argsort(row, descending=True)[:k]
        topk.append([(int(i), float(row[i])) for i in order])
    lps = [
        [0.0 if t == NO_TARGET else float(full[i, t]) for t in row]
        for i, row in enumerate(targets or [])
    ]
    return topk, lps


def assert_topk(got: list, want: list) -> None:
    assert got[0] is None and len(got) == len(want) + 1
    for got_row, want_row in zip(got[1:], want, strict=True):
        assert [i for i, _ in got_row] == [i for i, _ in want_row]
        torch.testing.assert_close(
            torch.tensor([v for _, v in got_row]),
            torch.tensor([v for _, v in want_row], dtype=torch.float32),
            **TOL,
        )


def targets_for(prompt: list[int], gen: torch.Generator, vocab: int, k: int = 3) -> list:
    ids = torch.randint(0, vocab, (len(prompt) - 1, k), generator=gen)
    ids[::2, 0] = NO_TARGET  # some cells ask for nothing
    return ids.tolist()


@pytest.mark.parametrize("pad", [0, 5])
def test_one_padded_row_equals_the_full_logits_reference(pad: int) -> None:
    """prompt_scores on a left-padded row: top-k in order, target logprobs (0.0 where -1) and
    prompt logprobs equal the full-softmax reference (rtol 1e-5), across chunk boundaries."""
    gen = torch.Generator().manual_seed(pad)
    prompt = torch.randint(0, 300, (9,), generator=gen).tolist()
    logits = torch.randn(len(prompt), 300, generator=gen) * 3
    padded = torch.cat([torch.randn(pad, 300, generator=gen), logits])
    targets = targets_for(prompt, gen, 300)
    ask = Ask(prompt, prompt_logprobs=True, prompt_topk=7, prompt_targets=targets)
    chunk, module.CHUNK_ELEMENTS = module.CHUNK_ELEMENTS, 2 * 300  # 2 rows a chunk
    try:
        got = prompt_scores(padded, ask)
    finally:
        module.CHUNK_ELEMENTS = chunk
    want_topk, want_targets = reference(logits, prompt, 7, targets)
    assert_topk(got["topk_prompt_logprobs"], want_topk)
    torch.testing.assert_close(
        torch.tensor(got["target_prompt_logprobs"]),
        torch.tensor(want_targets, dtype=torch.float32),
        **TOL,
    )
    assert all(row[0] == 0.0 for row in got["target_prompt_logprobs"][::2])
    full = torch.log_softmax(logits[:-1], dim=-1)
    want_lps = full.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(got["prompt_logprobs"][1:]), want_lps, **TOL)
    assert prompt_scores(padded, Ask(prompt)) == {}
    assert set(prompt_scores(padded, Ask(prompt, prompt_topk=2))) == {"topk_prompt_logprobs"}


def test_prompt_alternatives_are_draws_at_the_temperature_with_the_model_s_logprobs() -> None:
    """prompt_alt_tokens_k: k draws per position after the first; their logprobs are the full
    log-softmax's (rtol 1e-5, whatever the temperature); the same seed draws the same tokens;
    greedy draws the most likely token k times; at temperature 1 the draws' frequencies follow
    the model's probabilities, and at temperature 0.25 they crowd onto the likely tokens."""
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 8, (6,), generator=gen).tolist()
    logits = torch.randn(len(prompt), 8, generator=gen) * 2
    padded = torch.cat([torch.randn(3, 8, generator=gen), logits])
    full = torch.log_softmax(logits[:-1], dim=-1)

    def alternatives(k: int, params: SamplingParams) -> dict[str, list[list[float]]]:
        scores = prompt_scores(padded, Ask(prompt, prompt_alt_k=k, params=params))
        assert set(scores) == {"prompt_alt_tokens"}
        alt: dict[str, list[list[float]]] = scores["prompt_alt_tokens"]
        assert len(alt["tokens"]) == len(prompt) - 1
        assert all(len(row) == k for row in alt["tokens"])
        want = full.gather(1, torch.tensor(alt["tokens"]))
        torch.testing.assert_close(torch.tensor(alt["logprobs"]), want, **TOL)
        return alt

    greedy = alternatives(3, SamplingParams(temperature=0.0))
    assert greedy["tokens"] == full.argmax(dim=-1, keepdim=True).expand(-1, 3).tolist()
    warm = SamplingParams(temperature=1.0, seed=5)
    many = alternatives(4096, warm)
    assert many == alternatives(4096, warm)  # seeded
    assert many != alternatives(4096, SamplingParams(temperature=1.0, seed=6))
    counts = torch.stack([torch.bincount(torch.tensor(r), minlength=8) for r in many["tokens"]])
    torch.testing.assert_close(counts / 4096, full.exp(), rtol=0, atol=0.03)
    cold = alternatives(4096, SamplingParams(temperature=0.25, seed=5))
    likely = full.argmax(dim=-1)
    share = [sum(t == int(likely[i]) for t in row) / 4096 for i, row in enumerate(cold["tokens"])]
    tempered = torch.softmax(logits[:-1] / 0.25, dim=-1).gather(1, likely[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(share), tempered, rtol=0, atol=0.03)


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[torch.nn.Module, object]]:
    path = Path(tempfile.mkdtemp(prefix="qt-prompt-scores-"))
    model = load_base_model(BASE, "cpu", path).eval()
    yield model, load_tokenizer(BASE, path).decode
    shutil.rmtree(path, ignore_errors=True)


def test_the_sampling_loop_returns_them_in_a_mixed_batch(tiny: tuple) -> None:
    """Through generate(): requests of different lengths (so padded) asking for top-k, targets,
    both, or nothing get exactly the reference for their own prompt run alone."""
    model, decode = tiny
    gen = torch.Generator().manual_seed(3)
    prompts = [list(b"the quick brown fox"), list(b"ab"), list(b"hello there"), [65]]
    vocab = model.config.vocab_size
    asks = [
        (4, targets_for(prompts[0], gen, vocab)),
        (2, None),
        (0, targets_for(prompts[2], gen, vocab, k=1)),
        (3, []),
    ]
    requests = [
        GenerationRequest(
            prompt=p,
            num_samples=1,
            params=SamplingParams(seed=0),
            max_tokens=2,
            prompt_logprobs=False,
            adapter=None,
            prompt_topk=k,
            prompt_targets=t,
        )
        for p, (k, t) in zip(prompts, asks, strict=True)
    ]
    responses = generate(
        model, requests, device=torch.device("cpu"), eos_token_ids=[257], decode=decode
    )
    for req, response in zip(requests, responses, strict=True):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([req.prompt])).logits[0].float()
        want_topk, want_targets = reference(logits, req.prompt, req.prompt_topk, req.prompt_targets)
        if req.prompt_topk:
            assert response.topk_prompt_logprobs is not None
            assert_topk(response.topk_prompt_logprobs, want_topk)
        else:
            assert response.topk_prompt_logprobs is None
        if req.prompt_targets is None:
            assert response.target_prompt_logprobs is None
        else:
            torch.testing.assert_close(
                torch.tensor(response.target_prompt_logprobs or [], dtype=torch.float32),
                torch.tensor(want_targets, dtype=torch.float32),
                **TOL,
            )
        assert response.prompt_logprobs is None


def test_sampled_top_k_logprobs_equal_the_full_logits_of_the_sequence(tiny: tuple) -> None:
    """topk_sample_logprobs=k: at every generated position, the k most likely tokens and
    their logprobs under the model equal the full log-softmax of a plain forward over prompt +
    tokens so far (rtol 1e-5), in a batch with a request that asks for none; asking changes no
    token the request samples."""
    model, decode = tiny

    def request(prompt: bytes, k: int) -> GenerationRequest:
        return GenerationRequest(
            prompt=list(prompt),
            num_samples=2,
            params=SamplingParams(seed=4, temperature=1.0),
            max_tokens=6,
            prompt_logprobs=False,
            adapter=None,
            sample_topk=k,
        )

    asked, plain = request(b"the quick brown", 5), request(b"hi", 0)
    got, other = generate(
        model, [asked, plain], device=torch.device("cpu"), eos_token_ids=[257], decode=decode
    )
    (alone,) = generate(
        model,
        [request(b"the quick brown", 0)],
        device=torch.device("cpu"),
        eos_token_ids=[257],
        decode=decode,
    )
    assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]
    assert all(s.topk_logprobs is None for s in other.sequences)
    for sequence in got.sequences:
        assert sequence.topk_logprobs is not None
        assert len(sequence.topk_logprobs) == len(sequence.tokens)
        ids = asked.prompt + sequence.tokens
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        full = torch.log_softmax(logits[len(asked.prompt) - 1 : -1].double(), dim=-1)
        for position, pairs in enumerate(sequence.topk_logprobs):
            values, order = full[position].topk(5)
            assert [i for i, _ in pairs] == order.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in pairs]), values.float(), **TOL)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        ([[1, 2]], "has 1 rows for a prompt of 4 tokens"),
        ([[1, 2], [3], [4, 5]], "rows must all have the same number of ids"),
        ([[1], [-2], [3]], "token ids must be >= 0"),
    ],
)
def test_bad_targets_are_refused_naming_the_field(targets: list, message: str) -> None:
    """A target_prompt_logprobs of the wrong shape or with negative ids fails at the client."""
    with pytest.raises(UserInputError, match=f"target_prompt_logprobs: .*{message}"):
        sample_input(
            {"chunks": [{"tokens": [1, 2, 3, 4]}]},
            1,
            {},
            False,
            None,
            limits=RequestLimits.of(Settings()),
            target_prompt_logprobs=targets,
        )
