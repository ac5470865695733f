"""The official `tinker` SDK, unchanged, on each family's tiny built-in: one real
`queue-tinker serve` and a LoRA worker per base model (Qwen3 dense, gpt-oss, DeepSeek-V3,
Qwen3.5, Qwen3-VL). A user's first loop on each: create, forward_backward + optim_step until the
loss is at most half, save the weights for a sampler, and sample from them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from procs import SDK_CLIENT_MARKS, lora_deployment
from tinker import types

from queue_tinker.settings import Settings

FAMILIES = (
    "queue-tinker/tiny-qwen3",
    "queue-tinker/tiny-gpt-oss",
    "queue-tinker/tiny-deepseek-v3",
    "queue-tinker/tiny-qwen3.5",
    "queue-tinker/tiny-qwen3-vl",
)
PAIRS = [("Q: 2+2?\nA:", " 4\n"), ("Q: 3+5?\nA:", " 8\n"), ("Q: 7-4?\nA:", " 3\n")]

pytestmark = SDK_CLIENT_MARKS


@pytest.fixture(scope="module")
def deployment(redis_url: str, database_url: str) -> Iterator[Settings]:
    with lora_deployment(redis_url, database_url, FAMILIES[0], also=FAMILIES[1:]) as settings:
        yield settings


def answer_datum(prompt: list[int], answer: list[int]) -> types.Datum:
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.array(weights, dtype=np.float32),
        },
    )


@pytest.mark.parametrize("base_model", FAMILIES, ids=lambda name: name.split("/")[1])
def test_a_first_loop_halves_the_loss_and_its_weights_sample(
    sdk_service: tinker.ServiceClient, base_model: str
) -> None:
    trainer = sdk_service.create_lora_training_client(
        base_model=base_model, rank=8, seed=1
    ).result()
    tokenizer = trainer.get_tokenizer()
    batch = [answer_datum(tokenizer.encode(p), tokenizer.encode(a)) for p, a in PAIRS]
    adam = types.AdamParams(learning_rate=2e-2)
    losses = []
    for _ in range(30):
        fb = trainer.forward_backward(batch, "cross_entropy")
        step = trainer.optim_step(adam)
        losses.append(fb.result(timeout=120).metrics["loss:sum"])
        step.result(timeout=120)
    assert all(np.isfinite(losses)) and losses[-1] <= 0.5 * losses[0], losses

    saved = trainer.save_weights_for_sampler(name="first").result(timeout=120)
    sampler = sdk_service.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints(tokenizer.encode(PAIRS[0][0]))
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=5)
    result = sampler.sample(prompt=prompt, num_samples=2, sampling_params=params)
    sequences = result.result(timeout=120).sequences
    assert len(sequences) == 2
    for sequence in sequences:
        assert 1 <= len(sequence.tokens) <= 3 and sequence.logprobs is not None
        assert all(np.isfinite(sequence.logprobs))
    again = sampler.sample(prompt=prompt, num_samples=2, sampling_params=params).result(120)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in sequences]
