"""The sampler on the real tiny model: KV-cached, left-padded, mixed-adapter generation.

Every expectation comes from outside the sampler: plain forward passes over prompt + tokens (no
cache, no padding, one adapter set on the model at a time), an argmax loop that reruns the whole
sequence each step, or the same request run alone.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import DynamicCache

from queue_tinker.builtin_models import load_tokenizer
from queue_tinker.types.requests.sampling import SampleResponse, SamplingParams
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.adapters import linear_names, peft_config
from queue_tinker.workers.model.base_model import cache_keyword, load_base_model
from queue_tinker.workers.model.families import family_of
from queue_tinker.workers.model.lora.row_blocks import blocks_of
from queue_tinker.workers.sampling import decode_loop as sampler
from queue_tinker.workers.sampling import prefix_cache, token_choice
from queue_tinker.workers.sampling.cache_budget import peak_cache_tokens
from queue_tinker.workers.sampling.decode_loop import GenerationRequest, generate
from queue_tinker.workers.sampling.decode_rows import BASE_ADAPTER
from queue_tinker.workers.sampling.kv_cache import GrowingLayer
from queue_tinker.workers.sampling.prefix_cache import SharedPrompt

BASE = "queue-tinker/tiny-llama"
VOCAB = 259
EOS = 257
CPU = torch.device("cpu")
PROMPTS = [list(b"hello"), list(b"the quick brown fox"), list(b"ab"), [256, *b"queue"]]
# name: (config, std of the random lora_B). a1/a2 nudge every layer; "sharp" makes the next-token
# distribution peaked (the random base is near uniform), so 2000 draws can pin it down.
ADAPTERS = {
    "a1": (LoraConfig(rank=8), 0.05),
    "a2": (LoraConfig(rank=2), 0.05),
    "sharp": (LoraConfig(rank=8, train_attn=False, train_mlp=False), 1.5),
}
# (rtol, atol)
LOGPROBS_VS_FORWARD = (1e-4, 1e-5)
BATCHED_VS_ALONE = (1e-5, 1e-6)

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class Setup:
    model: PeftModel
    plain: torch.nn.Module  # the base model alone, no PEFT wrapper
    decode: Decode


# --- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    yield from sampler_setup()


def sampler_setup() -> Iterator[Setup]:
    """The tiny model with ADAPTERS, its plain twin and its tokenizer (the test_slot_decode
    fixture's too). One intra-op thread meanwhile: on a tiny model, thread hand-offs cost more
    than the math."""
    path = Path(tempfile.mkdtemp(prefix="qt-sampler-"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = load_base_model(BASE, "cpu", path)
    base.name_or_path = BASE  # as the engine does: adapter configs name the public base
    plain = load_base_model(BASE, "cpu", path).eval()
    tokenizer = load_tokenizer(BASE, path)
    yield Setup(model=with_adapters(base), plain=plain, decode=tokenizer.decode)
    torch.set_num_threads(threads)
    shutil.rmtree(path, ignore_errors=True)


def with_adapters(base: torch.nn.Module) -> PeftModel:
    """A PeftModel holding ADAPTERS, each lora_B set to seeded random values (B starts at zero,
    which would make every adapter equal to the base)."""
    present = linear_names(base)
    model: PeftModel | None = None
    draws = torch.Generator().manual_seed(1234)
    for seed, (name, (config, std)) in enumerate(ADAPTERS.items()):
        cfg = peft_config(present, config, BASE, family_of(base.config))
        torch.manual_seed(seed)  # PEFT initialises lora_A from the global generator
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning
            )
            if model is None:
                model = get_peft_model(base, cfg, adapter_name=name)
            else:
                model.add_adapter(name, cfg)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if f".lora_B.{name}." in key:
                    param.copy_(torch.randn(param.shape, generator=draws) * std)
    assert model is not None
    return model.eval()


# --- helpers --------------------------------------------------------------------------------
def request(
    prompt: list[int],
    adapter: str | None = None,
    *,
    n: int = 1,
    max_tokens: int = 10,
    prompt_logprobs: bool = False,
    **params: Any,
) -> GenerationRequest:
    return GenerationRequest(
        prompt=list(prompt),
        num_samples=n,
        params=SamplingParams(**params),
        max_tokens=max_tokens,
        prompt_logprobs=prompt_logprobs,
        adapter=adapter,
    )


def run(
    setup: Setup,
    requests: list[GenerationRequest],
    model: torch.nn.Module | None = None,
    eos: tuple[int, ...] = (EOS,),
) -> list[SampleResponse]:
    return generate(
        setup.model if model is None else model,
        requests,
        device=CPU,
        eos_token_ids=list(eos),
        decode=setup.decode,
    )


@contextmanager
def using(model: torch.nn.Module, adapter: str | None) -> Iterator[None]:
    """Make `adapter` the one the plain forward uses (None: adapters off)."""
    if not isinstance(model, PeftModel):
        assert adapter is None
        yield
    elif adapter is None:
        with model.disable_adapter():
            yield
    else:
        model.set_adapter(adapter)
        yield


def forward_logits(model: torch.nn.Module, adapter: str | None, tokens: list[int]) -> torch.Tensor:
    """float32 logits (T, V) of one unpadded sequence, no cache."""
    with torch.inference_mode(), using(model, adapter):
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


def sequence_logprobs(
    model: torch.nn.Module, adapter: str | None, prompt: list[int], tokens: list[int]
) -> torch.Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) from one forward pass."""
    logits = forward_logits(model, adapter, prompt + tokens)
    rows = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return rows.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def greedy_reference(
    model: torch.nn.Module, adapter: str | None, prompt: list[int], steps: int
) -> list[int]:
    """Argmax decoding that reruns the whole sequence each step."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(forward_logits(model, adapter, seq)[-1].argmax()))
    return seq[len(prompt) :]


def last_new_token(tokens: list[int]) -> int:
    """The index of the last token that had not occurred before it: stopping on it ends there."""
    index = max(i for i, t in enumerate(tokens) if t not in tokens[:i])
    assert index >= 2, f"greedy path too repetitive for a stop test: {tokens}"
    return index


def assert_close(
    actual: list[float | None] | list[float], expected: torch.Tensor, tol: tuple[float, float]
) -> None:
    rtol, atol = tol
    torch.testing.assert_close(torch.tensor(actual), expected, rtol=rtol, atol=atol)


def decoder_of(model: PeftModel) -> torch.nn.Module:
    """The transformer under the LM head (LlamaModel), whose forward gets the decoder inputs."""
    return model.get_base_model().get_submodule("model")


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def assert_same(a: SampleResponse, b: SampleResponse) -> None:
    """Same tokens and stop reasons; logprobs (and prompt logprobs) equal to tolerance."""
    assert len(a.sequences) == len(b.sequences)
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert (x.tokens, x.stop_reason) == (y.tokens, y.stop_reason)
        assert_close(x.logprobs, torch.tensor(y.logprobs), BATCHED_VS_ALONE)
    assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
    if a.prompt_logprobs is not None and b.prompt_logprobs is not None:
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert_close(a.prompt_logprobs[1:], torch.tensor(b.prompt_logprobs[1:]), BATCHED_VS_ALONE)


# --- logprobs -------------------------------------------------------------------------------
def test_logprobs_equal_a_plain_forward_in_a_mixed_batch(setup: Setup) -> None:
    requests = [
        request(PROMPTS[0], None, n=2, max_tokens=8, seed=1, stop=[]),
        request(PROMPTS[1], "a1", n=2, max_tokens=6, seed=2, stop=[], temperature=0.8),
        request(PROMPTS[2], "a2", n=2, max_tokens=10, seed=3, stop=[], top_k=20),
    ]
    responses = run(setup, requests)
    for req, response in zip(requests, responses, strict=True):
        assert len(response.sequences) == req.num_samples
        for seq in response.sequences:
            assert len(seq.tokens) == len(seq.logprobs) == req.max_tokens
            expected = sequence_logprobs(setup.model, req.adapter, req.prompt, seq.tokens)
            assert_close(seq.logprobs, expected, LOGPROBS_VS_FORWARD)
            if req.adapter is not None:  # the adapter really is in play
                base = sequence_logprobs(setup.model, None, req.prompt, seq.tokens)
                assert float((base - expected).abs().max()) > 1e-3


def test_prompt_logprobs_equal_a_forward_pass(setup: Setup) -> None:
    requests = [
        request(PROMPTS[1], None, max_tokens=2, prompt_logprobs=True),
        request(PROMPTS[0], "a1", n=2, max_tokens=3, prompt_logprobs=True, seed=0),
        request(PROMPTS[3], "a2", max_tokens=1, prompt_logprobs=True, temperature=0),
        request([65], "a1", max_tokens=1, prompt_logprobs=True),
        request(PROMPTS[2], None, max_tokens=1),
    ]
    responses = run(setup, requests)
    for req, response in zip(requests[:3], responses[:3], strict=True):
        values = response.prompt_logprobs
        assert values is not None and len(values) == len(req.prompt) and values[0] is None
        logits = forward_logits(setup.model, req.adapter, req.prompt)
        expected = (
            torch.log_softmax(logits[:-1], dim=-1)
            .gather(1, torch.tensor(req.prompt[1:])[:, None])
            .squeeze(1)
        )
        torch.testing.assert_close(torch.tensor(values[1:]), expected, rtol=1e-5, atol=1e-6)
    assert responses[3].prompt_logprobs == [None]
    assert responses[4].prompt_logprobs is None


# --- greedy ---------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter", [None, "a1", "a2"])
def test_temperature_zero_and_top_k_one_are_argmax(setup: Setup, adapter: str | None) -> None:
    prompt = PROMPTS[1]
    expected = greedy_reference(setup.model, adapter, prompt, 20)
    responses = run(
        setup,
        [
            request(prompt, adapter, max_tokens=20, stop=[], temperature=0),
            request(prompt, adapter, n=2, max_tokens=20, stop=[], top_k=1),
        ],
    )
    for response in responses:
        for seq in response.sequences:
            assert seq.tokens == expected
            assert seq.stop_reason == "length"


# --- seeds ----------------------------------------------------------------------------------
def test_a_seed_makes_sampling_reproducible_whatever_the_batch(setup: Setup) -> None:
    def sampled(seed: int) -> GenerationRequest:
        return request(PROMPTS[0], "a1", n=3, max_tokens=12, seed=seed, stop=[], top_p=0.95)

    others = [
        request(PROMPTS[1], "a2", n=2, max_tokens=5, seed=4, stop=[]),
        request(PROMPTS[2], None, max_tokens=15, temperature=0, stop=[]),
    ]
    alone = run(setup, [sampled(7)])[0]
    after = run(setup, [*others, sampled(7)])[2]
    between = run(setup, [others[1], sampled(7), others[0]])[1]
    tokens = [s.tokens for s in alone.sequences]
    assert [s.tokens for s in after.sequences] == tokens
    assert [s.tokens for s in between.sequences] == tokens
    assert len({tuple(t) for t in tokens}) == 3  # the samples of one request differ
    other_seed = run(setup, [sampled(8)])[0]
    assert [s.tokens for s in other_seed.sequences] != tokens


# --- stopping -------------------------------------------------------------------------------
def test_stop_token_ends_the_sequence_and_is_included(setup: Setup) -> None:
    prompt, adapter = PROMPTS[1], "a2"
    ref = greedy_reference(setup.model, adapter, prompt, 20)
    j = last_new_token(ref)
    stop = [ref[j], 300]
    at_stop, at_both, before = run(
        setup,
        [
            request(prompt, adapter, max_tokens=20, temperature=0, stop=stop),
            request(prompt, adapter, max_tokens=j + 1, temperature=0, stop=stop),
            request(prompt, adapter, max_tokens=j, temperature=0, stop=stop),
        ],
    )
    for response in (at_stop, at_both):  # "stop" wins when the stop token is also the last
        (seq,) = response.sequences
        assert (seq.tokens, seq.stop_reason) == (ref[: j + 1], "stop")
        assert len(seq.logprobs) == j + 1
    (seq,) = before.sequences
    assert (seq.tokens, seq.stop_reason) == (ref[:j], "length")


def test_stop_none_stops_at_eos_and_an_empty_list_never_early(setup: Setup) -> None:
    prompt, adapter = PROMPTS[0], "a1"
    ref = greedy_reference(setup.model, adapter, prompt, 16)
    assert EOS not in ref
    j = last_new_token(ref)
    # The tiny model never picks EOS itself; naming the greedy path's token as EOS stands in.
    at_eos, never = run(
        setup,
        [
            request(prompt, adapter, max_tokens=16, temperature=0),
            request(prompt, adapter, max_tokens=16, temperature=0, stop=[]),
        ],
        eos=(ref[j],),
    )
    assert (at_eos.sequences[0].tokens, at_eos.sequences[0].stop_reason) == (ref[: j + 1], "stop")
    assert (never.sequences[0].tokens, never.sequences[0].stop_reason) == (ref, "length")
    # EOS 257 never comes
    (real_eos,) = run(setup, [request(prompt, adapter, max_tokens=16, temperature=0)])
    assert (real_eos.sequences[0].tokens, real_eos.sequences[0].stop_reason) == (ref, "length")


def test_stop_strings_end_the_sequence_and_are_included(setup: Setup) -> None:
    prompt, adapter = PROMPTS[2], None
    ref = greedy_reference(setup.model, adapter, prompt, 20)
    text = setup.decode(ref[:12])
    target = text[-2:]  # ends within 12 tokens; first found where the decoded text has it
    end = next(i for i in range(len(ref)) if target in setup.decode(ref[: i + 1]))
    assert end >= 1
    responses = run(
        setup,
        [
            request(prompt, adapter, max_tokens=20, temperature=0, stop=target),
            request(prompt, adapter, max_tokens=20, temperature=0, stop=["never there", target]),
        ],
    )
    for response in responses:
        (seq,) = response.sequences
        assert (seq.tokens, seq.stop_reason) == (ref[: end + 1], "stop")
        assert target in setup.decode(seq.tokens)
    # Stop strings add to EOS rather than replace it (stop token ids replace it).
    j = last_new_token(ref)
    at_eos, by_id = run(
        setup,
        [
            request(prompt, adapter, max_tokens=20, temperature=0, stop=["never there"]),
            request(prompt, adapter, max_tokens=20, temperature=0, stop=[ref[end]]),
        ],
        eos=(ref[j],),
    )
    assert (at_eos.sequences[0].tokens, at_eos.sequences[0].stop_reason) == (ref[: j + 1], "stop")
    assert by_id.sequences[0].tokens == ref[: ref.index(ref[end]) + 1]


def test_max_tokens_ends_with_length(setup: Setup) -> None:
    requests = [
        request(PROMPTS[0], "a1", n=3, max_tokens=7, seed=3, stop=[]),
        request(PROMPTS[3], None, n=2, max_tokens=3, temperature=0, stop=[]),
        request(PROMPTS[1], "a2", max_tokens=1, seed=4, stop=[]),
    ]
    for req, response in zip(requests, run(setup, requests), strict=True):
        for seq in response.sequences:
            assert len(seq.tokens) == len(seq.logprobs) == req.max_tokens
            assert seq.stop_reason == "length"


def test_rows_stop_at_different_steps(setup: Setup) -> None:
    """Many stop ids: samples end at different steps, each on its first stop token."""
    stop = list(range(0, 256, 8))
    (response,) = run(setup, [request(PROMPTS[0], "a2", n=12, max_tokens=12, seed=6, stop=stop)])
    lengths = set()
    for seq in response.sequences:
        lengths.add(len(seq.tokens))
        hits = [i for i, t in enumerate(seq.tokens) if t in stop]
        if seq.stop_reason == "stop":
            assert hits == [len(seq.tokens) - 1]
        else:
            assert not hits and len(seq.tokens) == 12
    assert len(lengths) > 2


# --- batching -------------------------------------------------------------------------------
def mixed_requests() -> list[GenerationRequest]:
    return [
        request(PROMPTS[0], None, n=2, max_tokens=8, temperature=0, stop=[]),
        request(PROMPTS[1], "a1", n=3, max_tokens=10, seed=3, temperature=0.9, stop=[]),
        request(PROMPTS[2], "a2", max_tokens=6, temperature=0, prompt_logprobs=True),
        request(PROMPTS[3], None, n=2, max_tokens=9, seed=5, top_k=50, top_p=0.9, stop=[]),
        request(
            PROMPTS[1],
            "a2",
            n=2,
            max_tokens=12,
            seed=9,
            temperature=1.3,
            stop=list(range(0, 256, 10)),
        ),
        request(PROMPTS[0], "a1", n=2, max_tokens=7, temperature=0, stop=[], prompt_logprobs=True),
    ]


def test_a_batch_equals_each_request_alone(setup: Setup) -> None:
    requests = mixed_requests()
    batched = run(setup, requests)
    backwards = run(setup, requests[::-1])[::-1]
    for req, together, reversed_order in zip(requests, batched, backwards, strict=True):
        alone = run(setup, [req])[0]
        assert_same(together, alone)
        assert_same(reversed_order, alone)
    greedy = batched[0].sequences
    assert (
        greedy[0].tokens == greedy[1].tokens == greedy_reference(setup.model, None, PROMPTS[0], 8)
    )


def test_sampling_in_row_chunks_changes_nothing(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Big batches are chosen a few rows a pass; results must not notice."""
    requests = mixed_requests()
    whole = run(setup, requests)
    monkeypatch.setattr(token_choice, "CHOICE_CHUNK_ELEMENTS", 3 * VOCAB)  # 3 rows per pass
    for chunked, expected in zip(run(setup, requests), whole, strict=True):
        assert_same(chunked, expected)


def test_a_plain_model_samples_as_the_base_rows_of_a_peft_model(setup: Setup) -> None:
    requests = [
        request(PROMPTS[0], n=2, max_tokens=8, seed=1, stop=[], prompt_logprobs=True),
        request(PROMPTS[1], max_tokens=5, temperature=0, stop=[]),
    ]
    on_plain = run(setup, requests, model=setup.plain)
    for plain, peft in zip(on_plain, run(setup, requests), strict=True):
        assert_same(plain, peft)
    for seq in on_plain[0].sequences:
        assert_close(
            seq.logprobs,
            sequence_logprobs(setup.plain, None, PROMPTS[0], seq.tokens),
            LOGPROBS_VS_FORWARD,
        )


def test_prompts_run_once_then_each_row_at_its_own_positions(setup: Setup) -> None:
    """What reaches the decoder: one prefill row per request (left-padded, positions counting
    from each prompt's first token), then one row per live sample at its next position."""
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def record(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append((kwargs["input_ids"], kwargs["attention_mask"], kwargs["position_ids"]))

    decoder = decoder_of(setup.model)
    handle = decoder.register_forward_pre_hook(record, with_kwargs=True)
    try:
        prompts = [PROMPTS[1], PROMPTS[2]]  # 19 and 2 tokens
        run(
            setup,
            [
                request(prompts[0], "a1", n=3, max_tokens=4, seed=0, stop=[]),
                request(prompts[1], None, n=2, max_tokens=4, temperature=0, stop=[]),
            ],
        )
    finally:
        handle.remove()
    assert len(calls) == 4  # the prefill, then 3 steps (the 4th token needs no forward)
    ids, mask, positions = calls[0]
    width = len(prompts[0])
    assert ids.shape == (2, width)
    for row, prompt in enumerate(prompts):
        pad = width - len(prompt)
        assert ids[row, pad:].tolist() == prompt
        assert mask[row].tolist() == [0] * pad + [1] * len(prompt)
        assert positions[row, pad:].tolist() == list(range(len(prompt)))
    for step, (ids, mask, positions) in enumerate(calls[1:]):
        assert ids.shape == (5, 1)
        assert mask.shape == (5, 1, 1, width + step + 1)  # a decode step's own 4-D mask
        assert bool(mask[..., width:].all())
        assert mask[3:, 0, 0, : width - len(prompts[1])].sum() == 0  # the padding stays out
        expected = [len(prompts[0]) + step] * 3 + [len(prompts[1]) + step] * 2
        assert positions[:, 0].tolist() == expected


def test_a_model_in_training_mode_samples_in_eval_mode_and_is_left_as_found(setup: Setup) -> None:
    """get_peft_model / add_adapter hand back training-mode modules, where PEFT refuses
    adapter_names; generate runs in eval mode and restores every module's own flag."""
    requests = [
        request(PROMPTS[0], "a1", max_tokens=5, temperature=0, stop=[]),
        request(PROMPTS[2], None, max_tokens=5, temperature=0, stop=[]),
    ]
    expected = run(setup, requests)
    setup.model.train()
    decoder_of(setup.model).get_submodule("norm").eval()  # a mixed state, to see it restored
    modes = {name: module.training for name, module in setup.model.named_modules()}
    try:
        for got, want in zip(run(setup, requests), expected, strict=True):
            assert_same(got, want)
        assert {name: m.training for name, m in setup.model.named_modules()} == modes
    finally:
        setup.model.eval()


def test_no_requests_no_responses(setup: Setup) -> None:
    assert run(setup, []) == []


# --- the distribution -----------------------------------------------------------------------
def rank_and_mass_before(scaled: torch.Tensor, token: int, top_k: int) -> tuple[int, float]:
    """The token's rank by probability, and the probability of the tokens above it within the
    top_k (renormalised over the top_k)."""
    order = torch.argsort(scaled, descending=True)
    rank = int((order == token).nonzero())
    kept = order if top_k == -1 else order[:top_k]
    probs = torch.softmax(scaled[kept].double(), dim=-1)
    return rank, float(probs[:rank].sum())


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (-1, 0.5), (12, 0.6)])
def test_top_k_and_top_p_restrict_the_support(setup: Setup, top_k: int, top_p: float) -> None:
    prompt, adapter, temperature = PROMPTS[1], "a1", 0.7
    (response,) = run(
        setup,
        [
            request(
                prompt,
                adapter,
                n=16,
                max_tokens=5,
                seed=5,
                stop=[],
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
            )
        ],
    )
    firsts = set()
    for seq in response.sequences:
        logits = forward_logits(setup.model, adapter, prompt + seq.tokens)
        scaled = logits[len(prompt) - 1 : -1] / temperature
        for step, token in enumerate(seq.tokens):
            rank, before = rank_and_mass_before(scaled[step], token, top_k)
            assert top_k == -1 or rank < top_k
            assert before < top_p + 1e-6  # in the smallest set holding top_p of the mass
        firsts.add(seq.tokens[0])
    assert len(firsts) > 1  # really sampled, not argmax


