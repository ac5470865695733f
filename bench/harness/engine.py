"""The engine's training calls, made as a worker makes them. The only module of bench/ that
reaches workers/training: a change of the engine's API is a change of this file alone.

A worker runs every forward_backward op through a shared pass (one op alone, or several
adapters' ops together), split into micro-batches where one pass would recompute layers, and
its optim_steps through one optimizer call; so do these.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from queue_tinker.config.engine import EngineConfig
from queue_tinker.types.enums import LossFn
from queue_tinker.types.requests.training import ForwardBackwardOutput, OptimParams
from queue_tinker.types.tensors import Datum
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.fit import FitSettings, fit_resident_adapters
from queue_tinker.workers.model.fused_kernels import apply_liger, liger_wanted
from queue_tinker.workers.model.memory import (
    LoraMatmuls,
    device_budgets,
    device_memory,
    hold_to,
    lora_compute_dtype,
    lora_copy_bytes,
    memory_cap,
)
from queue_tinker.workers.training.losses import device_batch_loss
from queue_tinker.workers.training.micro_batches import Piece, micro_batched_pass, planned_batches
from queue_tinker.workers.training.model_pass import (
    LoraForm as LoraForm,  # re-exported: bench.mfu names the forms
)
from queue_tinker.workers.training.model_pass import (
    PassPlan,
    budgeted,
    causal_lm,
    decoder_layers,
)
from queue_tinker.workers.training.optimizers import optim_steps
from queue_tinker.workers.training.packing import padding_fraction
from queue_tinker.workers.training.shared_pass import (
    PassOp,
    op_loss_inputs,
    rows_for,
)

Batch = tuple[Adapter, Sequence[Datum]]  # one forward_backward op: its adapter and its data
CPU = torch.device("cpu")


PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def forward_backward(
    pool: AdapterPool,
    batches: Sequence[Batch],
    device: torch.device,
    plan: PassPlan | None = None,
    loss_fn: LossFn = LossFn.CROSS_ENTROPY,
) -> list[ForwardBackwardOutput]:
    """A forward_backward op per batch (cross-entropy, or ppo with its default clipping), all
    in one pass of the pool's model; each adapter's gradients add up in its .grad until its
    optim_step. An op's error is raised."""
    config = PPO if loss_fn is LossFn.PPO else {}
    ops = [
        PassOp(adapter=adapter, data=data, loss_fn=loss_fn, config=config, backward=True)
        for adapter, data in batches
    ]
    plan = plan or PassPlan()
    outputs = []
    for out in micro_batched_pass(pool, ops, planned(pool, ops, device, plan), device, plan):
        if isinstance(out, Exception):
            raise out
        outputs.append(out)
    return outputs


def worker_plan(
    pool: AdapterPool,
    device: torch.device,
    lora_matmuls: LoraMatmuls = "auto",
    cap: int | None = None,
) -> PassPlan:
    """The pass plan a worker makes for this model on this device now (its checkpointing
    planned from the free memory, borrowing the sampler's share while it lies free, as it
    does here) with QT_LORA_MATMUL_DTYPE=`lora_matmuls` and QT_DEVICE_MEMORY_GIB=`cap`
    (bytes; hold_device first)."""
    config = causal_lm(pool.model).config.get_text_config()
    dtype = base_dtype(pool)
    lora_copy = lora_copy_bytes(dtype.itemsize, lora_matmuls)
    budgets = device_budgets(
        config, device, dtype, checkpointing=True, lora_copy=lora_copy, cap=cap
    )
    return budgeted(PassPlan(), budgets, config, dtype, lora_copy=lora_copy, device=device, cap=cap)


def hold_device(device: torch.device, gib: float | None) -> int | None:
    """The device held to `gib` GiB, as QT_DEVICE_MEMORY_GIB holds a worker's (before
    anything is allocated); the cap in bytes, None without one."""
    cap = memory_cap(gib)
    hold_to(device, cap)
    return cap


def fit_explanation(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype, cap: int | None
) -> str | None:
    """The start-up fit check's paragraph for this model on the device as a worker reads it
    (QT_DEVICE_MEMORY_GIB=`cap` bytes), at the settings' defaults; None off CUDA."""
    if device.type != "cuda":
        return None
    _free, total = device_memory(device, cap)
    settings = FitSettings.of(EngineConfig())
    config = causal_lm(model).config
    plan = fit_resident_adapters(config, dtype.itemsize, total, settings, "the model")
    return plan.explanation()


def set_lora_matmuls(pool: AdapterPool, setting: LoraMatmuls) -> None:
    """The pool's LoRA matmuls as QT_LORA_MATMUL_DTYPE=`setting` makes a worker's."""
    pool.lora_compute = lora_compute_dtype(base_dtype(pool), setting)


