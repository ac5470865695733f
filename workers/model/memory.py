"""Device memory: what a worker's passes may hold, and telling an out-of-memory failure apart.

On CUDA, the tokens of one shared training pass and the sequences and KV-cache tokens of one
sampling batch are derived from the device memory free once the base model is loaded (unless
the deployment set them); on the CPU the settings' defaults stand. The estimates are
deliberately rough: a pass that does not fit anyway is split and retried
(training/rounds.py), so a budget only has to be right often, not always.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from transformers import PretrainedConfig

# What a worker keeps free for allocator fragmentation, the optimizer's temporaries and the
# adapters it has yet to load.
HEADROOM = 0.2
# Of the rest: training passes and the sampler's KV cache run one at a time, but the sampler's
# cache may live across quanta while training ops run between them.
TRAIN_SHARE = 0.6
SAMPLE_SHARE = 0.3
# The sequence length the sampler's row cap is sized for (prompt + completion); longer samples
# are held to the cache budget by admission (cache_budget.py), so fewer of them run at once.
SAMPLE_CONTEXT = 4_096
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"
# Bytes an element of a logits chunk holds while its backward runs (model_pass.py): its bf16
# and fp32 logits, the log-softmax and their gradients. The activation budget does not count
# the chunk: it lives in the headroom beside it (logit_chunk_cap).
LOGIT_BYTES_PER_ELEMENT = 20
# The smallest chunk the cap leaves: 2^24 elements, 131 positions of a 128k vocabulary.
FEWEST_LOGIT_ELEMENTS = 1 << 24

# QT_LORA_MATMUL_DTYPE: auto runs LoRA's matmuls in the base's dtype, fp32 in the adapters'.
LoraMatmuls = Literal["auto", "fp32"]

# QT_ACTIVATION_CHECKPOINTING: how a backward pass keeps its decoder layers' activations.
Checkpointing = Literal["auto", "on", "selective", "off"]
CHECKPOINTING_MODES: tuple[Checkpointing, ...] = ("auto", "on", "selective", "off")


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator's (a plain RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and CPU_OUT_OF_MEMORY in str(exc)
    )


def release_cached_memory(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks back before a retry."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Budgets:
    train_batch_tokens: int
    sample_batch_sequences: int
    sample_cache_tokens: int  # KV-cache tokens (rows x columns) of the sampler's batch
    # Activation bytes a training pass may keep for backward: what train_batch_tokens is
    # sized from, and what the checkpointing plan fits each pass into.
    train_activation_bytes: int
    # The sampler's share in bytes, and the headroom kept beside both: a pass borrows the
    # sampler's share while it lies free (spare_activation_bytes).
    sample_cache_bytes: int = 0
    headroom_bytes: int = 0


# The linear layers of a Llama-class decoder layer, each with its LoRA: q, k, v, o, gate, up,
# down.
LINEARS_PER_LAYER = 7


@dataclass(frozen=True)
class LayerBytes:
    """Activation bytes one token of a backward pass keeps in one decoder layer."""

    kept: int  # the layer run plainly: its intermediates
    checkpointed: int  # the layer checkpointed: its input alone (made again in backward)
    # The layer checkpointed selectively: its input and its wide GEMMs' and attention's
    # outputs, the elementwise work between them (norms, RoPE, SwiGLU, LoRA's B) made again.
    selective: int = 0
    # Each further column of LoRA's low-rank product (x·Aᵀ, which every LoRA layer keeps for
    # B's gradient) a token keeps: `kept` counts its own adapter's; a pass whose adapters'
    # LoRA is stacked computes every adapter's columns for every token (row_blocks.py).
    low_rank_column: int = 0

    def with_columns(self, columns: int) -> LayerBytes:
        """A layer whose tokens keep `columns` more low-rank columns each (a selectively
        checkpointed layer keeps them too: x·Aᵀ is a GEMM over the hidden width)."""
        more = columns * self.low_rank_column
        return replace(self, kept=self.kept + more, selective=self.selective + more)


@dataclass(frozen=True, order=True)
class Recomputation:
    """Which decoder layers of a backward pass recompute in backward: the first `whole` ones
    entirely (their input kept), the next `selective` ones their elementwise work alone; the
    rest run plainly. Ordered by cost: a whole layer recomputes its GEMMs and attention (a
    forward's work), a selective one its norms, RoPE and SwiGLU (a few percent of it)."""

    whole: int = 0
    selective: int = 0

    def __bool__(self) -> bool:
        return bool(self.whole or self.selective)

    def described(self, layers: int) -> str:
        """ "k of L layers checkpointed", "... selectively" or "..., s more selectively"."""
        if not self.selective:
            return f"{self.whole} of {layers} layers checkpointed"
        if not self.whole:
            return f"{self.selective} of {layers} layers checkpointed selectively"
        return f"{self.whole} of {layers} layers checkpointed, {self.selective} more selectively"


def lora_compute_dtype(base: torch.dtype, matmuls: LoraMatmuls) -> torch.dtype | None:
    """The dtype LoRA's matmuls run in: under auto the base's, where it is narrower than the
    adapters' fp32 (bf16 on CUDA); None: the adapters' own."""
    return base if matmuls == "auto" and base != torch.float32 else None


def lora_copy_bytes(dtype_bytes: int, matmuls: LoraMatmuls) -> int:
    """Bytes per element of the copy of its input a LoRA layer keeps for its weight gradient:
    an fp32 copy where its matmuls run in fp32 over a narrower base; none where they run in
    the base's dtype (it keeps the tensor the base layer keeps) or the base is fp32."""
    return 4 if matmuls == "fp32" and dtype_bytes != 4 else 0


def layer_bytes(config: PretrainedConfig, dtype_bytes: int, *, lora_copy: int) -> LayerBytes:
    """A layer's intermediates: attention projections, MLP up/gate/act and norms (~10 hidden +
    4 MLP widths in the base dtype), plus the copies of its inputs that LoRA keeps for its
    weight gradients, `lora_copy` bytes an element (q/k/v/o and gate/up take hidden-wide
    inputs, down an MLP-wide one). Measured on an H100 at the Llama-3.1-8B shape with fp32
    copies: 0.88x this estimate (docs/benchmarks.md). Selectively checkpointed it keeps its
    input, q, k, v, attention's output (and its fp32 log-sum-exp a head), o, gate, up and down:
    5 hidden + 2 KV + 2 MLP widths, whatever LoRA's matmul dtype (the copies are remade)."""
    hidden = int(config.hidden_size)
    mlp = mlp_width(config)
    kept = (10 * hidden + 4 * mlp) * dtype_bytes + (6 * hidden + mlp) * lora_copy
    low_rank = LINEARS_PER_LAYER * (lora_copy or dtype_bytes)  # in LoRA's matmul dtype
    kv = _token_layer_bytes(config, dtype_bytes) // 2
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    selective = (5 * hidden + 2 * mlp) * dtype_bytes + 2 * kv + 4 * heads
    return LayerBytes(
        kept=kept,
        checkpointed=hidden * dtype_bytes,
        selective=min(selective, kept),
        low_rank_column=low_rank,
    )


def mlp_width(config: PretrainedConfig) -> int:
    """The MLP width one token's activations span: a sparse layer's experts a token runs
    times their width (Qwen-style MoE configs: num_experts_per_tok x moe_intermediate_size),
    else the dense MLP's."""
    experts = getattr(config, "num_experts_per_tok", None)
    width = getattr(config, "moe_intermediate_size", None)
    if experts and width:
        return int(experts) * int(width)
    return int(getattr(config, "intermediate_size", 4 * int(config.hidden_size)))


def set_recomputation(mode: Checkpointing, layers: int) -> Recomputation | None:
    """What a setting other than auto fixes for every backward pass of `layers` decoder layers
    (off: none, on: every layer whole, selective: every layer selectively); None under auto,
    which plans each pass."""
    fixed = {
        "off": Recomputation(),
        "on": Recomputation(whole=layers),
        "selective": Recomputation(selective=layers),
    }
    return fixed.get(mode)


def pass_bytes_per_token(layers: int, recomputation: Recomputation, per_layer: LayerBytes) -> int:
    """Activation bytes one token of a backward pass keeps at its peak with `recomputation`
    of its `layers` decoder layers: the whole layers' inputs, plus the larger of what the
    others keep when backward starts (the plain layers' intermediates, the selective ones'
    GEMM outputs) and what it holds while it recomputes a layer (that layer's intermediates
    made again beside the earlier selective layers' outputs, the later layers freed by then:
    backward meets the plain layers first, then the selective ones, then the whole ones)."""
    whole, selective = recomputation.whole, recomputation.selective
    plain = layers - whole - selective
    at_start = plain * per_layer.kept + selective * per_layer.selective
    recomputing = per_layer.kept + max(0, selective - 1) * per_layer.selective
    return max(at_start, recomputing if recomputation else 0) + whole * per_layer.checkpointed


def train_bytes_per_token(
    config: PretrainedConfig, dtype_bytes: int, checkpointing: bool, *, lora_copy: int
) -> int:
    """Activation bytes one token of a backward pass keeps: every layer checkpointed, or
    none."""
    layers = int(config.num_hidden_layers)
    per_layer = layer_bytes(config, dtype_bytes, lora_copy=lora_copy)
    whole = Recomputation(whole=layers if checkpointing else 0)
    return pass_bytes_per_token(layers, whole, per_layer)


def cheapest_recomputation(
    tokens: int, layers: int, per_layer: LayerBytes, budget: int, *, selective: bool = True
) -> Recomputation:
    """The cheapest recomputation that keeps a backward pass of `tokens` padded tokens within
    `budget` bytes of activations: the fewest whole layers, then the fewest selective ones
    (none without `selective`); nothing when the pass fits as it is, every layer whole when
    even that does not fit (the pass is then split if it runs out of memory)."""
    room = budget // max(1, tokens)  # tokens x bytes <= budget
    for whole in range(layers + 1):
        part = _fewest_selective(layers, whole, per_layer, room) if selective else 0
        if part is not None:
            planned = Recomputation(whole=whole, selective=part)
            if pass_bytes_per_token(layers, planned, per_layer) <= room:
                return planned
    return Recomputation(whole=layers)


def _fewest_selective(layers: int, whole: int, per_layer: LayerBytes, room: int) -> int | None:
    """The fewest selective layers beside `whole` whole ones that bring what the pass keeps
    when backward starts within a token's `room` bytes; None: not even all of them. More than
    that only adds to what it holds while recomputing, so the caller checks this count alone."""
    rest = layers - whole
    excess = rest * per_layer.kept + whole * per_layer.checkpointed - room
    if excess <= 0:
        return 0
    saved = per_layer.kept - per_layer.selective  # a layer made selective sheds this much
    fewest = -(-excess // saved) if saved > 0 else rest + 1
    return fewest if fewest <= rest else None


def attention_kinds(config: PretrainedConfig) -> list[str]:
    """Each decoder layer's attention as its cache holds it: the config's `layer_types` where
    it has them ("full_attention", "sliding_attention", "linear_attention", ...), else full
    attention in every layer."""
    layers = int(config.num_hidden_layers)
    kinds = getattr(config, "layer_types", None)
    return list(kinds)[:layers] if kinds else ["full_attention"] * layers


def kv_bytes_per_token(config: PretrainedConfig, dtype_bytes: int) -> int:
    """The cache bytes one more token adds to a row: the keys and values of every layer whose
    cache grows a column a token (full attention; a sliding window's and a linear-attention
    layer's do not: row_state_bytes). Multi-head latent attention (DeepSeek-V3, Kimi-K2: a
    `kv_lora_rank`) is counted as transformers' cache holds it: the compressed latent and the
    RoPE key, one of each a token and layer whatever the heads (so a tensor-parallel rank
    holds it whole)."""
    growing = sum(kind == "full_attention" for kind in attention_kinds(config))
    return max(1, growing * _token_layer_bytes(config, dtype_bytes))


def row_state_bytes(config: PretrainedConfig, dtype_bytes: int) -> int:
    """The cache bytes a row holds whatever its length, once past a sliding window: each
    sliding-window layer's last `sliding_window - 1` tokens (gpt-oss's), each linear-attention
    layer's convolution state (its inputs' last kernel columns) and recurrent state, which the
    gated delta rule keeps in fp32 (Qwen3.5's)."""
    kinds = attention_kinds(config)
    sliding = sum(kind == "sliding_attention" for kind in kinds)
    window = int(getattr(config, "sliding_window", None) or 0)
    total = sliding * max(0, window - 1) * _token_layer_bytes(config, dtype_bytes)
    # "linear_attention", or one named by its recurrence ("linear_attention_gated_delta_net").
    linear = sum(kind.startswith("linear_attention") for kind in kinds)
    if linear:
        key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        channels = 2 * key_heads * key_dim + value_heads * value_dim
        conv = channels * int(config.linear_conv_kernel_dim) * dtype_bytes
        recurrent = value_heads * key_dim * value_dim * 4
        total += linear * (conv + recurrent)
    return total


def cache_bytes_per_token(config: PretrainedConfig, dtype_bytes: int) -> float:
    """What a sampler's cache token costs for rows of SAMPLE_CONTEXT tokens: a token's bytes
    and its share of its row's fixed state (row_state_bytes), as budgets are planned."""
    per_row = row_state_bytes(config, dtype_bytes) / SAMPLE_CONTEXT
    return kv_bytes_per_token(config, dtype_bytes) + per_row


def _token_layer_bytes(config: PretrainedConfig, dtype_bytes: int) -> int:
    """One token's keys and values in one attention layer."""
    if getattr(config, "kv_lora_rank", None):
        return (int(config.kv_lora_rank) + int(config.qk_rope_head_dim)) * dtype_bytes
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * kv_heads * head_dim * dtype_bytes


def budgets_for(
    config: PretrainedConfig,
    free_bytes: int,
    dtype_bytes: int,
    *,
    checkpointing: bool,
    lora_copy: int,
) -> Budgets:
    """Budgets for a device with `free_bytes` free after the base model is loaded."""
    usable = free_bytes * (1 - HEADROOM)
    activations = int(usable * TRAIN_SHARE)
    per_token = train_bytes_per_token(config, dtype_bytes, checkpointing, lora_copy=lora_copy)
    train = activations // per_token
    cache_tokens = int(usable * SAMPLE_SHARE // cache_bytes_per_token(config, dtype_bytes))
    return Budgets(
        train_batch_tokens=max(1, train),
        sample_batch_sequences=max(1, cache_tokens // SAMPLE_CONTEXT),
        sample_cache_tokens=max(1, cache_tokens),
        train_activation_bytes=activations,
        sample_cache_bytes=int(usable * SAMPLE_SHARE),
        headroom_bytes=int(free_bytes * HEADROOM),
    )


def logit_chunk_cap(budgets: Budgets) -> int:
    """The most logits elements a chunk may hold on a device with these budgets: what its
    headroom holds at LOGIT_BYTES_PER_ELEMENT (an 80 GiB card at the 8B shape: ~12 GiB, far
    above the default; a 24 GiB one: ~1.6 GiB, about 2^26), at least FEWEST_LOGIT_ELEMENTS."""
    return max(FEWEST_LOGIT_ELEMENTS, budgets.headroom_bytes // LOGIT_BYTES_PER_ELEMENT)


def memory_cap(gib: float | None) -> int | None:
    """QT_DEVICE_MEMORY_GIB in bytes."""
    return None if gib is None else int(gib * (1 << 30))


def device_memory(device: torch.device, cap: int | None = None) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device as a worker may use it: with a `cap`
    (QT_DEVICE_MEMORY_GIB) the total is at most the cap, and free at most what the cap leaves
    beside what this process's allocator holds already. Every reading of the device's memory
    goes through here, so the fit check, the budgets and a pass's borrowing see one size."""
    free, total = torch.cuda.mem_get_info(device)
    if cap is None or cap >= total:
        return free, total
    return max(0, min(free, cap - torch.cuda.memory_reserved(device))), cap


def hold_to(device: torch.device, cap: int | None) -> None:
    """Keep torch's allocator within `cap` bytes of the device (a larger allocation raises
    torch.OutOfMemoryError, as on a card of that size); nothing without a cap or off CUDA."""
    if cap is None or device.type != "cuda":
        return
    _free, total = torch.cuda.mem_get_info(device)
    if cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total, device)


def spare_activation_bytes(device: torch.device, budgets: Budgets, cap: int | None = None) -> int:
    """Bytes of the sampler's share a training pass may keep for backward on top of its own
    budget now: what lies unused on the device (torch's cached blocks included) past that
    budget and the headroom, at most the sampler's share. While no sample runs (its KV cache
    freed) a pass checkpoints fewer layers; while one does, none is borrowed; a pass never
    grows past the envelope the budgets were planned in."""
    free, _total = device_memory(device, cap)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    spare = free + cached - budgets.train_activation_bytes - budgets.headroom_bytes
    return max(0, min(budgets.sample_cache_bytes, spare))


def device_budgets(
    config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    checkpointing: bool,
    lora_copy: int,
    cap: int | None = None,
) -> Budgets | None:
    """Budgets from the device's free memory now (within `cap`: device_memory); None off
    CUDA."""
    if device.type != "cuda":
        return None
    free, _total = device_memory(device, cap)
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    return budgets_for(config, free, dtype_bytes, checkpointing=checkpointing, lora_copy=lora_copy)
