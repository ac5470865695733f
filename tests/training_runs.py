"""A short training run through the Python client on the built-in tiny model: its data, its
optimizer and its steps, shared by the service, failover, fault and Redis-restart tests."""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import load_file

import queue_tinker as tinker
from queue_tinker import types

TINY = "queue-tinker/tiny-llama"
RANK = 8
SEED = 3


def texts_to_batch(texts: list[str]) -> list[types.Datum]:
    """Byte tokens (the tiny model's tokenizer), next-token targets, weights on the second half."""
    batch = []
    for t in texts:
        ids = list(t.encode())
        weights = np.array(
            [0.0 if i < len(ids) // 2 else 1.0 for i in range(1, len(ids))], dtype=np.float32
        )
        batch.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.array(ids[1:], dtype=np.int64),
                    "weights": weights,
                },
            )
        )
    return batch


BATCHES = [
    texts_to_batch(["the cat sat on the mat", "a dog", "hello hello hello world"]),
    texts_to_batch(["queue tinker trains loras", "one two three four five six"]),
]
ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


def adapter_weights(
    service_client: tinker.ServiceClient, tc: tinker.TrainingClient, name: str
) -> dict[str, torch.Tensor]:
    path = tc.save_weights_for_sampler(name).result(timeout=60).path
    run, _, ckpt = path.removeprefix("tinker://").split("/")
    return load_file(
        service_client.settings.storage_dir
        / run
        / "sampler_weights"
        / ckpt
        / "adapter_model.safetensors"
    )


def train(tc: tinker.TrainingClient, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        fb = tc.forward_backward(BATCHES[step % len(BATCHES)], "cross_entropy")
        opt = tc.optim_step(ADAM)
        losses.append(fb.result(timeout=60).loss)
        opt.result(timeout=60)
    return losses
