"""The data of a benchmark's requests: datums of token rows, prompts and sampling parameters.
numpy and queue_tinker's types only, so a benchmark without torch can use it."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from queue_tinker.types import Datum, ModelInput, SamplingParams, TensorData

RANK = 32  # the service's default LoRA rank (Tinker's)


def token_rows(batch: int, seq: int, seed: int = 0, vocab: int = 256) -> np.ndarray:
    """(batch, seq + 1) random tokens: row i's inputs are [:-1], its targets [1:]."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1))


def datums(rows: Iterable[np.ndarray], weights: bool = True) -> list[Datum]:
    """A datum per row of tokens: inputs [:-1], next-token targets [1:], and (`weights`) a
    weight of 1 on each."""
    return [datum(row, {}, weights) for row in rows]


def rl_datums(rows: Iterable[np.ndarray], seed: int, weighted: Iterable[bool]) -> list[Datum]:
    """A policy-gradient datum per row of tokens (targets, sampling logprobs, advantages), with
    weights of 1 where `weighted` says so (datums whose inputs differ take their loss one at a
    time)."""
    rng = np.random.default_rng(seed)
    data = []
    for row, weights in zip(rows, weighted, strict=True):
        n = len(row) - 1
        scores = {
            "logprobs": TensorData.from_numpy(rng.uniform(-4, -1, n).astype(np.float32)),
            "advantages": TensorData.from_numpy(rng.normal(size=n).astype(np.float32)),
        }
        data.append(datum(row, scores, weights))
    return data


def datum(row: np.ndarray, inputs: dict[str, TensorData], weights: bool) -> Datum:
    """The datum of a row of tokens: inputs [:-1], next-token targets [1:] and the other loss
    `inputs`, and (`weights`) a weight of 1 on each target."""
    inputs = {"target_tokens": TensorData.from_numpy(row[1:].astype(np.int64)), **inputs}
    if weights:
        inputs["weights"] = TensorData.from_numpy(np.ones(len(row) - 1, dtype=np.float32))
    return Datum(model_input=ModelInput.from_ints(row[:-1].tolist()), loss_fn_inputs=inputs)


def random_prompts(count: int, seed: int) -> list[list[int]]:
    """`count` prompts of 8-48 random byte tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(8, 49, count)]


def sampling_params(seed: int, tokens: int) -> SamplingParams:
    """Exactly `tokens` new tokens (no stop), temperature 1, reproducible from `seed`."""
    return SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, stop=[])
