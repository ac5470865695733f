"""The fit planner: before a worker loads its base model, does everything it may hold fit?

Per rank, from the model's config: the base weights; the resident adapters (each trained one's
fp32 weights, gradients and AdamW moments, plus a frozen copy for sampling, since the sampler
cache holds as many checkpoints as there are resident adapters); the activations of one
training pass at the configured tokens under the checkpointing plan the worker would make
(memory.py's, within the activation budget it derives from what the weights leave); the
sampler's KV cache; and the headroom the worker keeps (memory.HEADROOM of what the weights
leave). The estimates are memory.py's; this module only adds them up, per rank.

The model is built on the meta device (no memory, no weights), so its parameters, experts
included, the linear layers LoRA adapts (adapters.target_modules, as the worker picks them) and
the stacked expert weights it adapts with the MLP (adapters.target_parameters: an A and a B of
the rank per expert) are the library's own, not a second description of each architecture.

Unset budgets are planned at their floor: a pass is split down to one op, never below, so it
must hold one datum of QT_MAX_TOKENS_PER_DATUM tokens; the sampler runs a sample that alone
exceeds its cache budget anyway, so the cache must hold one sample of a prompt and a completion
that long (both within the model's context). A budget set higher is planned as set.

Ranks are the GPUs a sharded group would use, split as tensor parallelism splits a model:
every weight matrix evenly (attention by heads, MLPs and experts along their width, embedding
and unembedding along the vocabulary), norms and biases whole on every rank, and key/value heads
never below one a rank (fewer KV heads than ranks are copied). Every rank sees every token of a
pass, so hidden-wide activations stay whole while MLP-wide ones split. A LoRA pair follows its
layer: a column-parallel layer (q, k, v, gate, up, unembedding) splits B and keeps A whole, a
row-parallel one (o, down) splits A and keeps B whole. A vision-language model's tower is
frozen and held whole on every rank; its activations (a few images' patches) are not planned.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import WorkerFitError
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.adapters import (
    stacked_experts,
    target_modules,
    target_parameters,
)
from queue_tinker.workers.model.families import GENERIC, Family, family_of
from queue_tinker.workers.model.memory import (
    HEADROOM,
    Checkpointing,
    LoraMatmuls,
    Recomputation,
    budgets_for,
    cache_bytes_per_token,
    cheapest_recomputation,
    layer_bytes,
    lora_copy_bytes,
    pass_bytes_per_token,
    set_recomputation,
)
from queue_tinker.workers.model.vision_language import is_vl

GIB = 1 << 30
# A trained adapter's parameter: its fp32 weight, its gradient and AdamW's two moments.
TRAINED_LORA_BYTES = 16
# A checkpoint loaded frozen for sampling (AdapterPool.sampler): its fp32 weights.
SAMPLER_LORA_BYTES = 4
KV_PROJECTIONS = frozenset({"k_proj", "v_proj"})
# The sharded groups one node offers, tried in this order when a plan does not fit.
RANK_CHOICES = (1, 2, 4, 8)
# FitSettings fields and their new values: a change the advice proposes (named QT_<FIELD>).
Changes = dict[str, Any]
# Resident adapters a worker keeps when QT_MAX_RESIDENT_ADAPTERS is unset: as many as fit, at
# most this many (and this many on the CPU, where there is no device memory to plan).
MOST_RESIDENT_ADAPTERS = 32


@dataclass(frozen=True)
class FitSettings:
    """The worker's settings that decide its memory (the QT_* settings of the same names)."""

    max_resident_adapters: int
    train_batch_tokens: int | None
    sample_cache_tokens: int | None
    max_tokens_per_datum: int
    activation_checkpointing: Checkpointing
    lora_matmul_dtype: LoraMatmuls = "auto"
    # The adapters planned for: a client may ask for another rank or fewer targets, but the
    # default LoRA config is what a create_model without them makes.
    lora: LoraConfig = field(default_factory=LoraConfig)

    @classmethod
    def of(cls, config: EngineConfig) -> FitSettings:
        """The engine's settings as the planner takes them (unset resident adapters: as many
        as fit, at most MOST_RESIDENT_ADAPTERS)."""
        return cls(
            max_resident_adapters=config.max_resident_adapters or MOST_RESIDENT_ADAPTERS,
            train_batch_tokens=config.train_batch_tokens,
            sample_cache_tokens=config.sample_cache_tokens,
            max_tokens_per_datum=config.max_tokens_per_datum,
            activation_checkpointing=config.activation_checkpointing,
            lora_matmul_dtype=config.lora_matmul_dtype,
        )


