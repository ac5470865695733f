"""The demo task: teach the built-in tiny model a dozen capitals, the Tinker way.

Small enough that the ~107K-parameter `queue-tinker/tiny-llama` learns it in well under 100
steps on a CPU, so it serves both `queue-tinker demo` and the test of the promise "training
loss falls by at least 90% within 100 steps". No torch here: it runs in the client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from queue_tinker.types import AdamParams, Datum, ModelInput, SamplingParams, TensorData

DEMO_BASE_MODEL = "queue-tinker/tiny-llama"
DEMO_RANK = 16
DEMO_LEARNING_RATE = 5e-3
DEMO_STEPS = 100
# Greedy, up to the end of the line: the answer as the model would give it.
ANSWER_PARAMS = SamplingParams(max_tokens=16, temperature=0.0, stop=["\n"])

Encode = Callable[[str], Sequence[int]]
StepCallback = Callable[[int, float], None]


@dataclass(frozen=True)
class Example:
    prompt: str
    completion: str


_CAPITALS = (
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Egypt", "Cairo"),
    ("Spain", "Madrid"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Canada", "Ottawa"),
    ("Norway", "Oslo"),
    ("Greece", "Athens"),
    ("Chile", "Santiago"),
    ("Cuba", "Havana"),
)


def demo_examples() -> list[Example]:
    """Twelve prompt/completion pairs; the completion is what the model learns to say."""
    return [Example(f"Q: capital of {country}?\nA:", f" {city}\n") for country, city in _CAPITALS]


def _encoder(tokenizer_or_encode: Any) -> Encode:
    # A Hugging Face tokenizer is callable too (returning a BatchEncoding), so prefer .encode.
    encode = getattr(tokenizer_or_encode, "encode", tokenizer_or_encode)
    if not callable(encode):
        raise TypeError(f"expected a tokenizer or an encode function, got {tokenizer_or_encode!r}")
    return encode


def make_datum(prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> Datum:
    """Next-token prediction on the completion only: input tokens[:-1], targets tokens[1:],
    weight 1 where the target is a completion token."""
    tokens = [*prompt_tokens, *completion_tokens]
    weights = [0.0] * len(prompt_tokens) + [1.0] * len(completion_tokens)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
            "weights": TensorData.from_numpy(np.array(weights[1:], dtype=np.float32)),
        },
    )


def demo_batch(tokenizer_or_encode: Any, examples: Sequence[Example]) -> list[Datum]:
    """Datums for `examples`, tokenized by a tokenizer (or a client) or an encode function."""
    encode = _encoder(tokenizer_or_encode)
    return [make_datum(list(encode(e.prompt)), list(encode(e.completion))) for e in examples]


def completion_token_count(batch: Sequence[Datum]) -> int:
    """Tokens the loss is summed over (Tinker losses are sums), to report a per-token loss."""
    return int(sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in batch))


def train(
    training_client: Any,
    steps: int = DEMO_STEPS,
    *,
    on_step: StepCallback | None = None,
    learning_rate: float = DEMO_LEARNING_RATE,
) -> list[float]:
    """`steps` steps of forward_backward + optim_step on the whole dataset; the loss of each
    step (the summed cross-entropy before that step's update)."""
    batch = demo_batch(training_client, demo_examples())
    adam = AdamParams(learning_rate=learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
    losses: list[float] = []
    for step in range(steps):
        # Both ops go into the model's queue before we wait, so they run back to back.
        fwdbwd = training_client.forward_backward(batch, "cross_entropy")
        optim = training_client.optim_step(adam)
        loss = float(fwdbwd.result().loss)
        optim.result()
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return losses


def answers(sampling_client: Any, examples: Sequence[Example]) -> list[str]:
    """What a sampling client completes each prompt with (greedy, one line), all requests
    sent before any is awaited so the worker generates them in one batch."""
    tokenizer = sampling_client.get_tokenizer()
    pending = [
        sampling_client.sample(ModelInput.from_ints(tokenizer.encode(e.prompt)), 1, ANSWER_PARAMS)
        for e in examples
    ]
    return [tokenizer.decode(p.result().sequences[0].tokens) for p in pending]