@contextmanager
def lora_matmuls(pool: AdapterPool, setting: LoraMatmuls) -> Iterator[None]:
    """Meanwhile the pool's LoRA matmuls run as QT_LORA_MATMUL_DTYPE=`setting` makes them."""
    before = pool.lora_compute
    set_lora_matmuls(pool, setting)
    try:
        yield
    finally:
        pool.lora_compute = before


def base_dtype(pool: AdapterPool) -> torch.dtype:
    return next(causal_lm(pool.model).parameters()).dtype


def kernels_wanted(device: torch.device) -> bool:
    """Whether a worker alone on this device puts liger's kernels in by default
    (QT_LIGER_KERNELS=auto: CUDA, liger installed)."""
    return liger_wanted("auto", device, grouped=False)


def put_kernels_in(pool: AdapterPool, device: torch.device) -> bool:
    """liger's kernels into the pool's model, for good, where a worker alone puts them by
    default (kernels_wanted, and an architecture liger knows); whether they went in."""
    return kernels_wanted(device) and apply_liger(causal_lm(pool.model))


def planned(
    pool: AdapterPool, ops: Sequence[PassOp], device: torch.device, plan: PassPlan
) -> list[list[Piece]]:
    """The micro-batches a worker runs these ops in (one: the pass whole)."""
    layers = len(decoder_layers(pool.model))
    routed = bool(pool.expert_parameters)
    return planned_batches(ops, plan, device, layers, routed=routed, lora=pool.lora_layers())


def pass_plan(
    pool: AdapterPool,
    adapter: Adapter,
    plan: PassPlan,
    data: Sequence[Datum],
    device: torch.device = CPU,
) -> str:
    """ "k of L layers checkpointed" (Recomputation.described) in a backward pass of the
    adapter's `data` (its largest micro-batch), and "in n micro-batches" where the worker
    splits it so."""
    layers = len(decoder_layers(pool.model))
    op = PassOp(adapter=adapter, data=data, loss_fn=LossFn.CROSS_ENTROPY, config={}, backward=True)
    batches = planned(pool, [op], device, plan)

    def padded(batch: Sequence[Piece]) -> int:
        widths = [d.model_input.length for p in batch for d in data[p.start : p.end]]
        return len(widths) * max(widths)

    recomputation = plan.recomputation(max(map(padded, batches)), True, layers)
    text = recomputation.described(layers)
    return text if len(batches) == 1 else f"{text} in {len(batches)} micro-batches"


def optim_step(adapter: Adapter, params: OptimParams) -> dict[str, float]:
    """One optimizer step of the adapter (AdamW with `params`), its gradients cleared; the
    step's metrics."""
    return optim_steps([(adapter, params)])[0]


def clear_grads(adapters: Iterable[Adapter]) -> None:
    """Drop the adapters' gradients, as if no forward_backward had run since their step."""
    for adapter in adapters:
        for param in adapter.params.values():
            param.grad = None


def batch_shape(batches: Sequence[Batch], plan: PassPlan) -> tuple[int, int]:
    """(rows, width) of the batch one pass of these ops lays out under `plan`."""
    data = [datum for _, part in batches for datum in part]
    rows = rows_for(data, CPU, plan, groups=[len(part) for _, part in batches])
    return int(rows.ids.shape[0]), int(rows.ids.shape[1])


def padding_share(lengths: Sequence[int]) -> float:
    """How much of a batch of these lengths, a datum a row, is padding (0 to 1)."""
    return padding_fraction(lengths)


def whole_logits_forward_backward(
    pool: AdapterPool, adapter: Adapter, data: Sequence[Datum]
) -> float:
    """The engine's former path, on the CPU: the adapter's whole logits (rows, positions,
    vocabulary), the scored rows copied to fp32, cross-entropy, backward through all of it,
    every layer's activations kept; the loss."""
    pool.activate(adapter)
    rows = rows_for(data, CPU, PassPlan(pack_above_padding=None))
    logits = pool.model(input_ids=rows.ids, attention_mask=rows.mask, use_cache=False).logits
    targets = [
        torch.from_numpy(np.array(d.loss_fn_inputs["target_tokens"].data, copy=True)) for d in data
    ]
    width = logits.shape[1]
    index = torch.cat([torch.arange(t.numel()) + row * width for row, t in enumerate(targets)])
    scored = logits.reshape(-1, logits.shape[-1]).index_select(0, index).float()
    logprobs = -F.cross_entropy(scored, torch.cat(targets), reduction="none")
    split = list(torch.split(logprobs, [t.numel() for t in targets]))
    inputs = op_loss_inputs(data, CPU).per_datum
    loss, _ = device_batch_loss(LossFn.CROSS_ENTROPY.value, split, inputs, {})
    loss.backward()
    return float(loss.detach())