@pytest.mark.parametrize(("temperature", "other"), [(1.0, 0.5), (0.5, 1.0)])
def test_first_token_frequencies_follow_the_softmax(
    setup: Setup, temperature: float, other: float
) -> None:
    n, prompt = 2000, PROMPTS[0]
    (response,) = run(
        setup,
        [request(prompt, "sharp", n=n, max_tokens=1, seed=2024, stop=[], temperature=temperature)],
    )
    firsts = torch.tensor([seq.tokens[0] for seq in response.sequences])
    freqs = torch.bincount(firsts, minlength=VOCAB).double() / n
    logits = forward_logits(setup.model, "sharp", prompt)[-1].double()
    assert total_variation(freqs, torch.softmax(logits / temperature, dim=-1)) < 0.06
    # The check is sharp enough to tell the two temperatures apart.
    assert total_variation(freqs, torch.softmax(logits / other, dim=-1)) > 0.15


# --- the decode loop: joining, leaving, sharing ----------------------------------------------
JOINED_VS_ALONE = (1e-4, 1e-4)  # rtol, atol: another batch width changes float rounding


def new_loop(setup: Setup, **options: Any) -> sampler.DecodeLoop:
    return sampler.DecodeLoop(CPU, [EOS], setup.decode, **{"max_rows": None, **options})


