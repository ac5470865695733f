"""The fit planner (workers/model/fit.py): each part's bytes against a hand count on a tiny
config, experts counted whole, tensor-parallel shares, the advice it gives, the refusal, and
every row of docs/operations.md's table against a fresh plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from procs import REPO
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DynamicCache,
    LlamaConfig,
    Qwen3MoeConfig,
)

from bench import fit_table
from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import ErrorCategory, WorkerFitError
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.base_model import cache_keyword, load_base_model
from queue_tinker.workers.model.fit import (
    WHOLE_IN_GROUP,
    FitPlan,
    FitSettings,
    fit_resident_adapters,
    model_shape,
    plan_fit,
    require_fit,
)
from queue_tinker.workers.model.memory import (
    Recomputation,
    kv_bytes_per_token,
    row_state_bytes,
)
from queue_tinker.workers.sampling.kv_cache import held_bytes

GIB = 1 << 30
MIB = 1 << 20
TINY = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # head_dim 16
    vocab_size=100,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
TINY_SETTINGS = FitSettings(
    max_resident_adapters=3,
    train_batch_tokens=100,
    sample_cache_tokens=None,
    max_tokens_per_datum=64,
    activation_checkpointing="on",
    lora_matmul_dtype="fp32",  # the hand counts below include LoRA's fp32 input copies
    lora=LoraConfig(rank=8),
)
# Per layer: q 64x64, k and v 32x64, o 64x64, gate/up/down 128x64, two norms of 64.
TINY_LAYER = 4096 + 2 * 2048 + 4096 + 3 * 8192 + 2 * 64
TINY_PARAMS = 100 * 64 + 100 * 64 + 2 * TINY_LAYER + 64  # embedding, lm_head, layers, norm


def test_each_part_of_a_tiny_plan_is_its_hand_count() -> None:
    """bf16 weights, adapters at 20 bytes a LoRA parameter, a checkpointed pass of the set 100
    tokens, the KV cache of one sample (64 + 64 tokens), 20% of what the weights leave."""
    plan = plan_fit(TINY, 2, 1, 8 * MIB, TINY_SETTINGS)
    assert TINY_PARAMS == 86_848
    assert plan.weights == 2 * TINY_PARAMS
    # Rank 8: q 8x(64+64), k and v 8x(64+32), o 8x(64+64), gate/up/down 8x(64+128) a layer;
    # lm_head 8x(64+100). fp32 weight, gradient, two moments (16) and a sampler copy (4).
    lora = 2 * (1024 + 2 * 768 + 1024 + 3 * 1536) + 8 * (64 + 100)
    assert lora == 17_696
    assert plan.adapter_each == 20 * lora
    assert plan.adapters == 3 * 20 * lora
    assert plan.targets == (
        "down_proj",
        "gate_proj",
        "k_proj",
        "lm_head",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    )
    # A layer's intermediates: (10 x 64 + 4 x 128) x 2 bytes + (6 x 64 + 128) x 4 fp32 bytes;
    # checkpointed, its 64-wide input. Both layers checkpointed: both inputs plus one layer
    # recomputed in backward.
    kept, checkpointed = (10 * 64 + 4 * 128) * 2 + (6 * 64 + 128) * 4, 64 * 2
    assert (kept, checkpointed) == (4352, 128)
    assert (plan.recomputation, plan.layers) == (Recomputation(whole=2), 2)
    assert plan.activations == 100 * (kept + 2 * checkpointed)
    # LoRA's matmuls in the base's bf16 (the default) keep no fp32 copy of their inputs.
    bf16_lora = plan_fit(TINY, 2, 1, 8 * MIB, replace(TINY_SETTINGS, lora_matmul_dtype="auto"))
    assert bf16_lora.activations == 100 * ((10 * 64 + 4 * 128) * 2 + 2 * checkpointed)
    # Keys and values: 2 x 2 layers x 2 KV heads x 16 x 2 bytes a token.
    assert plan.demand.kv_tokens == 128
    assert plan.kv_cache == 128 * (2 * 2 * 2 * 16 * 2)
    assert plan.headroom == int((8 * MIB - plan.weights) * 0.2)
    needed = plan.weights + plan.adapters + plan.activations + plan.kv_cache + plan.headroom
    assert plan.needed == needed and plan.fits


def test_checkpointing_off_keeps_every_layer_and_auto_only_what_the_budget_needs() -> None:
    per_token_off = 2 * ((10 * 64 + 4 * 128) * 2 + (6 * 64 + 128) * 4)
    off = plan_fit(TINY, 2, 1, 8 * MIB, replace(TINY_SETTINGS, activation_checkpointing="off"))
    assert (off.recomputation, off.activations) == (Recomputation(), 100 * per_token_off)
    auto = plan_fit(TINY, 2, 1, 8 * MIB, replace(TINY_SETTINGS, activation_checkpointing="auto"))
    assert not auto.recomputation  # 100 tokens fit the budget whole
    # On 1.25 MiB the budget is 48% of what the weights leave, 545,771 bytes: one layer
    # checkpointed keeps its input and the larger of the other's and a recomputed layer's
    # intermediates, 4,352 + 128 bytes a token.
    tight = replace(TINY_SETTINGS, activation_checkpointing="auto")
    plan = plan_fit(TINY, 2, 1, 5 * MIB // 4, tight)
    assert int((5 * MIB // 4 - plan.weights) * 0.8 * 0.6) == 545_771
    assert (plan.recomputation, plan.activations) == (Recomputation(whole=1), 100 * (4352 + 128))
    assert "1 of 2 layers checkpointed" in plan.explanation()
    # Selective, a layer keeps its input, q, attention's output, o and down (64 wide each), k
    # and v (32), gate and up (128) in bf16 and a log-sum-exp a head in fp32: 1,296 bytes a
    # token. Both layers so: the larger of both layers' outputs and one layer's intermediates
    # made again beside the other's outputs. On 1.5 MiB (a budget of 671,600 bytes) that
    # fits where one whole layer plain and one selective does not: whole layers come first.
    selective = (5 * 64 + 2 * 128) * 2 + 2 * 32 * 2 + 4 * 4
    assert selective == 1_296
    every = plan_fit(
        TINY, 2, 1, 8 * MIB, replace(TINY_SETTINGS, activation_checkpointing="selective")
    )
    assert every.recomputation == Recomputation(selective=2)
    assert every.activations == 100 * max(2 * selective, 4352 + selective)
    roomier = plan_fit(TINY, 2, 1, 3 * MIB // 2, tight)
    assert int((3 * MIB // 2 - roomier.weights) * 0.8 * 0.6) == 671_600
    assert roomier.recomputation == Recomputation(selective=1)
    assert roomier.activations == 100 * (4352 + selective)
    assert "1 of 2 layers checkpointed selectively" in roomier.explanation()


def test_budgets_below_one_datum_or_sample_are_planned_at_it() -> None:
    """A pass never splits below one datum, nor the sampler's cache below one sample: a budget
    set lower is planned at that floor, one set higher as set."""
    low = replace(TINY_SETTINGS, train_batch_tokens=10, sample_cache_tokens=10)
    plan = plan_fit(TINY, 2, 1, 8 * MIB, low)
    assert (plan.demand.pass_tokens, plan.demand.kv_tokens) == (64, 128)
    assert (plan.demand.pass_source, plan.demand.kv_source) == (
        "one datum at QT_MAX_TOKENS_PER_DATUM",
        "one sample: a prompt and a completion at QT_MAX_TOKENS_PER_DATUM each",
    )
    high = replace(TINY_SETTINGS, train_batch_tokens=1000, sample_cache_tokens=1000)
    plan = plan_fit(TINY, 2, 1, 8 * MIB, high)
    assert (plan.demand.pass_tokens, plan.demand.kv_tokens) == (1000, 1000)
    long = replace(TINY_SETTINGS, train_batch_tokens=None, max_tokens_per_datum=4096)
    plan = plan_fit(TINY, 2, 1, 8 * MIB, long)  # both within the model's 256 positions
    assert (plan.demand.pass_tokens, plan.demand.kv_tokens) == (256, 256)


def test_ranks_split_matrices_keep_vectors_and_copy_kv_heads_below_one_a_rank() -> None:
    two = plan_fit(TINY, 2, 2, 8 * MIB, TINY_SETTINGS)
    # Halves of every matrix (k and v: one of the two KV heads each), norms whole.
    layer = (2048 + 1024 + 1024 + 2048 + 3 * 4096) + 2 * 64
    assert two.weights == 2 * (2 * 3200 + 2 * layer + 64)
    # LoRA: q, k, v, gate, up (and lm_head) keep A whole and halve B; o and down halve A.
    lora = 2 * ((512 + 256) + 2 * (512 + 128) + (256 + 512) + 2 * (512 + 512) + (512 + 512))
    assert two.adapter_each == 20 * (lora + 512 + 8 * 50)
    four = plan_fit(TINY, 2, 4, 8 * MIB, TINY_SETTINGS)
    # Two KV heads on four ranks: each holds one, a copy, in its weights and in its cache.
    layer = (1024 + 1024 + 1024 + 1024 + 3 * 2048) + 2 * 64
    assert four.weights == 2 * (2 * 1600 + 2 * layer + 64)
    assert four.kv_cache == two.kv_cache == 128 * (2 * 2 * 1 * 16 * 2)


def test_mixture_of_experts_counts_every_expert_and_its_lora() -> None:
    """Qwen3-MoE: each sparse layer's experts are 3-D tensors (all of them count, not the
    active two), the router a matrix; a dense layer (mlp_only_layers) has a plain MLP. With the
    MLP, LoRA adapts the experts too: an A and a B of the rank per expert (PEFT's
    target_parameters), as the worker builds them."""
    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim 16
        vocab_size=100,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    # q, k, v, o; q and k norms of 16; the layer's two norms.
    attention = 4096 + 2 * 2048 + 4096 + 2 * 16 + 2 * 64
    # 4 experts x (gate and up: 2 x 32 x 64, down: 64 x 32), router 4 x 64.
    experts = 4 * (2 * 32 * 64 + 64 * 32) + 4 * 64
    dense = 3 * 96 * 64
    params = 2 * 100 * 64 + 2 * attention + experts + dense + 64
    plan = plan_fit(config, 2, 1, 8 * MIB, replace(TINY_SETTINGS, lora=LoraConfig(rank=1)))
    assert plan.weights == 2 * params
    linears = {name for name, _, _ in model_shape(config).linears}
    assert "model.layers.1.mlp.gate_proj" in linears
    assert not any("layers.0.mlp" in name for name in linears)
    # Rank 1 over both layers' attention, layer 1's MLP and lm_head: (in + out) each; layer
    # 0's 4 experts: gate_up 64 -> 64 and down 32 -> 64, (in + out) an expert.
    lora = 2 * (128 + 96 + 96 + 128) + 2 * (64 + 96) + (96 + 64) + (64 + 100)
    experts = 4 * (64 + 64) + 4 * (32 + 64)
    assert plan.adapter_each == 20 * (lora + experts)
    assert {"experts.down_proj", "experts.gate_up_proj"} <= set(plan.targets)
    attention_only = replace(TINY_SETTINGS, lora=LoraConfig(rank=1, train_mlp=False))
    assert not any("experts" in t for t in plan_fit(config, 2, 1, 8 * MIB, attention_only).targets)


@pytest.mark.parametrize(
    ("model", "parameters"),
    [
        ("Llama-3.1-8B", 8_030_261_248),
        ("Qwen2.5-32B", 32_763_876_352),
        ("Llama-3.1-70B", 70_553_706_496),
        ("Qwen3-30B-A3B", 30_532_122_624),  # every expert: 3.3B are active a token
        ("gpt-oss-120b", 116_829_156_672),  # 5.1B active
        ("Kimi-K2", 1_026_408_209_408),  # 32B active
    ],
)
def test_the_docs_configs_have_their_published_sizes(model: str, parameters: int) -> None:
    plan = fit_table.plan_for(model, 1)
    assert plan.weights == 2 * parameters


def test_a_plan_that_does_not_fit_says_by_how_much_and_what_would() -> None:
    """Each change it advises fits, alone: the most resident adapters that fit (one more does
    not), a shorter pass, a smaller cache, more GPUs."""
    crowded = replace(TINY_SETTINGS, max_resident_adapters=24)
    plan = plan_fit(TINY, 2, 1, 8 * MIB, crowded)
    assert not plan.fits
    most = int(next(r for r in plan.remedies if r.startswith("QT_MAX_RESIDENT_ADAPTERS="))[25:])
    assert plan_fit(TINY, 2, 1, 8 * MIB, replace(crowded, max_resident_adapters=most)).fits
    assert not plan_fit(TINY, 2, 1, 8 * MIB, replace(crowded, max_resident_adapters=most + 1)).fits
    assert "2 GPUs of this size as one tensor-parallel group" in plan.remedies
    assert plan_fit(TINY, 2, 2, 8 * MIB, crowded).fits
    text = plan.explanation()
    assert f"needs {plan.needed / GIB:.2f} GiB" in text
    assert f"{(plan.needed - plan.rank_bytes) / GIB:.2f} GiB over" in text
    assert "Any one of these fits: " in text and "QT_MAX_RESIDENT_ADAPTERS=" in text


def test_passes_and_cache_advised_to_shrink_fit() -> None:
    """The most tokens a pass, and the most KV-cache tokens, that fit with the rest as set:
    one more does not."""
    busy = replace(
        TINY_SETTINGS, max_resident_adapters=1, train_batch_tokens=1000, sample_cache_tokens=10_000
    )
    plan = plan_fit(TINY, 2, 1, 8 * MIB, busy)
    assert plan.remedies[1:] == ("QT_TRAIN_BATCH_TOKENS=793", "QT_SAMPLE_CACHE_TOKENS=6289")
    for tokens, fits in ((793, True), (794, False)):
        assert plan_fit(TINY, 2, 1, 8 * MIB, replace(busy, train_batch_tokens=tokens)).fits is fits
    for tokens, fits in ((6289, True), (6290, False)):
        assert plan_fit(TINY, 2, 1, 8 * MIB, replace(busy, sample_cache_tokens=tokens)).fits is fits


def test_require_fit_refuses_naming_the_numbers() -> None:
    """The check a worker makes at start-up, here with a pretend device of 4 MiB: a server
    error (the deployment's to fix) naming the model, each part and what to change."""
    with pytest.raises(WorkerFitError) as raised:
        require_fit(TINY, 2, 4 * MIB, replace(TINY_SETTINGS, max_resident_adapters=64), "tiny")
    message = raised.value.message
    assert raised.value.category is ErrorCategory.SERVER
    assert message.startswith("tiny does not fit: A GPU of 0.00 GiB needs")
    for part in ("weights", "adapters", "activations", "KV cache", "headroom"):
        assert part in message
    assert "QT_MAX_RESIDENT_ADAPTERS=" in message
    assert require_fit(TINY, 2, 8 * MIB, TINY_SETTINGS, "tiny").fits


def test_unset_resident_adapters_are_as_many_as_fit() -> None:
    """QT_MAX_RESIDENT_ADAPTERS unset: the worker keeps the most adapters that fit beside the
    rest (one more does not), at most the cap; it refuses only when not even one fits."""
    crowded = replace(TINY_SETTINGS, max_resident_adapters=24)
    plan = fit_resident_adapters(TINY, 2, 8 * MIB, crowded, "tiny")
    most = plan.demand.settings.max_resident_adapters
    assert plan.fits and 1 <= most < 24
    assert not plan_fit(TINY, 2, 1, 8 * MIB, replace(crowded, max_resident_adapters=most + 1)).fits
    roomy = fit_resident_adapters(TINY, 2, 80 * GIB, crowded, "tiny")
    assert roomy.demand.settings.max_resident_adapters == 24  # the cap, not more
    one = plan_fit(TINY, 2, 1, 8 * MIB, replace(crowded, max_resident_adapters=1))
    with pytest.raises(WorkerFitError, match=r"^tiny does not fit: "):
        fit_resident_adapters(TINY, 2, one.weights, crowded, "tiny")  # weights fill it
    # Llama-3.1-8B at the defaults on one 80 GiB GPU: the docs' QT_MAX_RESIDENT_ADAPTERS=7.
    eight_b = fit_table.MODELS["Llama-3.1-8B"]()
    sized = fit_resident_adapters(eight_b, 2, 80 * GIB, FitSettings.of(EngineConfig()), "8B")
    assert sized.demand.settings.max_resident_adapters == 7


def test_a_worker_group_is_planned_with_its_embeddings_whole_on_each_rank() -> None:
    """A worker group keeps the embedding and the unembedding whole on every rank: the group's
    check counts them so (one rank of two holds half of each other matrix), and a device too
    small for the model alone takes it in a group."""
    split = plan_fit(TINY, 2, 2, 80 * GIB, TINY_SETTINGS)
    grouped = plan_fit(TINY, 2, 2, 80 * GIB, TINY_SETTINGS, whole=WHOLE_IN_GROUP)
    assert grouped.weights - split.weights == 2 * (100 * 64 // 2) * 2  # two halves, bf16
    sizes = range(MIB, 64 * MIB, 16 << 10)
    device = next(
        b for b in sizes if plan_fit(TINY, 2, 2, b, TINY_SETTINGS, whole=WHOLE_IN_GROUP).fits
    )
    with pytest.raises(WorkerFitError):
        require_fit(TINY, 2, device, TINY_SETTINGS, "tiny")
    assert require_fit(TINY, 2, device, TINY_SETTINGS, "tiny", ranks=2).fits


# --- docs/operations.md's table ----------------------------------------------------------------
DOCS_FITS = {
    ("Llama-3.1-8B", 1): False,
    ("Llama-3.1-8B", 2): False,
    ("Llama-3.1-8B", 4): False,
    ("Llama-3.1-8B", 8): True,
    ("Qwen2.5-32B", 1): False,
    ("Qwen2.5-32B", 2): False,
    ("Qwen2.5-32B", 4): False,
    ("Qwen2.5-32B", 8): False,
    ("Llama-3.1-70B", 1): False,
    ("Llama-3.1-70B", 2): False,
    ("Llama-3.1-70B", 4): False,
    ("Llama-3.1-70B", 8): False,
    # LoRA of rank 32 on each of 128 experts a layer: 1.26B parameters an adapter.
    ("Qwen3-30B-A3B", 1): False,
    ("Qwen3-30B-A3B", 2): False,
    ("Qwen3-30B-A3B", 4): False,
    ("Qwen3-30B-A3B", 8): False,
}


def docs_rows() -> list[str]:
    text = (REPO / "docs" / "operations.md").read_text()
    table = text.split(fit_table.BEGIN, 1)[1].split(fit_table.END, 1)[0]
    return [line for line in table.strip().splitlines()[2:]]


@pytest.mark.parametrize(("model", "gpus"), list(DOCS_FITS), ids=lambda v: str(v))
def test_docs_row_is_the_plan(model: str, gpus: int) -> None:
    """The row in the docs is what the planner says now, and it fits (or not) as pinned."""
    assert fit_table.row(model, gpus) in docs_rows()
    assert fit_table.plan_for(model, gpus).fits is DOCS_FITS[(model, gpus)]


def test_docs_table_has_exactly_these_rows() -> None:
    count = len(fit_table.MODELS_80GIB) * len(fit_table.GPU_COUNTS)
    assert len(docs_rows()) == len(DOCS_FITS) == count


# On H200s: whether each fits as it is, and the first setting or way beyond today's workers
# that the row names (None: the row names none of that kind).
H200_ROWS = {
    ("Qwen3-30B-A3B", 1): ("QT_MAX_RESIDENT_ADAPTERS=1", None),
    ("Qwen3-30B-A3B", 8): ("QT_MAX_RESIDENT_ADAPTERS=2", None),
    ("gpt-oss-120b", 1): (None, "FP8 base weights, QT_MAX_RESIDENT_ADAPTERS=15, clients with"),
    ("gpt-oss-120b", 8): ("QT_MAX_RESIDENT_ADAPTERS=1", None),
    ("Kimi-K2", 8): (None, "bf16 base weights on 32 GPUs (4 nodes of 8)"),
}


def h200_docs_rows() -> list[str]:
    text = (REPO / "docs" / "operations.md").read_text()
    table = text.split(fit_table.H200_BEGIN, 1)[1].split(fit_table.H200_END, 1)[0]
    return [line for line in table.strip().splitlines()[2:]]


def test_the_h200_table_is_the_plan_and_says_what_would_fit() -> None:
    """Every row of the H200 table is the planner's now; the rows pinned here name the change
    that fits them, or, where no setting does, the way beyond today's workers that would; each
    way named fits when planned (Kimi-K2 in FP8 on two nodes without MLP adapters)."""
    rows = h200_docs_rows()
    gpu_counts = fit_table.GPU_COUNTS
    assert rows == [fit_table.h200_row(m, g) for m in fit_table.MODELS_H200 for g in gpu_counts]
    for (model, gpus), (setting, beyond) in H200_ROWS.items():
        cells = [c.strip() for c in fit_table.h200_row(model, gpus).split("|")[1:-1]]
        assert cells[2] == "**no**"
        assert (setting or "no single change") in cells[9].split("; ")[0]
        assert cells[10].startswith(beyond) if beyond else cells[10] == ""
    kimi = fit_table.MODELS["Kimi-K2"]()
    fp8_two_nodes = replace(
        fit_table.settings(), max_resident_adapters=22, lora=LoraConfig(train_mlp=False)
    )
    shape = fit_table.shape_of("Kimi-K2")

    def planned(gpus: int, weight_bytes: int | None) -> FitPlan:
        return plan_fit(
            kimi, 2, gpus, fit_table.H200_BYTES, fp8_two_nodes, shape, weight_bytes=weight_bytes
        )

    assert planned(16, 1).fits
    assert not planned(8, 1).fits  # one node: not even in FP8
    assert not planned(16, None).fits  # two nodes: not in bf16


@pytest.mark.parametrize(
    ("gpus", "resident", "datum", "needed_gib"),
    [(8, 4, 16_384, "73.95"), (4, 3, 8_192, "78.04")],
)
def test_the_70b_fits_with_the_changes_the_docs_name(
    gpus: int, resident: int, datum: int, needed_gib: str
) -> None:
    settings = replace(
        FitSettings.of(EngineConfig()), max_resident_adapters=resident, max_tokens_per_datum=datum
    )
    model = "Llama-3.1-70B"
    plan = plan_fit(
        fit_table.MODELS[model](), 2, gpus, fit_table.GPU_BYTES, settings, fit_table.shape_of(model)
    )
    assert plan.fits and f"{plan.needed / GIB:.2f}" == needed_gib


def test_a_vision_language_model_counts_its_tower_whole_and_adapts_its_language_model() -> None:
    """The built-in tiny-vl's config (a worker on CUDA plans with it; it used to hand the
    planner the text config alone, which no causal-LM class takes): the weights are every
    parameter of the model built, the tower's held whole on each of two ranks; LoRA's targets
    and the KV cache are its language model's, as Qwen2 (its text architecture) plans them."""
    from transformers import Qwen2Config

    from queue_tinker.workers.model.base_model import _model_of, builtin_config

    config = builtin_config("queue-tinker/tiny-vl")
    model = _model_of(config)
    tower = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    assert tower > 0
    plan = plan_fit(config, 4, 1, 64 * MIB, TINY_SETTINGS)
    assert plan.weights == 4 * sum(p.numel() for p in model.parameters())
    fields = config.get_text_config().to_dict()
    text = Qwen2Config(**{k: v for k, v in fields.items() if k != "model_type"})
    as_text = plan_fit(text, 4, 1, 64 * MIB, TINY_SETTINGS)
    assert plan.targets == as_text.targets and plan.kv_cache == as_text.kv_cache
    assert plan.adapter_each == as_text.adapter_each
    two = plan_fit(config, 4, 2, 64 * MIB, TINY_SETTINGS)
    assert two.weights == 4 * tower + plan_fit(text, 4, 2, 64 * MIB, TINY_SETTINGS).weights


def test_latent_attention_kv_is_counted_as_transformers_caches_it() -> None:
    """DeepSeek-V3's (Kimi-K2's) KV cache per token, as the planner counts it, is what a tiny
    model's cache holds after a forward of 5 tokens (the compressed latent and RoPE key)."""
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.arange(5)[None], use_cache=True).past_key_values
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    held = sum(t.numel() * t.element_size() for t in tensors)
    assert held == 5 * kv_bytes_per_token(config, 4)


FAMILY_BUILTINS = (
    "queue-tinker/tiny-llama",
    "queue-tinker/tiny-moe",
    "queue-tinker/tiny-qwen3",
    "queue-tinker/tiny-gpt-oss",
    "queue-tinker/tiny-deepseek-v3",
    "queue-tinker/tiny-qwen3.5",
)


@pytest.mark.parametrize("name", FAMILY_BUILTINS, ids=lambda name: name.split("/")[1])
def test_the_sampler_s_cache_is_counted_per_token_and_per_row_as_it_is_held(
    name: str, root: Path
) -> None:
    """What a token adds to a row's cache (kv_bytes_per_token) and what a row holds whatever
    its length (row_state_bytes: gpt-oss's sliding windows of 8, Qwen3.5's linear-attention
    states) are what a built-in's own cache holds after prompts of 20 and 40 tokens."""
    model = load_base_model(name, "cpu", root / "models").eval()
    config = model.config.get_text_config()

    def held(tokens: int) -> int:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            ids = torch.arange(tokens)[None] + 3
            model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})
        return sum(held_bytes(layer) for layer in cache.layers)

    short, long = held(20), held(40)
    per_token = kv_bytes_per_token(config, 4)
    assert long - short == 20 * per_token
    assert short - 20 * per_token == row_state_bytes(config, 4)
    assert (row_state_bytes(config, 4) > 0) is (name.endswith(("gpt-oss", "qwen3.5")))
