"""The math of forward / forward_backward / optim_step on the active adapter."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from queue_tinker.types.enums import LossFn
from queue_tinker.types.tensors import Datum, TensorData
from queue_tinker.types.training import AdamParams, ForwardBackwardOutput
from workers.adapters import Adapter
from workers.losses import batch_loss


def padded_batch(data: Sequence[Datum], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and attention mask; padding sits after every real token, so a
    causal model's outputs at real positions do not depend on it."""
    tokens = [d.model_input.to_ints() for d in data]
    width = max(len(t) for t in tokens)
    ids = np.zeros((len(tokens), width), dtype=np.int64)
    mask = np.zeros((len(tokens), width), dtype=np.int64)
    for row, seq in enumerate(tokens):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def target_logprobs(
    model: torch.nn.Module, data: Sequence[Datum], device: torch.device
) -> list[torch.Tensor]:
    """log p(target_i | tokens <= i) for every datum, as float32 tensors (T_i,)."""
    ids, mask = padded_batch(data, device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    targets = [torch.from_numpy(np.array(d.loss_fn_inputs["target_tokens"].data, copy=True))
               .to(device) for d in data]
    lengths = [t.numel() for t in targets]
    # Only the scored positions go through the softmax: (sum T_i, vocab), never (B, T, vocab).
    # One index_select: its backward is one index_add, where a slice per row made a zero
    # (B, T, vocab) gradient per row (quadratic in the rows: 36% of a 64-row pass's CPU time).
    width = logits.shape[1]
    index = torch.cat([torch.arange(n, device=device) + row * width
                       for row, n in enumerate(lengths)])
    rows = logits.reshape(-1, logits.shape[-1]).index_select(0, index).float()
    logprobs = -F.cross_entropy(rows, torch.cat(targets), reduction="none")
    return list(torch.split(logprobs, lengths))


def loss_inputs(datum: Datum, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v.data, copy=True)).to(device)
            for k, v in datum.loss_fn_inputs.items()}


def op_loss(
    logprobs: Sequence[torch.Tensor],
    data: Sequence[Datum],
    loss_fn: LossFn,
    config: dict[str, float],
    device: torch.device,
) -> tuple[torch.Tensor, ForwardBackwardOutput]:
    """One op's loss (the sum of its data's losses) and its output: per-datum logprobs and
    the loss metrics."""
    inputs = [loss_inputs(d, device) for d in data]
    loss, metrics = batch_loss(loss_fn.value, logprobs, inputs, config)
    outputs = [{"logprobs": TensorData.from_numpy(lp.detach().float().cpu().numpy())}
               for lp in logprobs]
    return loss, ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)


def forward_backward(
    model: torch.nn.Module,
    data: Sequence[Datum],
    loss_fn: LossFn,
    config: dict[str, float],
    device: torch.device,
    *,
    backward: bool,
) -> ForwardBackwardOutput:
    """Loss and per-datum logprobs; with `backward`, gradients are added to the adapter's
    .grad (accumulating until optim_step, as in torch)."""
    with torch.set_grad_enabled(backward):
        logprobs = target_logprobs(model, data, device)
        loss, out = op_loss(logprobs, data, loss_fn, config, device)
        if backward:
            loss.backward()
    return out


def optim_step(adapter: Adapter, params: AdamParams) -> dict[str, float]:
    """One torch.optim.AdamW step with this call's hyperparameters, then clear the grads."""
    trainable = [p for p in adapter.params.values() if p.grad is not None]
    grad_norm = 0.0
    if trainable:
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, max_norm))
    for group in adapter.optimizer.param_groups:
        group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2),
                     eps=params.eps, weight_decay=params.weight_decay)
    adapter.optimizer.step()
    adapter.optimizer.zero_grad(set_to_none=True)
    adapter.step += 1
    return {"grad_norm:mean": grad_norm, "learning_rate:mean": params.learning_rate,
            "step:max": float(adapter.step)}