def drain(loop: sampler.DecodeLoop, model: torch.nn.Module) -> dict[Any, SampleResponse]:
    done: dict[Any, SampleResponse] = {}
    while loop.busy:
        done.update(loop.step(model))
    return done


def assert_near(a: SampleResponse, b: SampleResponse) -> None:
    """Same tokens and stop reasons; logprobs within JOINED_VS_ALONE."""
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert (x.tokens, x.stop_reason) == (y.tokens, y.stop_reason)
        assert_close(x.logprobs, torch.tensor(y.logprobs), JOINED_VS_ALONE)


def test_a_request_joining_mid_loop_samples_what_it_samples_alone(setup: Setup) -> None:
    """Rows join a running loop at a step and leave when done; each request's tokens are
    what it gets alone with the same seed, its logprobs within 1e-4."""
    first = request(PROMPTS[1], "a1", n=3, max_tokens=20, seed=11, stop=[], temperature=0.9)
    later = [
        request(PROMPTS[0], "a2", n=2, max_tokens=12, seed=12, stop=[], top_p=0.9),
        request(PROMPTS[3], None, max_tokens=8, temperature=0, stop=[], prompt_logprobs=True),
        request(PROMPTS[2], "a1", n=2, max_tokens=70, seed=13, stop=[]),
    ]  # > a uniform block
    loop = new_loop(setup)
    loop.add("first", first)
    done: dict[Any, SampleResponse] = {}
    sizes = []
    for step in range(12):
        if step in (3, 5, 6):
            loop.add(step, later[(3, 5, 6).index(step)])
        done.update(loop.step(setup.model))
        sizes.append(loop.rows)
    done.update(drain(loop, setup.model))
    assert max(sizes) == 3 + 2 + 1 + 2  # all four shared steps
    assert_near(done["first"], run(setup, [first])[0])
    for key, req in zip((3, 5, 6), later, strict=True):
        alone = run(setup, [req])[0]
        assert_near(done[key], alone)
        if req.prompt_logprobs:
            assert done[key].prompt_logprobs is not None and alone.prompt_logprobs is not None
            assert_close(
                done[key].prompt_logprobs[1:],
                torch.tensor(alone.prompt_logprobs[1:]),
                JOINED_VS_ALONE,
            )