@dataclass(frozen=True)
class Demand:
    """FitSettings resolved for one model: the tokens a pass and the KV cache must hold, and
    where each number comes from (the explanation names it)."""

    settings: FitSettings
    pass_tokens: int
    pass_source: str
    kv_tokens: int
    kv_source: str


# Where a demand's tokens come from when its budget is unset or below one datum or sample.
ONE_DATUM = "one datum at QT_MAX_TOKENS_PER_DATUM"
ONE_SAMPLE = "one sample: a prompt and a completion at QT_MAX_TOKENS_PER_DATUM each"


def demand_of(settings: FitSettings, context_length: int) -> Demand:
    pass_tokens, pass_source = _at_least(
        settings.train_batch_tokens,
        "QT_TRAIN_BATCH_TOKENS",
        _floor(settings, 1, context_length),
        ONE_DATUM,
    )
    kv_tokens, kv_source = _at_least(
        settings.sample_cache_tokens,
        "QT_SAMPLE_CACHE_TOKENS",
        _floor(settings, 2, context_length),
        ONE_SAMPLE,
    )
    return Demand(settings, pass_tokens, pass_source, kv_tokens, kv_source)


def _floor(settings: FitSettings, sequences: int, context_length: int) -> int:
    """The tokens of one datum (1) or one sample's prompt and completion (2) at most."""
    return min(sequences * settings.max_tokens_per_datum, context_length)


def _at_least(budget: int | None, setting: str, floor: int, floor_source: str) -> tuple[int, str]:
    """A budget as set, or the floor one datum or sample sets (within the model's context),
    whichever is more: neither is ever split below that."""
    if budget is not None and budget >= floor:
        return budget, setting
    return floor, floor_source


@dataclass(frozen=True)
class ModelShape:
    """What the planner reads off the model built on the meta device."""

    parameters: tuple[tuple[str, tuple[int, ...]], ...]  # each distinct tensor (tied ones once)
    linears: tuple[tuple[str, int, int], ...]  # (name, in, out) of what LoRA may adapt
    layers: int
    kv_heads: int
    context_length: int
    # (name, experts, out, in) of stacked expert weights, stored (experts, out, in) as
    # Qwen3-MoE's and Mixtral's are in transformers 5.
    experts: tuple[tuple[str, int, int, int], ...] = ()
    tower: int = 0  # elements every rank holds whole, outside the language model (a vision tower)
    family: Family = GENERIC  # what LoRA adapts, and how a group would split it


def model_shape(config: PretrainedConfig) -> ModelShape:
    """The model's tensors and linear layers, built without memory (70B: ~0.3 s). A
    vision-language model's tower is frozen and held whole on every rank: its elements count
    as `tower`, and what the rest describes is its language model."""
    vision = is_vl(config)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(copy.deepcopy(config))
    text = config.get_text_config()
    heads = int(text.num_attention_heads)

    family = family_of(config)
    frozen = set(family.frozen)

    def in_tower(name: str) -> bool:
        return vision and bool(frozen.intersection(name.split(".")))

    return ModelShape(
        parameters=tuple(
            (name, tuple(p.shape)) for name, p in model.named_parameters() if not in_tower(name)
        ),
        linears=tuple(
            (name, module.in_features, module.out_features)
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not in_tower(name)
        ),
        layers=int(text.num_hidden_layers),
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        context_length=int(text.max_position_embeddings),
        experts=tuple((name, *p.shape) for name, p in stacked_experts(model)),
        tower=sum(p.numel() for name, p in model.named_parameters() if in_tower(name)),
        family=family,
    )


