"""The official `tinker` SDK, unchanged, on a mixture-of-experts base: a real `queue-tinker
serve` and a LoRA worker on queue-tinker/tiny-moe (Qwen3-MoE, LoRA on attention and experts)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from procs import SDK_CLIENT_MARKS, lora_deployment
from tinker import types

from queue_tinker.settings import Settings

MOE = "queue-tinker/tiny-moe"

pytestmark = SDK_CLIENT_MARKS


@pytest.fixture(scope="module")
def deployment(redis_url: str, database_url: str) -> Iterator[Settings]:
    with lora_deployment(redis_url, database_url, MOE) as settings:
        yield settings


def text_datum(tokens: list[int], n_prompt: int) -> types.Datum:
    weights = [0.0] * (n_prompt - 1) + [1.0] * (len(tokens) - n_prompt)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.array(weights, dtype=np.float32),
        },
    )


def test_a_cross_entropy_loop_learns_and_its_weights_sample(
    sdk_service: tinker.ServiceClient,
) -> None:
    """create (a rank over Tinker's MoE cap refused), forward_backward + optim_step until the
    loss falls, forward_backward_custom equal to forward's loss, and the sampler's
    compute_logprobs equal to the trainer's forward."""
    with pytest.raises(tinker.RequestFailedError, match=r"rank: 64 exceeds the max LoRA rank 32"):
        sdk_service.create_lora_training_client(base_model=MOE, rank=64).result()
    trainer = sdk_service.create_lora_training_client(base_model=MOE, rank=8, seed=1).result()
    tokenizer = trainer.get_tokenizer()
    pairs = [("Q: 2+2?\nA:", " 4\n"), ("Q: 3+5?\nA:", " 8\n"), ("Q: 7-4?\nA:", " 3\n")]
    batch = []
    for prompt, answer in pairs:
        prompt_ids = tokenizer.encode(prompt)
        batch.append(text_datum(prompt_ids + tokenizer.encode(answer), len(prompt_ids)))
    adam = types.AdamParams(learning_rate=1e-2)
    losses = []
    for _ in range(6):
        out = trainer.forward_backward(batch, "cross_entropy").result(timeout=120)
        losses.append(out.metrics["loss:sum"])
        trainer.optim_step(adam).result(timeout=120)
    assert all(np.isfinite(losses)) and losses[-1] < 0.75 * losses[0], losses

    def weighted_nll(data: list[types.Datum], logprobs: list[torch.Tensor]) -> Any:
        weights = [torch.tensor(d.loss_fn_inputs["weights"].data) for d in data]
        return -sum(torch.dot(w, lp) for w, lp in zip(weights, logprobs, strict=True)), {}

    forward = trainer.forward(batch, "cross_entropy").result(timeout=120)
    custom = trainer.forward_backward_custom(batch, weighted_nll).result(timeout=120)
    assert custom.metrics["loss:sum"] == pytest.approx(forward.metrics["loss:sum"], rel=1e-4)

    sampler = trainer.save_weights_and_get_sampling_client().result()
    last = int(batch[0].loss_fn_inputs["target_tokens"].data[-1])
    tokens = [*batch[0].model_input.to_ints(), last]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=120)
    np.testing.assert_allclose(
        scored[1:], forward.loss_fn_outputs[0]["logprobs"].data, rtol=1e-4, atol=1e-4
    )


def test_an_importance_sampling_rl_loop(sdk_service: tinker.ServiceClient) -> None:
    """sample -> advantages (reward minus the group's mean) -> forward_backward with
    importance_sampling -> optim_step: the sampler's weights are the trainer's, so every
    ratio is 1 and the loss is -sum(advantages) each round; the weights move."""
    trainer = sdk_service.create_lora_training_client(base_model=MOE, rank=4, seed=2).result()
    prompt = trainer.get_tokenizer().encode("Say a digit:")
    adam = types.AdamParams(learning_rate=1e-2)
    for iteration in range(2):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        result = sampler.sample(
            prompt=types.ModelInput.from_ints(prompt),
            num_samples=4,
            sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=iteration),
        ).result(timeout=120)
        rewards = [sum(chr(t).isdigit() for t in s.tokens if t < 128) for s in result.sequences]
        mean = sum(rewards) / len(rewards)
        data, advantages_sum = [], 0.0
        for sequence, reward in zip(result.sequences, rewards, strict=True):
            assert sequence.logprobs is not None
            n_prompt, n_sampled = len(prompt) - 1, len(sequence.tokens)
            tokens = prompt + list(sequence.tokens)
            advantage = reward - mean + 0.25  # never all zero
            advantages_sum += advantage * n_sampled
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.array(tokens[1:], dtype=np.int64),
                        "logprobs": np.array(
                            [0.0] * n_prompt + list(sequence.logprobs), dtype=np.float32
                        ),
                        "advantages": np.array(
                            [0.0] * n_prompt + [advantage] * n_sampled, dtype=np.float32
                        ),
                    },
                )
            )
        out = trainer.forward_backward(data, "importance_sampling").result(timeout=120)
        assert out.metrics["loss:sum"] == pytest.approx(-advantages_sum, rel=1e-3, abs=1e-3)
        trainer.optim_step(adam).result(timeout=120)
    before = np.array(out.loss_fn_outputs[0]["logprobs"].data)
    moved = trainer.forward(data[:1], "importance_sampling").result(timeout=120)
    after = np.array(moved.loss_fn_outputs[0]["logprobs"].data)
    assert np.all(np.isfinite(after)) and not np.allclose(after, before, rtol=0, atol=1e-4)