def test_identical_prompts_admitted_together_are_prefilled_once(setup: Setup) -> None:
    """num_samples rows and identical prompts (same adapter) share one prefill row; their
    samples equal those of each request prefilled alone."""
    calls: list[torch.Tensor] = []

    def record(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append(kwargs["input_ids"])

    same = [request(PROMPTS[1], "a1", n=4, max_tokens=6, seed=s, stop=[]) for s in (1, 2, 3)]
    other = request(PROMPTS[1], "a2", n=2, max_tokens=6, seed=4, stop=[])
    handle = decoder_of(setup.model).register_forward_pre_hook(record, with_kwargs=True)
    try:
        together = run(setup, [*same, other])
    finally:
        handle.remove()
    assert calls[0].shape == (2, len(PROMPTS[1]))  # one row per (prompt, adapter)
    assert all(ids.shape == (14, 1) for ids in calls[1:])  # then a row per sample
    for req, response in zip([*same, other], together, strict=True):
        assert_same(response, run(setup, [req])[0])


def test_requests_wait_for_rows_and_join_as_others_leave(setup: Setup) -> None:
    """With max_rows, a request waits (first come first served) until the rows it needs are
    free, and the prefill budget splits a burst over steps: results are unchanged."""
    requests = mixed_requests()
    expected = run(setup, requests)
    loop = new_loop(setup, max_rows=4, prefill_tokens=20)
    for index, req in enumerate(requests):
        loop.add(index, req)
    done: dict[Any, SampleResponse] = {}
    most = 0
    while loop.busy:
        done.update(loop.step(setup.model))
        most = max(most, loop.rows)
        assert loop.rows <= 4
    assert most == 4
    for index, response in enumerate(expected):
        assert_near(done[index], response)


def test_rows_that_leave_take_their_cache_columns_with_them(setup: Setup) -> None:
    """When the request with the longest prompt finishes, the padding it forced on the others
    is cut from the cache; the rows that stay compute as before."""
    long_prompt = list(b"a rather long prompt that pads the rest")
    short = request(PROMPTS[2], "a1", max_tokens=12, temperature=0, stop=[])
    loop = new_loop(setup)
    loop.add("long", request(long_prompt, None, max_tokens=2, temperature=0, stop=[]))
    loop.add("short", short)
    loop.step(setup.model)
    assert loop.running is not None and loop.running.mask.shape[1] == len(long_prompt)
    loop.step(setup.model)  # the long one is done
    assert loop.running is not None
    assert loop.running.mask.shape[1] == len(PROMPTS[2]) + 1
    assert loop.running.cache.get_seq_length() == len(PROMPTS[2]) + 1
    assert_near(drain(loop, setup.model)["short"], run(setup, [short])[0])


def test_cancelled_requests_leave_and_the_rest_go_on(setup: Setup) -> None:
    keep = request(PROMPTS[0], "a2", n=2, max_tokens=10, seed=5, stop=[])
    loop = new_loop(setup)
    loop.add("gone", request(PROMPTS[1], "a1", n=3, max_tokens=10, seed=6, stop=[]))
    loop.add("kept", keep)
    loop.add("waiting", request(PROMPTS[3], None, max_tokens=10, seed=7, stop=[]))
    loop.step(setup.model)
    assert loop.rows == 6
    loop.cancel({"gone", "waiting"})
    assert loop.rows == 2 and not loop.waiting
    assert list(drain(loop, setup.model)) == ["kept"]


def test_a_bfloat16_model_samples_with_float32_logprobs(setup: Setup) -> None:
    """The loop follows the model's dtype (bf16 on GPUs): softmax and logprobs in float32,
    greedy tokens those of a bf16 forward pass."""
    model = copy.deepcopy(setup.plain).to(torch.bfloat16)
    (response,) = run(
        setup, [request(PROMPTS[1], None, max_tokens=6, temperature=0, stop=[])], model=model
    )
    (seq,) = response.sequences
    assert seq.tokens == greedy_reference(model, None, PROMPTS[1], 6)
    expected = sequence_logprobs(model, None, PROMPTS[1], seq.tokens)
    assert_close(seq.logprobs, expected, (0.05, 0.05))  # bf16 rounding, cached or not
    assert all(isinstance(v, float) for v in seq.logprobs)


def test_a_request_bigger_than_the_loop_joins_in_parts_with_the_same_samples(setup: Setup) -> None:
    """num_samples beyond max_rows: its samples join as rows free up, never more than
    max_rows at once; each sample is what it is with the whole request in one batch (each
    sample draws from its own seeded stream)."""
    big = request(PROMPTS[1], "a1", n=7, max_tokens=9, seed=21, stop=[], prompt_logprobs=True)
    other = request(PROMPTS[0], None, n=2, max_tokens=5, seed=22, stop=[])
    expected = run(setup, [big, other])
    loop = new_loop(setup, max_rows=3)
    loop.add("big", big)
    loop.add("other", other)
    done: dict[Any, SampleResponse] = {}
    steps = 0
    while loop.busy:
        done.update(loop.step(setup.model))
        assert loop.rows <= 3
        steps += 1
    assert steps >= 3 * 8  # in parts: three rounds of 9 tokens, each joining as one ends
    assert_near(done["big"], expected[0])
    assert done["big"].prompt_logprobs is not None and expected[0].prompt_logprobs is not None
    assert_close(
        done["big"].prompt_logprobs[1:],
        torch.tensor(expected[0].prompt_logprobs[1:]),
        JOINED_VS_ALONE,
    )
    assert_near(done["other"], expected[1])


def cache_tokens(loop: sampler.DecodeLoop) -> int:
    """Rows x columns of the loop's KV cache now (its first layer's keys)."""
    if loop.running is None:
        return 0
    keys = loop.running.cache.layers[0].keys
    assert keys is not None
    return int(keys.shape[0] * keys.shape[2])


def test_the_cache_stays_within_its_budget_and_samples_are_unchanged(setup: Setup) -> None:
    """With max_cache_tokens, requests join only while the cache their rows may grow to fits:
    measured after every step, the cache never holds more than the budget (without one the
    same requests reach well past it), and every sample is what it is in one batch."""
    requests = [
        request(PROMPTS[1], "a1", n=3, max_tokens=40, seed=31, stop=[]),
        request(PROMPTS[0], "a2", n=4, max_tokens=12, seed=32, stop=[], temperature=0.8),
        request(
            list(b"a rather long prompt that pads the rest"), None, n=2, max_tokens=24, seed=33
        ),
        request(PROMPTS[2], "a1", n=5, max_tokens=60, seed=34, stop=[], top_p=0.9),
    ]
    expected = run(setup, requests)
    budget = 200  # each sample alone needs at most 63 (39 prompt + 24 new tokens)
    peaks = {}
    for cap in (None, budget):
        loop = new_loop(setup, max_cache_tokens=cap)
        for index, req in enumerate(requests):
            loop.add(index, req)
        done: dict[Any, SampleResponse] = {}
        sizes = []
        while loop.busy:
            done.update(loop.step(setup.model))
            sizes.append(cache_tokens(loop))
        peaks[cap] = max(sizes)
        for index, response in enumerate(expected):
            assert_near(done[index], response)
    assert peaks[None] > 2 * budget
    assert budget / 2 < peaks[budget] <= budget


def test_a_sample_longer_than_the_budget_runs_alone(setup: Setup) -> None:
    """A sample that alone needs more cache than the budget still runs, alone, when the loop
    is empty; the requests behind it wait their turn."""
    big = request(PROMPTS[1], "a1", n=2, max_tokens=30, seed=41, stop=[])  # 19 + 30 a sample
    other = request(PROMPTS[0], None, max_tokens=5, seed=42, stop=[])
    expected = run(setup, [big, other])
    loop = new_loop(setup, max_cache_tokens=40)
    loop.add("big", big)
    loop.add("other", other)
    done: dict[Any, SampleResponse] = {}
    while loop.busy:
        done.update(loop.step(setup.model))
        assert loop.rows <= 1
    assert_near(done["big"], expected[0])
    assert_near(done["other"], expected[1])


# --- prompts in flight, shared across steps -----------------------------------------------------
def in_flight(loop: sampler.DecodeLoop) -> set[tuple[tuple[int, ...], str]]:
    running = loop.running.requests if loop.running is not None else []
    return {(tuple(r.spec.prompt), r.adapter) for r in [*loop.waiting, *running]}


def test_a_request_joining_an_identical_running_prompt_is_not_prefilled_again(
    setup: Setup,
) -> None:
    """Requests whose (prompt, adapter) is already in the loop join from its kept prefill: no
    prompt token of theirs runs through the model, they merge with the rows prefilled in the
    same step, and each samples what it samples alone with the same seed."""
    first = request(PROMPTS[1], "a1", max_tokens=12, seed=31, stop=[])
    short = request(PROMPTS[2], None, max_tokens=12, seed=32, stop=[])
    later = request(PROMPTS[1], "a1", n=2, max_tokens=8, seed=33, stop=[], top_p=0.9)
    again = request(PROMPTS[2], None, max_tokens=8, temperature=0, stop=[])
    other = request(PROMPTS[0], "a1", max_tokens=6, seed=34, stop=[])  # prefilled meanwhile
    loop = new_loop(setup)
    loop.add("first", first)
    loop.add("short", short)
    for _ in range(3):
        assert not loop.step(setup.model)
    assert loop.prefilled_tokens == len(PROMPTS[1]) + len(PROMPTS[2])
    for key, req in (("later", later), ("again", again), ("other", other)):
        loop.add(key, req)
    assert not loop.step(setup.model)
    assert loop.rows == 2 + 2 + 1 + 1
    assert loop.prefilled_tokens == len(PROMPTS[1]) + len(PROMPTS[2]) + len(PROMPTS[0])
    done = drain(loop, setup.model)
    requests = {"first": first, "short": short, "later": later, "again": again, "other": other}
    for key, req in requests.items():
        assert_near(done[key], run(setup, [req])[0])
    assert done["later"].prompt_cache_hit_tokens == len(PROMPTS[1])
    assert done["first"].prompt_cache_hit_tokens == 0
    assert len(loop.prompts.entries) == 3 and not loop.prompts.users


def test_kept_prompts_go_least_recently_used_first_never_one_in_use(setup: Setup) -> None:
    """Kept prompts outlive their requests, within the cache's bytes: past them the least
    recently used entry no request in the loop counts on goes first; one a waiting request
    counts on stays, so it joins from it without prefilling. clear() forgets them all."""
    loop = new_loop(setup)
    loop.add("fox", request(PROMPTS[1], "a2", max_tokens=2, seed=1, stop=[]))
    drain(loop, setup.model)
    [fox] = loop.prompts.entries.values()
    per_token = fox.nbytes // len(PROMPTS[1])  # about: the logits are a few bytes more
    loop.prompts.max_bytes = fox.nbytes + 12 * per_token  # fox and one 8-token prompt
    for i in range(6):  # a stream of distinct prompts: what is kept stays within its bytes
        loop.add(("own", i), request([*PROMPTS[0], 40 + i], "a2", max_tokens=2, seed=i, stop=[]))
        loop.add(("fox", i), request(PROMPTS[1], "a2", max_tokens=2, seed=i, stop=[]))
        drain(loop, setup.model)
        assert loop.prompts.nbytes <= loop.prompts.max_bytes
        assert len(loop.prompts.entries) == 2  # fox, used every round, and the newest
    assert loop.prefilled_tokens == len(PROMPTS[1]) + 6 * (len(PROMPTS[0]) + 1)
    assert (tuple(PROMPTS[1]), "a2") in loop.prompts.entries  # used every round: never out

    loop.add("x", request(PROMPTS[3], None, max_tokens=10, seed=1, stop=[]))
    loop.step(setup.model)
    loop.add("y", request(PROMPTS[3], None, max_tokens=10, seed=2, stop=[]))
    loop.cancel({"x"})
    queued = loop.prompts.entries[(tuple(PROMPTS[3]), BASE_ADAPTER)]
    small = SharedPrompt(
        [(k[..., :2, :], v[..., :2, :]) for k, v in fox.layers],  # type: ignore[misc]
        fox.logits,
        2,
    )
    loop.prompts.max_bytes = queued.nbytes + small.nbytes  # room for what y counts on + small
    assert loop.prompts.add((tuple(PROMPTS[2]), "a2"), small)
    assert [key[0] for key in loop.prompts.entries] == [tuple(PROMPTS[3]), tuple(PROMPTS[2])]
    before = loop.prefilled_tokens
    loop.step(setup.model)
    assert loop.rows == 1 and loop.prefilled_tokens == before
    loop.cancel({"y"})
    assert not loop.busy and not loop.prompts.users
    loop.add("z", request(PROMPTS[3], None, max_tokens=10, seed=3, stop=[]))
    loop.step(setup.model)
    assert loop.clear() == ["z"]
    assert not loop.prompts.entries and not loop.prompts.users and loop.prompts.nbytes == 0


def test_kept_prompts_share_the_kv_budget_with_the_rows(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a KV budget the kept prompts hold what the budget leaves beside the rows' peak:
    with no rows running they keep more than the fixed floor (here one prompt's worth), a
    prompt seen before joins from its kept states, and as rows join the least recently used
    prompts give way so rows and kept prompts stay within the budget."""
    monkeypatch.setattr(prefix_cache, "KEPT_BYTES", 1)
    budget = 600
    loop = new_loop(setup, max_cache_tokens=budget)
    prompts = [[*PROMPTS[1], 60 + i] for i in range(8)]  # 20 tokens each, distinct
    for i, prompt in enumerate(prompts):  # one at a time: nothing else holds the budget
        loop.add(i, request(prompt, "a1", max_tokens=2, seed=i, stop=[]))
        drain(loop, setup.model)
    assert len(loop.prompts.entries) == len(prompts)  # all kept: no rows to make room for
    per_token = loop.prompts.bytes_per_token()
    assert per_token is not None
    hit = request(prompts[0], "a1", max_tokens=2, seed=9, stop=[])
    loop.add("again", hit)
    assert drain(loop, setup.model)["again"].prompt_cache_hit_tokens == len(prompts[0])
    for i in range(6):  # 6 rows of up to 80 tokens each: room for few prompts beside them
        loop.add(("long", i), request([40 + i, *PROMPTS[0]], None, max_tokens=74, seed=i, stop=[]))
    first = {(tuple(prompt), "a1") for prompt in prompts}
    fewest = len(first)
    while loop.busy:
        loop.step(setup.model)
        peak = peak_cache_tokens(loop._cache_rows())
        assert loop.prompts.nbytes <= max(1, (budget - peak) * per_token)
        fewest = min(fewest, len(first & set(loop.prompts.entries)))
    assert fewest < len(first)  # the rows' peak took the room of some


# 48 tokens: three whole blocks of the prefix cache, then each prompt's own question.
CONTEXT = list((b"shared context, " * 3)[:48])


def test_a_prompt_that_begins_with_a_kept_one_prefills_only_the_rest(setup: Setup) -> None:
    """A prompt whose first whole blocks are a kept prompt's (same adapter) joins from their
    states and prefills only its other tokens; another adapter's states are never used. Each
    request samples what it samples alone, its response counts the prompt tokens the cache
    gave it, and the longer prompt is kept whole for the next request."""
    loop = new_loop(setup)
    first = request([*CONTEXT, *b"why?"], "a1", max_tokens=8, seed=5, stop=[])
    loop.add("first", first)
    assert drain(loop, setup.model)["first"].prompt_cache_hit_tokens == 0
    question = [*CONTEXT, *b"and how so?"]
    requests = {
        "follow": request(question, "a1", n=2, max_tokens=8, seed=6, stop=[], temperature=0.8),
        "other adapter": request(question, "a2", max_tokens=8, seed=7, stop=[]),
        "one block": request(CONTEXT[:20], "a1", max_tokens=8, seed=8, stop=[], top_p=0.9),
    }
    before = loop.prefilled_tokens
    for key, req in requests.items():
        loop.add(key, req)
    done = drain(loop, setup.model)
    assert loop.prefilled_tokens - before == (len(question) - 48) + len(question) + (20 - 16)
    hits = {key: response.prompt_cache_hit_tokens for key, response in done.items()}
    assert hits == {"follow": 48, "other adapter": 0, "one block": 16}
    for key, req in requests.items():
        assert_near(done[key], run(setup, [req])[0])

    again = request(question, "a1", max_tokens=6, seed=9, stop=[])
    before = loop.prefilled_tokens
    loop.add("again", again)
    response = drain(loop, setup.model)["again"]
    assert loop.prefilled_tokens == before and response.prompt_cache_hit_tokens == len(question)
    assert_near(response, run(setup, [again])[0])


def test_a_long_prompt_is_prefilled_in_chunks_while_rows_decode(setup: Setup) -> None:
    """While rows decode, a prompt with more than a step's prefill budget left goes in chunks
    of whole blocks, one a step, and the running row takes a token every step meanwhile; the
    long request then samples what it samples alone. Alone in the loop it goes at once."""
    document = list((b"a long document to read before answering. " * 3)[:120])
    running = request(PROMPTS[1], "a1", max_tokens=30, seed=1, stop=[])
    long = request(document, "a2", n=2, max_tokens=5, seed=2, stop=[], temperature=0.7)
    loop = new_loop(setup, prefill_tokens=40)  # chunks of 32: two whole blocks
    loop.add("running", running)
    loop.step(setup.model)
    loop.add("long", long)
    prefilled, rows = [], []
    for _ in range(4):
        before = loop.prefilled_tokens
        loop.step(setup.model)
        prefilled.append(loop.prefilled_tokens - before)
        rows.append(loop.rows)
    assert prefilled == [32, 32, 32, 24] and rows == [1, 1, 1, 3]
    in_loop = {prompt_key_of(PROMPTS[1], "a1"), prompt_key_of(document, "a2")}
    assert set(loop.prompts.users) == in_loop  # the chunks' pins went when it joined
    done = drain(loop, setup.model)
    assert done["long"].prompt_cache_hit_tokens == 0  # every token was its own prefill
    for key, req in (("running", running), ("long", long)):
        assert_near(done[key], run(setup, [req])[0])

    loop.add("running again", running)
    loop.step(setup.model)
    loop.add("cancelled", request([*document, 7], "a1", max_tokens=3, stop=[]))
    loop.step(setup.model)  # its first chunk, pinned
    assert prompt_key_of(document[:32], "a1") in loop.prompts.users
    loop.cancel({"cancelled"})
    assert prompt_key_of(document[:32], "a1") not in loop.prompts.users

    alone = new_loop(setup, prefill_tokens=40)
    alone.add("long", long)
    alone.step(setup.model)
    assert alone.prefilled_tokens == len(document) and alone.rows == 2


def prompt_key_of(prompt: list[int], adapter: str) -> tuple[tuple[int, ...], str]:
    return tuple(prompt), adapter


def test_prefix_lookups_need_whole_matching_blocks(setup: Setup) -> None:
    """A prefix hit is the longest run of whole blocks both prompts share, or a whole kept
    prompt the new one begins with, leaving at least one token to prefill; a prompt that
    differs inside the first block misses."""
    loop = new_loop(setup)
    loop.add("kept", request([*CONTEXT, 1, 2], "a1", max_tokens=1, stop=[]))
    drain(loop, setup.model)

    def hit(prompt: list[int], adapter: str = "a1") -> int:
        live = sampler.LiveRequest.make("probe", request(prompt, adapter), [EOS])
        found = loop.prompts.longest_prefix(live)
        return 0 if found is None else found.tokens

    assert hit(CONTEXT) == 32  # 48 tokens: the last one is left to prefill
    assert hit([*CONTEXT, 7]) == 48
    assert hit([*CONTEXT, 1, 2, 3]) == 50  # the kept prompt's own end, past its last block
    assert hit([*CONTEXT, 1, 3, 3]) == 48
    assert hit([*CONTEXT[:40], 9, 9]) == 32
    assert hit([9, *CONTEXT[1:]]) == 0
    assert hit([*CONTEXT, 7], "a2") == 0
    assert hit(CONTEXT[:16]) == 0


def test_a_prompt_over_the_kept_bytes_is_prefilled_again_with_the_same_samples(
    setup: Setup,
) -> None:
    """Kept prompts are a second copy of their KV states: past the loop's byte budget a
    prompt is not kept, and an identical request arriving later prefills it again and samples
    what it samples alone."""
    first = request(PROMPTS[1], "a1", max_tokens=10, seed=41, stop=[])
    later = request(PROMPTS[1], "a1", max_tokens=6, seed=42, stop=[])
    loop = new_loop(setup)
    loop.prompts.max_bytes = 1  # nothing fits
    loop.add("first", first)
    assert not loop.step(setup.model)
    assert not loop.prompts.entries and loop.prompts.nbytes == 0
    loop.add("later", later)
    done = drain(loop, setup.model)
    assert loop.prefilled_tokens == 2 * len(PROMPTS[1])
    for key, req in (("first", first), ("later", later)):
        assert_near(done[key], run(setup, [req])[0])

    kept = new_loop(setup)  # the default budget keeps it, and counts what it holds
    kept.add("first", first)
    kept.step(setup.model)
    [entry] = kept.prompts.entries.values()
    assert kept.prompts.nbytes == entry.nbytes > 0
    drain(kept, setup.model)
    assert kept.prompts.nbytes == entry.nbytes  # kept after its request, for the next one


def test_a_request_for_prompt_scores_prefills_its_prompt_even_in_flight(setup: Setup) -> None:
    """Prompt logprobs need the logits at every prompt position: such a request prefills its
    prompt though an identical one runs, and gets the scores it gets alone."""
    first = request(PROMPTS[1], "a1", max_tokens=10, seed=41, stop=[])
    scored = request(PROMPTS[1], "a1", max_tokens=5, seed=42, stop=[], prompt_logprobs=True)
    loop = new_loop(setup)
    loop.add("first", first)
    loop.step(setup.model)
    loop.add("scored", scored)
    loop.step(setup.model)
    assert loop.prefilled_tokens == 2 * len(PROMPTS[1])
    done = drain(loop, setup.model)
    alone = run(setup, [scored])[0]
    assert_near(done["scored"], alone)
    assert done["scored"].prompt_logprobs is not None and alone.prompt_logprobs is not None
    assert_close(
        done["scored"].prompt_logprobs[1:], torch.tensor(alone.prompt_logprobs[1:]), JOINED_VS_ALONE
    )
    assert_near(done["first"], run(setup, [first])[0])


def test_the_same_prompt_on_another_adapter_is_not_shared(setup: Setup) -> None:
    """A prompt's states depend on its adapter: the same tokens on other adapters (or the base
    model) are prefilled for each, and each samples what it samples alone."""
    requests = {
        "a1": request(PROMPTS[0], "a1", max_tokens=10, seed=51, stop=[]),
        "a2": request(PROMPTS[0], "a2", max_tokens=8, seed=52, stop=[]),
        "base": request(PROMPTS[0], None, max_tokens=8, seed=53, stop=[]),
    }
    loop = new_loop(setup)
    loop.add("a1", requests["a1"])
    loop.step(setup.model)
    loop.add("a2", requests["a2"])
    loop.add("base", requests["base"])
    loop.step(setup.model)
    assert loop.prefilled_tokens == 3 * len(PROMPTS[0])
    assert len(loop.prompts.entries) == 3
    done = drain(loop, setup.model)
    for key, req in requests.items():
        assert_near(done[key], run(setup, [req])[0])


def test_rows_in_flight_are_kept_in_one_block_per_adapter(setup: Setup) -> None:
    """Requests on interleaved adapters, admitted together and later, run as one block of rows
    per adapter (one LoRA update per adapter and layer, not one per run of rows), and each
    samples what it samples alone."""
    adapters = ["a1", None, "a2", "a1", None, "a2"]
    requests = [
        request(PROMPTS[i % len(PROMPTS)], adapter, n=2, max_tokens=9, seed=20 + i, stop=[])
        for i, adapter in enumerate(adapters)
    ]
    loop = new_loop(setup)
    for key in range(3):
        loop.add(key, requests[key])
    done = dict(loop.step(setup.model))
    for key in range(3, 6):  # join the running loop
        loop.add(key, requests[key])
    done.update(loop.step(setup.model))
    assert loop.running is not None
    names = loop.running.adapters
    assert len(names) == 12
    assert blocks_of((name, 1) for name in names) == [("a1", 4), ("__base__", 4), ("a2", 4)], names
    done.update(drain(loop, setup.model))
    for key, req in enumerate(requests):
        assert_near(done[key], run(setup, [req])[0])


def test_decode_steps_write_the_cache_in_place(setup: Setup) -> None:
    """Once rows are built, a decode step writes its column into the layers' buffers (no copy
    of the cache per step) and no buffer holds more than the rows' max_tokens can fill."""
    loop = new_loop(setup)
    loop.add("short", request(PROMPTS[0], "a1", max_tokens=5, seed=1, stop=[]))
    loop.add("long", request(PROMPTS[1], "a2", n=2, max_tokens=9, seed=2, stop=[]))
    loop.step(setup.model)
    assert loop.running is not None
    layers = loop.running.cache.layers
    assert all(isinstance(layer, GrowingLayer) for layer in layers)
    places = [layer.keys.untyped_storage().data_ptr() for layer in layers]
    width = loop.running.mask.shape[1]
    for _ in range(3):
        loop.step(setup.model)
    assert [layer.keys.untyped_storage().data_ptr() for layer in layers] == places
    assert all(layer.capacity <= width + 9 for layer in layers)


def test_prompts_prefilled_in_length_groups_sample_what_one_batch_samples(setup: Setup) -> None:
    """With a free model call (call_tokens=0) each prompt length is prefilled alone; the rows
    join one batch and every request samples (and scores its prompt) as in one prefill."""
    calls: list[torch.Tensor] = []

    def record(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append(kwargs["input_ids"])

    requests = mixed_requests()
    expected = run(setup, requests)
    loop = new_loop(setup, call_tokens=0)
    for index, req in enumerate(requests):
        loop.add(index, req)
    handle = decoder_of(setup.model).register_forward_pre_hook(record, with_kwargs=True)
    try:
        loop.step(setup.model)
    finally:
        handle.remove()
    lengths = sorted({len(p) for p in PROMPTS})
    assert [ids.shape[1] for ids in calls] == lengths  # one call per length, none padded
    # Every row joined one batch; those whose first token ends them left it at once.
    first_only = sum(len(s.tokens) == 1 for response in expected for s in response.sequences)
    assert loop.rows == sum(req.num_samples for req in requests) - first_only
    done = drain(loop, setup.model)
    for index, response in enumerate(expected):
        assert_near(done[index], response)
        if requests[index].prompt_logprobs:
            got, want = done[index].prompt_logprobs, response.prompt_logprobs
            assert got is not None and want is not None and got[0] is None
            assert_close(got[1:], torch.tensor(want[1:]), JOINED_VS_ALONE)


def switched_greedy(
    model: PeftModel, prompt: list[int], adapters: tuple[str, str], switch_at: int, steps: int
) -> tuple[list[int], list[float]]:
    """The reference for a request moved to other weights mid-way: argmax decoding with one
    KV cache, on adapters[0] for the first `switch_at` tokens and adapters[1] after, the
    cache computed so far kept."""
    cache = DynamicCache()
    by = cache_keyword(model)  # `cache` from transformers 5.24, `past_key_values` before
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        model.set_adapter(adapters[0])
        logits = model(input_ids=torch.tensor([prompt]), **{by: cache}).logits[0, -1]
        for step in range(steps):
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits.float(), -1)[token]))
            if step + 1 == switch_at:
                model.set_adapter(adapters[1])
            ids = torch.tensor([[token]])
            logits = model(input_ids=ids, **{by: cache}).logits[0, -1]
    return tokens, logprobs