@dataclass(frozen=True)
class FitPlan:
    """Bytes each rank holds, part by part, and whether they fit its memory."""

    ranks: int
    rank_bytes: int
    weights: int
    adapters: int  # every resident adapter's trained state and sampler copy
    adapter_each: int
    activations: int
    kv_cache: int
    headroom: int
    layers: int
    recomputation: Recomputation
    targets: tuple[str, ...]  # the linear layers (and stacked experts) LoRA adapts
    demand: Demand
    remedies: tuple[str, ...] = ()  # changes that each alone would fit; none when it fits

    @property
    def needed(self) -> int:
        return self.weights + self.adapters + self.activations + self.kv_cache + self.headroom

    @property
    def fits(self) -> bool:
        return self.needed <= self.rank_bytes

    def explanation(self) -> str:
        """One paragraph: each part in GiB, whether they fit, and what would."""
        memory = f"{gib(self.rank_bytes)} GiB"
        if self.ranks == 1:
            head = f"A GPU of {memory} needs {gib(self.needed)} GiB"
        else:
            head = f"Each of {self.ranks} GPUs of {memory} needs {gib(self.needed)} GiB"
        head = f"{head}: {self._parts()}."
        if self.fits:
            return f"{head} It fits, {gib(self.rank_bytes - self.needed)} GiB to spare."
        over = f"{head} It does not fit: {gib(self.needed - self.rank_bytes)} GiB over."
        if not self.remedies:
            return (
                f"{over} No single change tried fits (up to {RANK_CHOICES[-1]} GPUs, every "
                f"layer checkpointed, fewer resident adapters, shorter passes, a smaller KV "
                f"cache): combine them, or use devices with more memory."
            )
        return f"{over} Any one of these fits: {'; '.join(self.remedies)}."

    def _parts(self) -> str:
        d, settings = self.demand, self.demand.settings
        targets = ", ".join(self.targets) or "no layer"
        return (
            f"weights {gib(self.weights)}, adapters {gib(self.adapters)} "
            f"({settings.max_resident_adapters} resident of rank {settings.lora.rank} on "
            f"{targets}, "
            f"{gib(self.adapter_each)} each: fp32 weights, gradients, AdamW moments and a "
            f"sampler copy), activations {gib(self.activations)} (a pass of {d.pass_tokens} "
            f"tokens from {d.pass_source}, {self.recomputation.described(self.layers)}), "
            f"KV cache {gib(self.kv_cache)} ({d.kv_tokens} tokens from "
            f"{d.kv_source}), headroom {gib(self.headroom)} ({HEADROOM:.0%} of what the "
            f"weights leave)"
        )


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def plan_fit(
    config: PretrainedConfig,
    dtype_bytes: int,
    ranks: int,
    rank_bytes: int,
    settings: FitSettings,
    shape: ModelShape | None = None,
    whole: frozenset[str] = frozenset(),
    weight_bytes: int | None = None,
) -> FitPlan:
    """The plan for `ranks` GPUs of `rank_bytes` each, with what would fit if it does not
    (a vision-language model's config plans its language model plus its vision tower).
    `whole`: layers every rank holds whole (a worker group keeps WHOLE_IN_GROUP so).
    `weight_bytes`: the base weights' bytes an element where not `dtype_bytes` (FP8: 1)."""
    shape = shape or model_shape(config)
    text = config.get_text_config()
    planner = _Planner(text, shape, dtype_bytes, rank_bytes, whole, weight_bytes)
    plan = planner.plan(ranks, demand_of(settings, planner.shape.context_length))
    if plan.fits:
        return plan
    return replace(plan, remedies=planner.remedies(plan))


# Beyond what a worker runs today, for the docs' tables of the largest models: a group over
# several nodes of NODE_GPUS (a group spans one node), and base weights in FP8.
NODE_GPUS = 8
NODE_CHOICES = (2, 4, 8, 16)
FP8_BYTES = 1
SMALLER_RANK = 8  # what clients of a model whose adapters do not fit at rank 32 may ask


def beyond_workers(
    config: PretrainedConfig,
    dtype_bytes: int,
    ranks: int,
    rank_bytes: int,
    settings: FitSettings,
    shape: ModelShape | None = None,
) -> tuple[str, ...]:
    """For a plan no setting makes fit: the first of each way beyond today's workers that
    would (FP8 base weights on these GPUs; more nodes in `dtype_bytes`; both), each with the
    fewest resident adapters and, if need be, the lower LoRA rank it needs."""
    shape = shape or model_shape(config)
    text = config.get_text_config()
    ways: list[str] = []
    tries = ((FP8_BYTES, (1,)), (dtype_bytes, NODE_CHOICES), (FP8_BYTES, NODE_CHOICES))
    for weight_bytes, node_counts in tries:
        for nodes in node_counts:
            gpus = nodes * NODE_GPUS if nodes > 1 else ranks
            planner = _Planner(text, shape, dtype_bytes, rank_bytes, weight_bytes=weight_bytes)
            found = _with_fewest(planner, gpus, settings)
            if found is None:
                continue
            where = "FP8 base weights" if weight_bytes == FP8_BYTES else "bf16 base weights"
            if nodes > 1:
                where = f"{where} on {gpus} GPUs ({nodes} nodes of {NODE_GPUS})"
            ways.append(f"{where}{found}")
            break
    return tuple(ways)


