"""One pass of the model over a padded batch: log p(target) at every scored position, with
memory that does not grow with tokens x vocabulary nor, past a threshold, with tokens x layers.

- **Logprobs through the unembedding in chunks.** The decoder returns its final hidden states;
  the unembedding (with its LoRA, when `train_unembed` adapts it) turns a chunk of positions at a
  time into logits, which are upcast to fp32 and reduced to log p(target) at once. In backward a
  chunk's logits are recomputed (activation checkpointing of the chunk), so at most one chunk's
  (rows, positions, vocab) logits and their gradient exist at any moment. Llama-3.1's vocabulary
  (128,256) makes whole logits 0.5 MiB per token in fp32: 16 GiB at 32k tokens, before their
  gradient.
- **Activation checkpointing per decoder layer.** Meanwhile each decoder layer keeps only its
  input and recomputes its activations in backward (torch.utils.checkpoint, non-reentrant), so
  a pass keeps (layers + 1) hidden states per token instead of every layer's intermediates.
  A layer checkpointed selectively keeps its wide GEMMs' and attention's outputs as well and
  recomputes only the cheap work between them (norms, RoPE, SwiGLU, LoRA's rank-wide B):
  about half a plain layer's bytes for a few percent of its forward's time.
  Results are equal to a pass without it: the recomputation is the same computation.

Both run inside whatever wraps the model's LoRA layers (PEFT's active adapter, or the shared
pass's row blocks): the caller keeps that in place until backward is done, because backward
recomputes through it.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal, TypeVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from peft import PeftModel
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)
from transformers import PretrainedConfig, PreTrainedModel

from queue_tinker.config.engine import EngineConfig
from queue_tinker.workers.model.memory import (
    Budgets,
    Checkpointing,
    LayerBytes,
    Recomputation,
    cheapest_recomputation,
    layer_bytes,
    logit_chunk_cap,
    set_recomputation,
    spare_activation_bytes,
)
from queue_tinker.workers.model.vision_language import RowImages, hidden_states
from queue_tinker.workers.training.packing import RowBatch, padding_fraction

T = TypeVar("T")
LoraForm = Literal["blocks", "stacked", "grouped"]
# What a selectively checkpointed layer keeps (torch's selective activation checkpointing): an
# op's outputs are saved (MUST_SAVE) or made again in backward (PREFER_RECOMPUTE).
KeepPolicy = Callable[..., CheckpointPolicy]


@dataclass(frozen=True)
class PassPlan:
    """How a worker runs its model passes (QT_ACTIVATION_CHECKPOINTING and friends)."""

    # auto, where the device's memory is known (activation_budget and layer_bytes, from its
    # free memory at start-up): checkpoint the fewest decoder layers that keep a backward
    # pass's activations within the budget (the fewest whole layers, then the fewest
    # selective ones), none when the pass fits. Elsewhere (the CPU): every layer once a
    # backward pass holds checkpoint_min_tokens padded tokens; below that the recomputation
    # costs time and saves memory nobody needs. "selective": every layer selectively.
    activation_checkpointing: Checkpointing = "auto"
    checkpoint_min_tokens: int = 4_096
    activation_budget: int | None = None
    layer_bytes: LayerBytes | None = None
    # Bytes a pass may borrow on top of activation_budget now (memory.spare_activation_bytes:
    # the sampler's share while it lies free); None: nothing is borrowed.
    spare_activations: Callable[[], int] | None = None
    # (rows x positions x vocab) logits computed at once: 2^27 fp32 elements are 512 MiB,
    # 1,046 positions of a 128k vocabulary, the whole batch of a small-vocabulary model. A
    # chunk's backward holds ~20 bytes an element (bf16 and fp32 logits, log-softmax, their
    # gradients): 2.5 GiB, within the headroom the budgets keep (memory.HEADROOM). Half as
    # many chunks as 2^26 took: 8 adapters' ops of 4 x 512 tokens at the 8B shape launch
    # 1.09x one op's kernels, 1.16x at 2^26 (bench.mfu --count).
    logit_chunk_elements: int = 1 << 27
    # How a pass of several adapters' ops runs their LoRA: "blocks" (row_blocks.row_blocks:
    # two matmuls an adapter and layer), "stacked" (row_blocks.stacked_blocks: two matmuls a
    # layer over every adapter's columns) or "grouped" (grouped_lora.py: two grouped matmuls
    # a layer over each row's own adapter). None: the rule of lora_form_for.
    lora_form: LoraForm | None = None
    # Low-rank columns each token of this pass computes beyond its own adapter's rank (a
    # pass's stacked LoRA: for_pass); what the checkpointing plan adds per layer.
    extra_lora_columns: int = 0
    # Pack several datums into a row once one datum a row would be more than half padding
    # (None: never pack). Below it, packing saves less than it costs: its block-diagonal mask
    # takes attention off the kernels that need no mask, and it changes the batch's rounding.
    pack_above_padding: float | None = 0.5
    # Under auto, split a pass that would recompute layers into micro-batches that do not
    # (micro_batches.py); False: recompute in one pass (bench.mfu's baseline for the split).
    micro_batches: bool = True
    # Under auto, recompute selectively before whole layers; False: whole layers only
    # (bench.mfu's baseline for selective checkpointing).
    selective_layers: bool = True

    def recomputation(self, padded_tokens: int, backward: bool, layers: int) -> Recomputation:
        """Which of a pass's `layers` decoder layers recompute in backward: the first ones,
        whose recomputation comes after the later layers' intermediates are freed (the whole
        ones first, then the selective ones)."""
        if not backward:
            return Recomputation()
        fixed = set_recomputation(self.activation_checkpointing, layers)
        if fixed is not None:
            return fixed
        if self.activation_budget is not None and self.layer_bytes is not None:
            borrowed = self.spare_activations() if self.spare_activations is not None else 0
            per_layer = self.layer_bytes.with_columns(self.extra_lora_columns)
            return cheapest_recomputation(
                padded_tokens,
                layers,
                per_layer,
                self.activation_budget + borrowed,
                selective=self.selective_layers,
            )
        return Recomputation(whole=layers if padded_tokens >= self.checkpoint_min_tokens else 0)

    def lora_form_for(self, device: torch.device, *, groups: bool, stacks: bool) -> LoraForm:
        """The form a pass of several adapters takes: the plan's where it says and the pass
        allows (`groups`: grouped_lora.groups; a layer no grouped kernel takes on the device
        runs in row blocks inside the grouped pass; `stacks`: row_blocks.stacks), else by the
        device: grouped wherever it can (two kernels a layer
        whatever the adapters, no FLOPs beyond the rows' own ranks), stacked on CUDA (1.22x
        the blocks at the 8B shape, H200), the blocks otherwise."""
        allowed = {"grouped": groups, "stacked": stacks, "blocks": True}
        if self.lora_form is not None and allowed[self.lora_form]:
            return self.lora_form
        if groups:
            return "grouped"
        return "stacked" if stacks and device.type == "cuda" else "blocks"

    @classmethod
    def of(cls, config: EngineConfig) -> PassPlan:
        """The plan the engine's settings ask for (QT_ACTIVATION_CHECKPOINTING and friends),
        before the device's budget is known (budgeted)."""
        return cls(
            activation_checkpointing=config.activation_checkpointing,
            checkpoint_min_tokens=config.activation_checkpointing_tokens,
            logit_chunk_elements=config.logit_chunk_elements,
            pack_above_padding=config.pack_above_padding,
            lora_form=None if config.lora_form == "auto" else config.lora_form,
        )

    def for_pass(self, ranks: Sequence[int], stacked: bool) -> PassPlan:
        """The plan of one pass whose adapters have these LoRA ranks (each adapter once):
        stacked, every token computes them all, beyond its own adapter's."""
        columns = sum(ranks) - max(ranks) if stacked and ranks else 0
        return replace(self, extra_lora_columns=columns) if columns else self

    def packs(self, lengths: Sequence[int]) -> bool:
        return (
            self.pack_above_padding is not None
            and padding_fraction(lengths) > self.pack_above_padding
        )

    def chunk_positions(self, rows: int, vocab: int) -> int:
        return max(1, self.logit_chunk_elements // max(1, rows * vocab))


def budgeted(
    plan: PassPlan,
    budgets: Budgets | None,
    config: PretrainedConfig,
    dtype: torch.dtype,
    *,
    lora_copy: int,
    device: torch.device | None = None,
    cap: int | None = None,
) -> PassPlan:
    """The plan with the device's training budget (`budgets` from its free memory; None off
    CUDA, where the plan stays as it is): auto checkpointing then checkpoints the fewest layers
    that fit each pass, borrowing the sampler's share while it lies free on `device` (None:
    never; a worker group's ranks must plan alike, and what lies free differs between them),
    within `cap` bytes of it (QT_DEVICE_MEMORY_GIB); and the logits' chunks are at most what
    the headroom holds (memory.logit_chunk_cap). `lora_copy`: memory.lora_copy_bytes."""
    if budgets is None:
        return plan
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    spare = partial(spare_activation_bytes, device, budgets, cap) if device is not None else None
    return replace(
        plan,
        activation_budget=budgets.train_activation_bytes,
        layer_bytes=layer_bytes(config, dtype_bytes, lora_copy=lora_copy),
        spare_activations=spare,
        logit_chunk_elements=min(plan.logit_chunk_elements, logit_chunk_cap(budgets)),
    )


def causal_lm(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers causal LM under a PeftModel (its LoRA layers injected), or the model."""
    lm = model.get_base_model() if isinstance(model, PeftModel) else model
    # Every model a worker runs is loaded by base_model.load_base_model (from_pretrained);
    # peft and torch type what they hold as a plain Module.
    return cast(PreTrainedModel, lm)


def decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    """The causal LM's repeated decoder blocks (Llama, Qwen, Mistral, Gemma: `layers`;
    GPT-2 style: `h`); empty when the architecture names them otherwise."""
    decoder = causal_lm(model).get_decoder()
    for name in ("layers", "h"):
        blocks = getattr(decoder, name, None)
        if isinstance(blocks, torch.nn.ModuleList):
            return list(blocks)
    return []


def padded_targets(batch: RowBatch, targets: Sequence[np.ndarray]) -> torch.Tensor:
    """(rows, width): each datum's target tokens at its positions in `batch`, zeros elsewhere;
    laid out on the host and copied to the batch's device in one piece (a copy waits for the
    device: it goes before the forward is launched, not once per datum after it)."""
    padded = np.zeros(tuple(batch.ids.shape), dtype=np.int64)
    for (row, start), target in zip(batch.places, targets, strict=True):
        padded[row, start : start + len(target)] = target
    return torch.from_numpy(padded).to(batch.ids.device)


def scored_positions(batch: RowBatch, lengths: Sequence[int]) -> torch.Tensor | None:
    """The flat (row x width + position) index of every datum's scored positions, datum after
    datum, on the batch's device (copied before the forward is launched, as padded_targets);
    None when that is every position of every row in order (one datum a row, none padded)."""
    rows, width = batch.ids.shape
    in_order = all(place == (row, 0) for row, place in enumerate(batch.places))
    if in_order and len(lengths) == rows and all(n == width for n in lengths):
        return None
    index = np.concatenate(
        [
            np.arange(row * width + start, row * width + start + n, dtype=np.int64)
            for (row, start), n in zip(batch.places, lengths, strict=True)
        ]
        or [np.zeros(0, np.int64)]
    )
    return torch.from_numpy(index).to(batch.ids.device)


def target_logprobs(
    model: torch.nn.Module,
    batch: RowBatch,
    targets: torch.Tensor,
    scored: torch.Tensor | None,
    plan: PassPlan,
    images: RowImages | None = None,
) -> torch.Tensor:
    """log p(target | the datum's tokens <= i) at every scored position, datum after datum: a
    1-D fp32 tensor, `scored` (scored_positions) picking the positions from the padded
    batch, whose targets sit in `targets` (padded_targets). With `images`, the rows' image
    placeholders take their embeddings (a vision-language model's whole forward below its LM
    head, instead of its decoder alone).

    With grad enabled the result carries the graph to the LoRA weights; backward must run
    while the model's LoRA wrapping is still in place."""
    lm = causal_lm(model)
    backward = torch.is_grad_enabled()
    layers = decoder_layers(model)
    planned = plan.recomputation(batch.padded_tokens, backward, len(layers))
    whole, selective = layers[: planned.whole], layers[planned.whole :][: planned.selective]
    keep = selective_policy(lm.config, selective) if selective else None
    with checkpointed(whole), checkpointed(selective, keep):
        if images is not None:
            hidden = hidden_states(lm, batch.ids, batch.mask, images)
        else:
            hidden = lm.get_decoder()(
                input_ids=batch.ids,
                attention_mask=batch.mask,
                position_ids=batch.position_ids,
                use_cache=False,
            ).last_hidden_state
    flat = _chunked_logprobs(lm, hidden, targets, plan, recompute=backward).reshape(-1)
    return flat if scored is None else flat.index_select(0, scored)


def _chunked_logprobs(
    lm: PreTrainedModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    plan: PassPlan,
    *,
    recompute: bool,
) -> torch.Tensor:
    """(rows, width) log p(target) from (rows, width, hidden) states, a chunk of positions at a
    time through the unembedding; with `recompute`, each chunk's logits are freed after its
    forward and made again in backward."""
    head = lm.get_output_embeddings()
    vocab = int(head.weight.shape[0]) if hasattr(head, "weight") else 1
    softcap = getattr(lm.config, "final_logit_softcapping", None)
    step = plan.chunk_positions(hidden.shape[0], vocab)
    # One chunk's logits may exist at once: when the whole batch is one chunk, keeping its
    # logits for backward holds no more than that, and recomputing them would only cost time.
    recompute = recompute and step < hidden.shape[1]
    pieces = []
    for start in range(0, hidden.shape[1], step):
        # Contiguous: a strided slice of a wider batch would go through the unembedding as a
        # batched matmul reading its whole weight once a row (at the 8B shape, 36 GiB more a
        # pass of 4 x 512 tokens: bench.mfu --count); a whole batch is already.
        chunk = (hidden[:, start : start + step].contiguous(), targets[:, start : start + step])
        if recompute:
            pieces.append(checkpointed_call(_logprobs_of, head, softcap, *chunk))
        else:
            pieces.append(_logprobs_of(head, softcap, *chunk))
    if not pieces:
        return hidden.new_zeros((hidden.shape[0], 0), dtype=torch.float32)
    return torch.cat(pieces, dim=1)


def _logprobs_of(
    head: torch.nn.Module, softcap: float | None, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """log_softmax(head(hidden))[target], in fp32. torch's cross-entropy kernel, as the model's
    own loss uses: a batch that fits in one chunk gets the very numbers the whole-logits pass
    got, which keeps long runs equal to plain PEFT training to the last bit."""
    logits = head(hidden).float()
    if softcap:  # Gemma-2 style final logit soft-capping, as the model's own forward applies
        logits = torch.tanh(logits / softcap) * softcap
    flat = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return -flat.view(targets.shape)


def gemm_width(config: PretrainedConfig) -> int:
    """The narrowest reduction a decoder layer's own GEMMs run over: the hidden width, the
    attention heads' (o's input), the MLP's or an expert's (down's input). LoRA's B reduces over
    the rank alone, below it."""
    text = config.get_text_config()
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(text, "head_dim", 0) or (hidden // heads if heads else hidden))
    widths = [hidden, heads * head_dim or hidden]
    for key in ("intermediate_size", "moe_intermediate_size"):
        width = getattr(text, key, None)
        if isinstance(width, int) and width > 0:
            widths.append(width)
    return min(widths)


def _aten_ops(*names: str) -> tuple[Any, ...]:
    """The default overloads of the aten ops of these names this torch has."""
    return tuple(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


# Attention kernels whose outputs (and log-sum-exp) a selective layer keeps: their backward
# needs them, and remaking them is the layer's costliest work after its GEMMs.
_ATTENTION = _aten_ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
# Matrix products, each with the index of its operand whose last dimension is the reduction.
_GEMMS = {
    **dict.fromkeys(_aten_ops("mm", "bmm"), 0),
    **dict.fromkeys(_aten_ops("addmm", "baddbmm"), 1),
}
# Routed experts' grouped GEMMs (transformers' grouped_mm experts).
_GROUPED_GEMMS = dict.fromkeys(_aten_ops("_grouped_mm"), 0)


def keeps_wide_gemms(width: int, *, grouped: bool = True) -> KeepPolicy:
    """A selective layer's policy: keep attention's outputs and every GEMM's that reduces over
    `width` or more (gemm_width: the base projections, LoRA's A, and with `grouped` the
    experts' grouped GEMMs), make the rest again."""
    gemms = {**_GEMMS, **_GROUPED_GEMMS} if grouped else _GEMMS

    def policy(_ctx: Any, op: Any, *args: Any, **_kwargs: Any) -> CheckpointPolicy:
        if op in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        operand = gemms.get(op)
        if operand is not None and args[operand].shape[-1] >= width:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_policy(config: PretrainedConfig, layers: Sequence[torch.nn.Module]) -> KeepPolicy:
    """The policy of these selective layers: experts that add a bias (gpt-oss) add it into
    their grouped GEMM's output in place, which a kept output must never see (torch refuses
    the recomputation), so theirs are made again."""
    biased = any(getattr(m, "has_bias", False) for layer in layers for m in layer.modules())
    return keeps_wide_gemms(gemm_width(config), grouped=not biased)


@contextmanager
def checkpointed(
    layers: Sequence[torch.nn.Module], keep: KeepPolicy | None = None
) -> Iterator[None]:
    """Meanwhile each layer's forward runs under non-reentrant activation checkpointing (the
    instance attribute shadows the class's forward; the checkpoint calls the class's, so a
    recomputation in backward after this context is gone computes the same thing); with
    `keep`, selectively: the outputs it keeps are saved, the rest made again."""
    for layer in layers:
        forward = type(layer).forward.__get__(layer)
        layer.forward = partial(_checkpointed_forward, keep, forward)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _checkpointed_forward(keep: KeepPolicy | None, forward: Any, *args: Any, **kwargs: Any) -> Any:
    return _checkpoint(forward, args, kwargs, keep)


def checkpointed_call(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """function(*args, **kwargs) under torch's non-reentrant checkpoint (_checkpoint)."""
    return _checkpoint(function, args, kwargs, None)


def _checkpoint(
    function: Callable[..., T], args: Any, kwargs: dict[str, Any], keep: KeepPolicy | None
) -> T:
    """function(*args, **kwargs) under torch's non-reentrant checkpoint (selective with
    `keep`), whose saved-tensor hooks do not outlive a call that raises. Before torch 2.13 they
    did: checkpoint() left its generator suspended inside them, kept alive by the exception's
    traceback, so while a handler held an out-of-memory error, the next pass's tensors were
    saved for the failed pass's recomputation (on a GPU, the retried halves of a split pass
    then failed)."""
    context = (
        noop_context_fn if keep is None else partial(create_selective_checkpoint_contexts, keep)
    )
    try:
        return cast(
            T, checkpoint(function, *args, use_reentrant=False, context_fn=context, **kwargs)
        )
    except BaseException as exc:
        # Dropping the finished frames' locals frees that generator now, which pops its hooks
        # (and the failed call's tensors with them).
        traceback.clear_frames(exc.__traceback__)
        raise