def test_a_retargeted_request_goes_on_with_its_cache_on_the_new_weights(setup: Setup) -> None:
    """Inflight weights moving on: a running request moved from a1 to a2 after 4 tokens
    chooses the rest on a2 from the cache it built on a1 (no prefill again), as one KV-cached
    decode that switches adapters there; its neighbour is untouched; rows stay in one block
    per adapter."""
    moving = request(PROMPTS[1], "a1", max_tokens=12, temperature=0, stop=[])
    staying = request(PROMPTS[0], "a1", n=2, max_tokens=12, seed=5, stop=[])
    other = request(PROMPTS[2], "a2", max_tokens=12, seed=6, stop=[])
    loop = new_loop(setup)
    for key, req in (("moving", moving), ("staying", staying), ("other", other)):
        loop.add(key, req)
    done: dict[Any, SampleResponse] = {}
    for _ in range(4):
        done.update(loop.step(setup.model))
    prefilled = loop.prefilled_tokens
    loop.retarget({"moving": "a2"})
    assert loop.running is not None
    blocks = blocks_of((name, 1) for name in loop.running.adapters)
    assert sorted(blocks) == [("a1", 2), ("a2", 2)]  # one block each
    step = loop.step(setup.model)
    assert loop.finished_prefilled == {}
    done.update(step)
    while loop.busy:
        step = loop.step(setup.model)
        done.update(step)
        if "moving" in dict(step):
            assert loop.finished_prefilled["moving"] == len(PROMPTS[1])
    assert loop.prefilled_tokens == prefilled  # nothing was prefilled again
    tokens, logprobs = switched_greedy(setup.model, PROMPTS[1], ("a1", "a2"), 4, 12)
    assert done["moving"].sequences[0].tokens == tokens
    assert_close(done["moving"].sequences[0].logprobs, torch.tensor(logprobs), JOINED_VS_ALONE)
    on_a1 = greedy_reference(setup.model, "a1", PROMPTS[1], 12)
    assert tokens[:4] == on_a1[:4] and tokens != on_a1  # the switch changed what came next
    assert_near(done["staying"], run(setup, [staying])[0])
    assert_near(done["other"], run(setup, [other])[0])