def _with_fewest(planner: _Planner, ranks: int, settings: FitSettings) -> str | None:
    """'' when the plan fits as it is, else the fewest changes (resident adapters, and then
    clients asking a lower LoRA rank or no MLP adapters) that make it fit, as text; None when
    those do not."""
    asks = (
        ("", settings.lora),
        (
            f", clients at LoRA rank {SMALLER_RANK}",
            settings.lora.model_copy(update={"rank": SMALLER_RANK}),
        ),
        (", clients with train_mlp=False", settings.lora.model_copy(update={"train_mlp": False})),
    )
    for asked, lora in asks:
        tried = replace(settings, lora=lora)
        plan = planner.plan(ranks, demand_of(tried, planner.shape.context_length))
        if plan.fits:
            changes = ""
        else:
            most = _fewer_adapters(plan).get("max_resident_adapters", 0)
            if most < 1:
                continue
            changes = f", QT_MAX_RESIDENT_ADAPTERS={most}"
        return changes + asked
    return None


def require_fit(
    config: PretrainedConfig,
    dtype_bytes: int,
    rank_bytes: int,
    settings: FitSettings,
    what: str,
    ranks: int = 1,
) -> FitPlan:
    """The plan for one device of `rank_bytes` (each of a group's `ranks`); WorkerFitError
    naming `what` (the model and its device) and the plan's numbers if it does not fit."""
    plan = plan_fit(config, dtype_bytes, ranks, rank_bytes, settings, whole=_whole(ranks))
    if not plan.fits:
        raise WorkerFitError(f"{what} does not fit: {plan.explanation()}")
    return plan


def fit_resident_adapters(
    config: PretrainedConfig,
    dtype_bytes: int,
    rank_bytes: int,
    settings: FitSettings,
    what: str,
    ranks: int = 1,
) -> FitPlan:
    """The plan for one device of `rank_bytes` (each of a group's `ranks`) with as many
    resident adapters as it holds, at most settings.max_resident_adapters; WorkerFitError
    when not even one fits."""
    whole = _whole(ranks)
    plan = plan_fit(config, dtype_bytes, ranks, rank_bytes, settings, whole=whole)
    if plan.fits:
        return plan
    most = _fewer_adapters(plan).get("max_resident_adapters", 0)
    if most < 1:
        raise WorkerFitError(f"{what} does not fit: {plan.explanation()}")
    fewer = plan_fit(
        config,
        dtype_bytes,
        ranks,
        rank_bytes,
        replace(settings, max_resident_adapters=int(most)),
        whole=whole,
    )
    if not fewer.fits:  # the other parts do not depend on the adapters; kept as a guard
        raise WorkerFitError(f"{what} does not fit: {fewer.explanation()}")
    return fewer


# A worker group's tensor parallelism (tensor_parallel.py) keeps the embedding and the
# unembedding whole on every rank.
WHOLE_IN_GROUP = frozenset({"embed_tokens", "lm_head"})


def _whole(ranks: int) -> frozenset[str]:
    return WHOLE_IN_GROUP if ranks > 1 else frozenset()


