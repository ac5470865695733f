"""The family's fused decode step on the slots (families/llama.py, fused_decode.py): it is the
slot step of a Llama model, samples what the left-padded loop samples with its kernels'
torch references and with the Triton kernels under the interpreter, reads the model's own
weights (views, never copies), and leaves a model it does not fit to transformers' layers."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_sampler import CPU, EOS, PROMPTS, Setup, mixed_requests, request, sampler_setup
from test_slot_decode import assert_equal_samples, run_loop

from queue_tinker.workers.model.families.fused_decode import fused_rows
from queue_tinker.workers.model.families.llama import LlamaDecoder
from queue_tinker.workers.sampling import decode_loop as sampler


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    yield from sampler_setup()


def test_a_llama_model_s_slot_step_is_the_fused_one(setup: Setup) -> None:
    """On slots the tiny Llama's steps run the fused step: transformers' attention never runs
    a decode step (only the prefill's)."""
    from transformers import AttentionInterface

    from queue_tinker.workers.sampling import decode_attention

    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return decode_attention.grouped_decode_attention(*args, **kwargs)

    AttentionInterface.register(decode_attention.NAME, counting)
    try:
        _, loop, kinds = run_loop(setup, True, {0: list(enumerate(mixed_requests()))})
    finally:
        AttentionInterface.register(
            decode_attention.NAME, decode_attention.grouped_decode_attention
        )
    assert kinds == {"SlotRows"} and calls == []
    assert loop.slots is not None and isinstance(loop.slots._decoder(setup.model), LlamaDecoder)


@pytest.mark.parametrize("layers", ["fused", "transformers"])
def test_rows_all_on_the_base_model_of_a_peft_model(setup: Setup, layers: str) -> None:
    """A step whose rows all sample the base model (no LoRA kernel: a graph of its own) gives
    the padded loop's samples, though the model holds adapters."""
    arrivals = {0: [(i, request(PROMPTS[i], None, max_tokens=6, seed=i)) for i in range(3)]}
    want, _, _ = run_loop(setup, False, arrivals)
    got, loop, _ = run_loop(setup, True, arrivals, layers=layers)
    assert_equal_samples(got, want)
    assert loop.slots is not None and loop.slots.adapters is not None
    assert not loop.slots.lora_on


def test_the_triton_kernels_sample_what_the_padded_loop_samples(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused step's Triton kernels run by Triton's interpreter on CPU tensors: mixed
    adapters, the base model, settings and lengths give the padded loop's tokens and logprobs
    to float32 rounding."""
    requests = [  # short: the interpreter runs each program in Python
        request(PROMPTS[0], None, n=2, max_tokens=5, seed=1, stop=[]),
        request(PROMPTS[1], "a1", max_tokens=4, seed=3, temperature=0.9, stop=[]),
        request(PROMPTS[2], "a2", max_tokens=4, temperature=0),
        request(PROMPTS[3], "sharp", max_tokens=3, seed=5, top_k=50, top_p=0.9, stop=[]),
    ]
    arrivals = {0: list(enumerate(requests))}
    want, _, _ = run_loop(setup, False, arrivals)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got, _, kinds = run_loop(setup, True, arrivals)
    assert kinds == {"SlotRows"}
    assert_equal_samples(got, want)


def test_fused_weights_are_the_model_s_own(setup: Setup) -> None:
    """q/k/v and gate/up's fused weights are views of one buffer that the linears' weights
    are views of too: no copy beside them, the same Parameters, and a second decoder made on
    the model reads the same buffers."""
    model = setup.model
    first = LlamaDecoder(model)
    attention = model.get_base_model().model.layers[0].self_attn
    q = attention.q_proj.base_layer.weight
    assert q.untyped_storage().data_ptr() == first.layers[0].qkv.untyped_storage().data_ptr()
    assert torch.equal(first.layers[0].qkv[: q.shape[0]], q)
    assert attention.q_proj.base_layer.weight is q  # the Parameter kept
    again = LlamaDecoder(model)
    assert again.layers[0].qkv.data_ptr() == first.layers[0].qkv.data_ptr()
    before = fused_rows([attention.q_proj, attention.k_proj, attention.v_proj]).data_ptr()
    assert before == first.layers[0].qkv.data_ptr()


def test_a_model_the_fused_step_does_not_fit_decodes_in_transformers_layers(
    setup: Setup,
) -> None:
    """Linears with biases (as Qwen2's q/k/v) are not Llama's layer: the slots run
    transformers' layers, and sample what the padded loop samples."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    assert not LlamaDecoder.fits(model)
    assert LlamaDecoder.fits(setup.plain)
    loop = sampler.DecodeLoop(CPU, [EOS], setup.decode, max_rows=None, slots=True)
    loop.add(0, request(PROMPTS[0], None, max_tokens=3, seed=1))
    while loop.busy:
        loop.step(model)
    assert loop.slots is not None and loop.slots._decoder(model) is None


@pytest.mark.parametrize("seed", range(3))
def test_no_graph_is_dropped_over_a_run(
    setup: Setup, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graphs' way on the CPU (each bucket's step made once and replayed, as
    test_slot_decode's), under a cache budget: random joins and leaves over several row
    buckets, adapters arriving and leaving, long rows and a long prompt; every step captured
    is kept to the end (a graph dropped would be captured again: more captures than graphs),
    the pages' pool and table are the first ones, and the samples are the padded loop's."""
    import random

    from test_slot_decode import random_arrivals, replayed_capture

    from queue_tinker.workers.sampling.kv_pages import KvPages
    from queue_tinker.workers.sampling.slot_decode import SlotDecoder

    monkeypatch.setattr(SlotDecoder, "_capture", replayed_capture)
    draws = random.Random(200 + seed)
    arrivals = random_arrivals(draws, 14, steps=30, longest=40)
    late = max(arrivals) + 1  # a long prompt and a long row, after the others started
    arrivals[late] = [("long", request([7] * 150, "a2", max_tokens=60, seed=9, stop=[]))]
    options: dict[str, Any] = {"max_rows": 8, "max_cache_tokens": 3000}
    want, _, _ = run_loop(setup, False, arrivals, **options)
    loop = sampler.DecodeLoop(CPU, [EOS], setup.decode, slots=True, **options)
    assert loop.slots is not None
    loop.slots.graphs_wanted = True  # as on CUDA
    done: dict[Any, Any] = {}
    first: tuple[Any, ...] | None = None
    step = 0
    while loop.busy or step <= max(arrivals):
        for key, req in arrivals.get(step, []):
            loop.add(key, req)
        done.update(loop.step(setup.model))
        kv = loop.slots.kv
        if isinstance(kv, KvPages):
            now = (kv.pages[0][0], kv.table, loop.slots.adapters)
            first = first or now
            assert [a is b for a, b in zip(now, first, strict=True)] == [True] * 3, step
        step += 1
    assert_equal_samples(done, want)
    assert first is not None
    assert loop.slots.captured == len(loop.slots.graphs) >= 2


@pytest.mark.parametrize("kernels", ["references", "triton"])
def test_qwen3_decodes_in_the_fused_step_with_its_q_k_norms(
    setup: Setup, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    """Qwen3's layer (q / k norms before rotary) in the fused step, by the kernels' torch
    references and by the Triton kernels interpreted: the padded loop's samples."""
    from queue_tinker.workers.model.base_model import load_base_model
    from queue_tinker.workers.model.families.qwen3 import Qwen3Decoder

    torch.manual_seed(0)
    base = load_base_model("queue-tinker/tiny-qwen3", "cpu", tmp_path)
    model = with_test_adapters(base)
    assert Qwen3Decoder.fits(model) and not LlamaDecoder.fits(model)
    loop = assert_fused_samples_as_padded(setup, model, monkeypatch, kernels)
    assert loop.slots is not None and isinstance(loop.slots._decoder(model), Qwen3Decoder)


@pytest.mark.parametrize("kernels", ["references", "triton"])
def test_qwen2_decodes_in_the_fused_step_with_its_q_k_v_biases(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    """Qwen2's layer (biases on q, k and v, drawn non-zero) in the fused step with adapters,
    by the references and by the interpreted kernels: the padded loop's samples; the fused
    bias is a view of one buffer that the three biases are views of too."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from queue_tinker.workers.model.families.qwen3 import Qwen2Decoder

    config = Qwen2Config(
        vocab_size=setup.plain.config.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in base.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                linear.bias.normal_(std=0.5)
    model = with_test_adapters(base)
    assert Qwen2Decoder.fits(model) and not LlamaDecoder.fits(model)
    loop = assert_fused_samples_as_padded(setup, model, monkeypatch, kernels)
    decoder = loop.slots._decoder(model) if loop.slots is not None else None
    assert isinstance(decoder, Qwen2Decoder)
    bias = decoder.layers[0].qkv_bias
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert bias is not None and q_proj.bias.data_ptr() == bias.data_ptr()


def with_test_adapters(base: torch.nn.Module) -> Any:
    """The test adapters on another family's base (their configs name the tiny Llama)."""
    from test_sampler import with_adapters

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The PEFT config's `base_model_name_or_path`")
        return with_adapters(base)


def assert_fused_samples_as_padded(
    setup: Setup, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, kernels: str
) -> sampler.DecodeLoop:
    """A few requests over the base model and two adapters, padded then on the fused step
    (its Triton kernels interpreted if `kernels` says so): the same samples. The fused loop."""
    requests = [
        request(PROMPTS[0], None, n=2, max_tokens=6, seed=1, stop=[]),
        request(PROMPTS[1], "a1", max_tokens=5, seed=2, temperature=0.8, stop=[]),
        request(PROMPTS[2], "sharp", max_tokens=4, temperature=0, stop=[]),
    ]
    results = []
    for slots in (False, True):
        if slots and kernels == "triton":
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        loop = sampler.DecodeLoop(CPU, [EOS], setup.decode, max_rows=None, slots=slots)
        for key, req in enumerate(requests):
            loop.add(key, req)
        done: dict[Any, Any] = {}
        while loop.busy:
            done.update(loop.step(model))
        results.append(done)
    assert_equal_samples(results[1], results[0])
    return loop