def test_modules_added_with_an_adapter_sample_in_eval_mode(setup: Setup) -> None:
    """The modules the loop puts in eval mode are found once per set of adapters: an adapter
    added later (its dropout in training mode, as add_adapter hands it back) is found too, so a
    sample on it is the same whatever its dropout, and its modules are left in training mode."""
    model = copy.deepcopy(setup.model)
    run(setup, [request(PROMPTS[0], "a1", max_tokens=3, temperature=0)], model=model)
    present = linear_names(setup.plain)  # the same architecture, unwrapped
    config = peft_config(present, LoraConfig(rank=4), BASE, family_of(setup.plain.config))
    config.lora_dropout = 0.5  # checkpoints trained elsewhere may carry one
    model.add_adapter("late", config)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if ".lora_B.late." in key:
                param.normal_(std=0.1)
    dropouts = [m for n, m in model.named_modules() if n.endswith("lora_dropout.late")]
    assert dropouts and all(m.training for m in dropouts)
    late = request(PROMPTS[1], "late", n=2, max_tokens=8, temperature=0, stop=[])
    first, second = run(setup, [late], model=model), run(setup, [late], model=model)
    assert_same(first[0], second[0])  # dropout of 0.5 in training mode would differ
    reference = greedy_reference(model.eval(), "late", PROMPTS[1], 8)
    assert first[0].sequences[0].tokens == reference