@dataclass(frozen=True)
class _Planner:
    config: PretrainedConfig
    shape: ModelShape
    dtype_bytes: int
    rank_bytes: int
    whole: frozenset[str] = frozenset()
    weight_bytes: int | None = None  # the base weights' bytes an element, if not dtype_bytes

    def plan(self, ranks: int, demand: Demand) -> FitPlan:
        shape, dtype_bytes = self.shape, self.dtype_bytes
        linears = {name.rsplit(".", 1)[-1] for name, _, _ in shape.linears}
        settings = demand.settings
        experts = {_expert_name(name) for name, *_ in shape.experts}
        targets = (
            *target_modules(linears, settings.lora, shape.family),
            *target_parameters(experts, settings.lora, shape.family),
        )
        weights = _weight_elements(shape, ranks, self.whole) * (self.weight_bytes or dtype_bytes)
        lora = _lora_params(shape, set(targets), settings.lora.rank, ranks, self.whole)
        lora += _expert_lora_params(shape, set(targets), settings.lora.rank, ranks)
        adapter_each = lora * (TRAINED_LORA_BYTES + SAMPLER_LORA_BYTES)
        rank_config = self.rank_config(ranks)
        left = max(0, self.rank_bytes - weights)  # what the worker's budgets are sized from
        recomputation = self.recomputation(rank_config, left, demand)
        return FitPlan(
            ranks=ranks,
            rank_bytes=self.rank_bytes,
            weights=weights,
            adapters=settings.max_resident_adapters * adapter_each,
            adapter_each=adapter_each,
            activations=demand.pass_tokens * self.pass_bytes(rank_config, recomputation, settings),
            kv_cache=int(demand.kv_tokens * cache_bytes_per_token(rank_config, dtype_bytes)),
            headroom=int(left * HEADROOM),
            layers=shape.layers,
            recomputation=recomputation,
            targets=targets,
            demand=demand,
        )

    def rank_config(self, ranks: int) -> PretrainedConfig:
        """The config as one rank's share looks to memory.py's estimates: the MLP's width and
        the KV heads split, the hidden width whole."""
        shard = copy.copy(self.config)
        if ranks > 1:
            for key in ("intermediate_size", "moe_intermediate_size"):
                width = getattr(self.config, key, None)
                if width:
                    setattr(shard, key, math.ceil(int(width) / ranks))
            shard.num_key_value_heads = math.ceil(self.shape.kv_heads / ranks)
        return shard

    def lora_copy(self, settings: FitSettings) -> int:
        return lora_copy_bytes(self.dtype_bytes, settings.lora_matmul_dtype)

    def pass_bytes(
        self, rank_config: PretrainedConfig, recomputation: Recomputation, settings: FitSettings
    ) -> int:
        per_layer = layer_bytes(rank_config, self.dtype_bytes, lora_copy=self.lora_copy(settings))
        return pass_bytes_per_token(self.shape.layers, recomputation, per_layer)

    def recomputation(
        self, rank_config: PretrainedConfig, left: int, demand: Demand
    ) -> Recomputation:
        """The worker's plan (training/model_pass.PassPlan) for a backward pass of the
        demand's tokens: under auto, the fewest whole layers, then selective ones, within the
        activation budget it derives from the memory the weights leave."""
        layers = self.shape.layers
        fixed = set_recomputation(demand.settings.activation_checkpointing, layers)
        if fixed is not None:
            return fixed
        lora_copy = self.lora_copy(demand.settings)
        budget = budgets_for(
            rank_config, left, self.dtype_bytes, checkpointing=True, lora_copy=lora_copy
        ).train_activation_bytes
        per_layer = layer_bytes(rank_config, self.dtype_bytes, lora_copy=lora_copy)
        return cheapest_recomputation(demand.pass_tokens, layers, per_layer, budget)

    # --- what would fit instead -----------------------------------------------------------
    def fits(self, ranks: int, settings: FitSettings) -> bool:
        return self.plan(ranks, demand_of(settings, self.shape.context_length)).fits

    def remedies(self, plan: FitPlan) -> tuple[str, ...]:
        """Changes of the settings (or of the GPUs) that each alone make the plan fit."""
        settings = plan.demand.settings
        ranks = next((r for r in RANK_CHOICES if r > plan.ranks and self.fits(r, settings)), None)
        found = (
            f"{ranks} GPUs of this size as one tensor-parallel group" if ranks else None,
            self.checked(plan, {"activation_checkpointing": "on"}),
            self.checked(plan, _fewer_adapters(plan)),
            self.checked(plan, self.shorter_passes(plan)),
            self.checked(plan, self.smaller_cache(plan)),
        )
        return tuple(change for change in found if change)

    def checked(self, plan: FitPlan, changes: Changes) -> str | None:
        """The changes as QT_* settings if they make the plan fit, with every layer
        checkpointed as well if they need that; else None."""
        settings = plan.demand.settings
        if not changes or all(getattr(settings, k) == v for k, v in changes.items()):
            return None
        text = " and ".join(f"QT_{k.upper()}={v}" for k, v in changes.items())
        if self.fits(plan.ranks, replace(settings, **changes)):
            return text
        every_layer = {**changes, "activation_checkpointing": "on"}
        if self.fits(plan.ranks, replace(settings, **every_layer)):
            return f"{text} with QT_ACTIVATION_CHECKPOINTING=on"
        return None

    def shorter_passes(self, plan: FitPlan) -> Changes:
        """The most tokens a pass may hold at the least activation memory a token (every layer
        checkpointed, selectively under selective, none under off): the budget, and the datums, cut
        to it."""
        fixed = set_recomputation(plan.demand.settings.activation_checkpointing, plan.layers)
        fewest = Recomputation(whole=plan.layers) if fixed is None else fixed
        per_token = self.pass_bytes(self.rank_config(plan.ranks), fewest, plan.demand.settings)
        most = _room(plan, plan.activations) // per_token
        return self.cut(plan.demand.settings, "train_batch_tokens", most, 1)

    def smaller_cache(self, plan: FitPlan) -> Changes:
        per_token = plan.kv_cache // max(1, plan.demand.kv_tokens)
        most = _room(plan, plan.kv_cache) // max(1, per_token)
        return self.cut(plan.demand.settings, "sample_cache_tokens", most, 2)

    def cut(self, settings: FitSettings, budget: str, most: int, sequences: int) -> Changes:
        """The changes that hold a budget to `most` tokens: the budget itself where it is set
        above, and QT_MAX_TOKENS_PER_DATUM where one datum (or a sample's `sequences`) would
        still exceed it. None possible below one token a sequence."""
        if most < sequences:
            return {}
        changes: Changes = {}
        set_to = getattr(settings, budget)
        if set_to is not None and set_to > most:
            changes[budget] = most
        if _floor(settings, sequences, self.shape.context_length) > most:
            changes["max_tokens_per_datum"] = most // sequences
        return changes


