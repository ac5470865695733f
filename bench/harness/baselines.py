"""What the service is held against, measured in the same run: the bare PEFT training loop
(`BareLoop`: a step with no queue, in the benchmark's process) and transformers' batched
`generate()` on the same prompts (`generate`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.harness.data import RANK
from bench.harness.models import add_adapters, frozen_base, lora_pool
from queue_tinker.builtin_models import PAD_ID
from queue_tinker.types.training import AdamParams, LoraConfig

ADAM = AdamParams(learning_rate=1e-4)  # beta1 0.9, beta2 0.95, eps 1e-12, no weight decay


class BareLoop:
    """The worker's model and LoRA config (the same `peft.get_peft_model` call, through its
    AdapterPool), trained by hand in this process with `torch.optim.AdamW`."""

    def __init__(self, model: str, data_dir: Path, rows: np.ndarray) -> None:
        base = frozen_base(model, "cpu", data_dir)
        self.pool = lora_pool(base, model, adapters=1)
        [self.adapter] = add_adapters(self.pool, LoraConfig(rank=RANK), seeds=[0])
        self.model = self.pool.model
        self.params = sum(p.numel() for p in base.parameters() if not p.requires_grad)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.lora_params = sum(p.numel() for p in trainable)
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=ADAM.learning_rate,
            betas=(ADAM.beta1, ADAM.beta2),
            eps=ADAM.eps,
            weight_decay=ADAM.weight_decay,
        )
        tokens = torch.from_numpy(rows)
        self.ids = tokens[:, :-1].contiguous()
        self.mask = torch.ones_like(self.ids)
        self.targets = tokens[:, 1:].reshape(-1)
        self.weights = torch.ones(self.targets.numel())

    def forward_backward(self) -> float:
        """Forward, target logprobs, loss = -sum(w * logp), backward; the loss."""
        logits = self.model(input_ids=self.ids, attention_mask=self.mask, use_cache=False).logits
        logp = -F.cross_entropy(logits.flatten(0, 1).float(), self.targets, reduction="none")
        loss = -(self.weights * logp).sum()
        loss.backward()
        return float(loss.detach())

    def step(self) -> tuple[float, float]:
        """One training step; (loss, seconds into the step when backward had returned)."""
        t0 = time.perf_counter()
        loss = self.forward_backward()
        backward_done = time.perf_counter() - t0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, backward_done

    def timed(self, steps: int) -> list[tuple[float, float]]:
        """(step seconds, forward+backward seconds) of each of `steps` steps."""
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _, backward_done = self.step()
            times.append((time.perf_counter() - t0, backward_done))
        return times


def left_padded(
    prompts: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch (as generate() wants for a decoder-only model):
    token ids and attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, tokens: int, **extra: Any) -> None:
    """One batched `generate()` call sampling exactly `tokens` new tokens per row (temperature
    1, no top-k or top-p); `extra` goes to generate() (PEFT's adapter_names)."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=PAD_ID,
            **extra,
        )
    assert out.shape[1] - ids.shape[1] == tokens, out.shape
