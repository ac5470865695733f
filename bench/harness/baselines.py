"""What the service is held against, measured in the same run: the bare PEFT training loop
(`BareLoop`: a step with no queue, in the benchmark's process), plain transformers + PEFT's
forward_backward on the engine's own model and data (`plain_forward_backward`, bench.mfu) and
transformers' batched `generate()` on the same prompts (`generate`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import PreTrainedModel

from bench.harness.data import RANK
from bench.harness.models import add_adapters, frozen_base, lora_pool
from queue_tinker.builtin_models import PAD_ID
from queue_tinker.types.requests.training import AdamParams, LoraConfig
from queue_tinker.types.tensors import Datum
from queue_tinker.workers.model.adapters import Adapter, AdapterPool

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


def plain_forward_backward(
    pool: AdapterPool,
    adapter: Adapter,
    data: list[Datum],
    device: torch.device,
    *,
    checkpointing: bool,
) -> float:
    """forward_backward as plain transformers + PEFT trains: the adapter active, the datums
    right-padded into one batch through the model's own forward (its attention, SDPA, and its
    whole logits), fp32 cross-entropy over the targets, one backward; with `checkpointing`,
    transformers' own gradient checkpointing of every decoder layer. The loss."""
    pool.activate(adapter)
    width = max(d.model_input.length for d in data)
    ids = torch.full((len(data), width), PAD_ID, dtype=torch.long)
    targets = torch.full((len(data), width), -100, dtype=torch.long)  # -100: not scored
    for row, datum in enumerate(data):
        tokens = datum.model_input.to_ints()
        ids[row, : len(tokens)] = torch.tensor(tokens)
        target = np.asarray(datum.loss_fn_inputs["target_tokens"].data)
        targets[row, : len(target)] = torch.from_numpy(target.astype(np.int64))
    ids, targets = ids.to(device), targets.to(device)
    model = pool.model
    lm = cast(PreTrainedModel, model.get_base_model() if isinstance(model, PeftModel) else model)
    modes = {module: module.training for module in lm.modules()}
    if checkpointing:  # transformers checkpoints only in training mode (no dropout here)
        _checkpointing(lm, "enable")({"use_reentrant": False})
        lm.train()
    try:
        mask = (ids != PAD_ID).long()
        logits = pool.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        loss.backward()
    finally:
        if checkpointing:
            _checkpointing(lm, "disable")()
            for module, training in modes.items():
                module.training = training
    return float(loss.detach())


def _checkpointing(lm: PreTrainedModel, verb: str) -> Any:
    """transformers' switch of its own checkpointing: activation_checkpointing_<verb> where the
    installed version has it (gradient_checkpointing_<verb> is deprecated there)."""
    return getattr(lm, f"activation_checkpointing_{verb}", None) or getattr(
        lm, f"gradient_checkpointing_{verb}"
    )


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