def _split(layer: str, size: int, ranks: int, kv_heads: int) -> int:
    """What one rank holds of `size` elements that a layer splits across ranks."""
    if layer in KV_PROJECTIONS:
        return size // kv_heads * math.ceil(kv_heads / ranks)
    return math.ceil(size / ranks)


def _weight_elements(shape: ModelShape, ranks: int, whole: frozenset[str] = frozenset()) -> int:
    """Every tensor's elements on one rank: matrices split (but the `whole` layers'), vectors
    (norms, biases) whole, and what lies outside the language model (a vision tower) whole."""
    total = shape.tower
    for name, dims in shape.parameters:
        numel = math.prod(dims)
        layer = name.rsplit(".", 2)[-2]  # model.layers.0.self_attn.k_proj.weight: k_proj
        kept = len(dims) <= 1 or layer in whole
        total += numel if kept else _split(layer, numel, ranks, shape.kv_heads)
    return total


def _lora_params(
    shape: ModelShape, targets: set[str], rank: int, ranks: int, whole: frozenset[str] = frozenset()
) -> int:
    """One adapter's parameters on one rank: A (rank x in) and B (out x rank) of each target."""
    total = 0
    for name, in_features, out_features in shape.linears:
        layer = name.rsplit(".", 1)[-1]
        if layer not in targets:
            continue
        if layer in whole:
            total += rank * (in_features + out_features)
        elif layer in shape.family.tensor_parallel.row:
            total += rank * math.ceil(in_features / ranks) + rank * out_features
        else:
            total += rank * in_features + rank * _split(layer, out_features, ranks, shape.kv_heads)
    return total


def _expert_name(name: str) -> str:
    """model.layers.0.mlp.experts.down_proj: experts.down_proj (a target_parameters name)."""
    return ".".join(name.rsplit(".", 2)[-2:])


def _expert_lora_params(shape: ModelShape, targets: set[str], rank: int, ranks: int) -> int:
    """One adapter's parameters on the stacked experts on one rank: per expert an A (rank x in)
    and a B (out x rank), split with the experts' width as a linear layer's pair is."""
    total = 0
    for name, experts, out_features, in_features in shape.experts:
        short = _expert_name(name)
        if short not in targets:
            continue
        if short.rsplit(".", 1)[-1] in shape.family.tensor_parallel.row:
            total += experts * rank * (math.ceil(in_features / ranks) + out_features)
        else:
            total += experts * rank * (in_features + math.ceil(out_features / ranks))
    return total


def _room(plan: FitPlan, part: int) -> int:
    """What the rank leaves for one part once the others are in."""
    return plan.rank_bytes - (plan.needed - part)


def _fewer_adapters(plan: FitPlan) -> Changes:
    """The most resident adapters the rank holds beside the other parts, if one fits."""
    most = _room(plan, plan.adapters) // max(1, plan.adapter_each)
    return {"max_resident_adapters": most} if most >= 1 else {}