def test_a_row_s_fixed_state_is_charged_beside_its_columns(setup: Setup) -> None:
    """Under a KV budget, each row is charged `row_cache_tokens` beside its columns (a sliding
    window's, a linear-attention layer's states): a budget that admits two 8 + 4-token rows
    at once admits one at a time when each row holds 6 tokens' worth more."""
    requests = [request(PROMPTS[0][:8], None, max_tokens=4, seed=s, stop=[]) for s in (1, 2)]
    widest = {}
    for extra in (0, 6):
        loop = new_loop(setup, max_cache_tokens=2 * (8 + 4), row_cache_tokens=extra)
        for index, req in enumerate(requests):
            loop.add(index, req)
        widest[extra] = 0
        while loop.busy:
            loop.step(setup.model)
            widest[extra] = max(widest[extra], loop.step_rows)
    assert widest == {0: 2, 6: 1}


def test_rows_leaving_and_joining_carry_every_per_row_field(setup: Setup) -> None:
    """Every per-row tensor of Rows is kept for the rows that stay, in their order, and
    joined for the rows that join (a field added to Rows but not to select / merge fails)."""
    import dataclasses

    from queue_tinker.workers.sampling.decode_rows import Rows

    loop = sampler.DecodeLoop(CPU, [EOS], setup.decode, max_rows=None)
    for key in range(3):
        loop.add(key, request(PROMPTS[key], None, max_tokens=8, seed=key, stop=[]))
    loop.step(setup.model)
    rows = loop.running
    assert isinstance(rows, Rows) and rows.size == 3
    per_row = [
        f.name
        for f in dataclasses.fields(Rows)
        if isinstance(getattr(rows, f.name), torch.Tensor) and f.name != "mask"
    ]
    assert len(per_row) == 9
    before = {name: getattr(rows, name).clone() for name in per_row}
    rows.select([2, 0])
    for name in per_row:
        torch.testing.assert_close(getattr(rows, name), before[name][[2, 0]], msg=name)
    other = copy.deepcopy(rows)
    rows.merge(other)
    for name in per_row:
        assert getattr(rows, name).shape[0] == 4, name
