"""The checkpointing plan (workers/model/memory.py): the fewest decoder layers a backward pass
recomputes whole, then the fewest it recomputes selectively, to keep its activations within the
budget, on the configs it will meet."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from queue_tinker.workers.model.memory import (
    LayerBytes,
    Recomputation,
    budgets_for,
    cheapest_recomputation,
    layer_bytes,
    lora_compute_dtype,
    lora_copy_bytes,
    pass_bytes_per_token,
    spare_activation_bytes,
    train_bytes_per_token,
)

GIB = 1 << 30
LLAMA_8B = LlamaConfig(
    hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32
)
TINY = LlamaConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128)
NONE = Recomputation()


def whole(layers: int) -> Recomputation:
    return Recomputation(whole=layers)


def whole_only(tokens: int, layers: int, per_layer: LayerBytes, budget: int) -> int:
    """The plan without selective layers: how many whole layers."""
    return cheapest_recomputation(tokens, layers, per_layer, budget, selective=False).whole


def test_the_ends_of_the_plan_are_the_two_old_modes() -> None:
    """No layer checkpointed keeps every layer's intermediates; every layer, every input plus
    one layer's intermediates (what train_bytes_per_token said of the two modes)."""
    per_layer = layer_bytes(LLAMA_8B, 2, lora_copy=4)
    assert pass_bytes_per_token(32, NONE, per_layer) == 32 * per_layer.kept
    assert (
        pass_bytes_per_token(32, whole(32), per_layer)
        == 32 * per_layer.checkpointed + per_layer.kept
    )
    for checkpointing in (False, True):
        layers = 32 if checkpointing else 0
        assert train_bytes_per_token(
            LLAMA_8B, 2, checkpointing, lora_copy=4
        ) == pass_bytes_per_token(32, whole(layers), per_layer)


def test_a_selective_layer_keeps_its_gemm_outputs_and_input() -> None:
    """Selectively checkpointed, a Llama layer keeps its input, q, k, v, attention's output and
    its fp32 log-sum-exp a head, o, gate, up and down (5 hidden + 2 KV + 2 MLP widths), whatever
    LoRA's matmul dtype: at the 8B shape (8 KV heads) 0.52x a plain layer with bf16 LoRA, 0.29x
    with fp32 copies; every layer selective keeps those, plus one layer's intermediates while
    backward remakes its elementwise work."""
    config = LlamaConfig(**{**LLAMA_8B.to_dict(), "num_key_value_heads": 8})
    for lora_copy in (0, 4):
        per_layer = layer_bytes(config, 2, lora_copy=lora_copy)
        assert per_layer.selective == (5 * 4096 + 2 * 1024 + 2 * 14336) * 2 + 32 * 4
        assert per_layer.checkpointed < per_layer.selective < per_layer.kept
    assert layer_bytes(config, 2, lora_copy=0).selective / layer_bytes(
        config, 2, lora_copy=0
    ).kept == pytest.approx(0.52, abs=0.01)
    per_layer = layer_bytes(config, 2, lora_copy=0)
    every = Recomputation(selective=32)
    assert pass_bytes_per_token(32, every, per_layer) == 31 * per_layer.selective + per_layer.kept
    mixed = Recomputation(whole=20, selective=12)
    assert pass_bytes_per_token(32, mixed, per_layer) == (
        max(12 * per_layer.selective, per_layer.kept + 11 * per_layer.selective)
        + 20 * per_layer.checkpointed
    )
    # Recomputing is costlier the more whole layers it takes, then selective ones.
    assert NONE < Recomputation(selective=32) < whole(1) < Recomputation(whole=1, selective=1)
    assert not NONE and Recomputation(selective=1) and whole(1)


@pytest.mark.parametrize(
    ("tokens", "budget_gib", "lora_copy", "expected", "whole_alone"),
    [
        (1_024, 30, 4, NONE, 0),  # an RL-sized pass fits whole: nothing is recomputed
        (2_048, 30, 4, NONE, 0),
        # The 8B shape on an 80 GB card: whole layers alone would take 28 of 32; with
        # selective ones 19 whole and 12 selective (one layer plain).
        (8 * 2_048, 30, 4, Recomputation(whole=19, selective=12), 28),
        (8 * 2_048, 1, 4, whole(32), 32),  # does not fit even checkpointed (split later)
        (32_768, 80, 4, Recomputation(whole=13, selective=18), 26),  # a whole card's budget
        # LoRA's matmuls in bf16 keep no fp32 copy of their inputs: fewer to recompute.
        (8 * 2_048, 30, 0, Recomputation(whole=17, selective=14), 23),
    ],
)
def test_the_plan_on_the_8b_shape(
    tokens: int, budget_gib: int, lora_copy: int, expected: Recomputation, whole_alone: int
) -> None:
    per_layer = layer_bytes(LLAMA_8B, 2, lora_copy=lora_copy)
    budget = budget_gib * GIB
    planned = cheapest_recomputation(tokens, 32, per_layer, budget)
    assert planned == expected
    assert whole_only(tokens, 32, per_layer, budget) == whole_alone
    if planned and planned != whole(32):  # the cheapest: it fits, nothing cheaper does
        assert tokens * pass_bytes_per_token(32, planned, per_layer) <= budget
        cheaper = [
            Recomputation(whole=w, selective=s)
            for w in range(33)
            for s in range(33 - w)
            if Recomputation(whole=w, selective=s) < planned
        ]
        assert all(tokens * pass_bytes_per_token(32, r, per_layer) > budget for r in cheaper)


def test_lora_matmuls_in_the_base_dtype_keep_no_copy_of_their_inputs() -> None:
    """QT_LORA_MATMUL_DTYPE: auto runs LoRA in a bf16 base's dtype and keeps no copy; fp32 over
    a bf16 base keeps an fp32 copy of each LoRA input (q/k/v/o, gate/up: hidden-wide; down:
    MLP-wide); over an fp32 base there is nothing to copy either way."""
    assert lora_compute_dtype(torch.bfloat16, "auto") == torch.bfloat16
    assert lora_compute_dtype(torch.bfloat16, "fp32") is None
    assert lora_compute_dtype(torch.float32, "auto") is None
    assert [lora_copy_bytes(2, "auto"), lora_copy_bytes(2, "fp32"), lora_copy_bytes(4, "fp32")] == [
        0,
        4,
        0,
    ]
    copied = layer_bytes(LLAMA_8B, 2, lora_copy=4).kept - layer_bytes(LLAMA_8B, 2, lora_copy=0).kept
    assert copied == (6 * 4096 + 14336) * 4


def test_more_tokens_never_checkpoint_fewer_layers() -> None:
    per_layer = layer_bytes(LLAMA_8B, 2, lora_copy=4)
    plans = [cheapest_recomputation(t, 32, per_layer, 20 * GIB) for t in range(512, 40_000, 512)]
    assert plans == sorted(plans)
    assert plans[0] == NONE and plans[-1] == whole(32)
    assert any(p.selective for p in plans)


def test_a_budget_met_exactly_fits() -> None:
    per_layer = layer_bytes(TINY, 4, lora_copy=0)
    exact = 96 * pass_bytes_per_token(2, NONE, per_layer)
    assert cheapest_recomputation(96, 2, per_layer, exact) == NONE
    assert cheapest_recomputation(96, 2, per_layer, exact - 1) == Recomputation(selective=1)
    assert whole_only(96, 2, per_layer, exact - 1) == 1


def test_budgets_carry_the_activation_budget_they_size_passes_from() -> None:
    """train_batch_tokens is what fits the activation budget with every layer checkpointed,
    so every pass under it has a plan that fits."""
    budgets = budgets_for(LLAMA_8B, 62 * GIB, 2, checkpointing=True, lora_copy=4)
    per_layer = layer_bytes(LLAMA_8B, 2, lora_copy=4)
    assert budgets.train_activation_bytes == int(62 * GIB * 0.8 * 0.6)
    full = budgets.train_batch_tokens * pass_bytes_per_token(32, whole(32), per_layer)
    assert full <= budgets.train_activation_bytes
    planned = cheapest_recomputation(
        budgets.train_batch_tokens, 32, per_layer, budgets.train_activation_bytes
    )
    assert (
        budgets.train_batch_tokens * pass_bytes_per_token(32, planned, per_layer)
        <= budgets.train_activation_bytes
    )


def pretend_device(
    monkeypatch: pytest.MonkeyPatch, free: int, reserved: int, allocated: int
) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_a_pass_borrows_the_sampler_s_share_only_while_it_lies_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the 8B shape on 62 GiB free: with the memory as it was at start-up (nothing of the
    sampler's share in use) a pass may borrow all of the share, and then checkpoints fewer
    layers of 8 x 2,048 tokens; with the sampler's cache holding 12 GiB, what is left past the
    pass's budget and the headroom (the 8% of the usable memory neither share holds counts);
    with its whole share and that slack in use, nothing. torch's cached blocks count as
    free; a pass never goes past the share."""
    budgets = budgets_for(LLAMA_8B, 62 * GIB, 2, checkpointing=True, lora_copy=0)
    share = budgets.sample_cache_bytes
    assert share == int(62 * GIB * 0.8 * 0.3) and budgets.headroom_bytes == int(62 * GIB * 0.2)
    beside = budgets.train_activation_bytes + budgets.headroom_bytes  # never borrowed
    cuda = torch.device("cuda")
    pretend_device(monkeypatch, 62 * GIB, 0, 0)
    assert spare_activation_bytes(cuda, budgets) == share
    pretend_device(monkeypatch, 50 * GIB, 12 * GIB, 12 * GIB)  # a live cache of 12 GiB
    assert 0 < spare_activation_bytes(cuda, budgets) == 50 * GIB - beside < share
    pretend_device(monkeypatch, 50 * GIB, 12 * GIB, 0)  # freed, kept in torch's cache
    assert spare_activation_bytes(cuda, budgets) == share
    pretend_device(monkeypatch, beside, 62 * GIB - beside, 62 * GIB - beside)
    assert spare_activation_bytes(cuda, budgets) == 0
    pretend_device(monkeypatch, 80 * GIB, 0, 0)  # more than at start-up: still the share
    assert spare_activation_bytes(cuda, budgets) == share
    per_layer = layer_bytes(LLAMA_8B, 2, lora_copy=0)
    tokens = 8 * 2048
    alone = cheapest_recomputation(tokens, 32, per_layer, budgets.train_activation_bytes)
    borrowing = cheapest_recomputation(
        tokens, 32, per_layer, budgets.train_activation_bytes + share
    )
    assert borrowing < alone


def test_a_low_rank_column_costs_a_token_one_value_per_lora_linear_in_loras_dtype() -> None:
    """Each further column of LoRA's low-rank product a token keeps costs one value in each of
    a Llama layer's seven LoRA linears, in the dtype LoRA's matmuls run in: the base's (bf16,
    2 bytes) by default, fp32 under QT_LORA_MATMUL_DTYPE=fp32; a layer with 24 more columns
    keeps that much more a token."""
    assert layer_bytes(LLAMA_8B, 2, lora_copy=0).low_rank_column == 7 * 2
    assert layer_bytes(LLAMA_8B, 2, lora_copy=4).low_rank_column == 7 * 4
    per_layer = layer_bytes(LLAMA_8B, 2, lora_copy=0)
    assert per_layer.with_columns(24).kept == per_layer.kept + 24 * 14
    assert per_layer.with_columns(24).checkpointed == per_layer.checkpointed
    assert per_layer.with_columns(24).selective == per_layer.selective + 24 * 14


def test_a_logits_chunk_is_held_to_what_the_headroom_holds() -> None:
    """A chunk's backward holds ~20 bytes an element beside the activation budget, in the
    headroom: at the 8B shape an 80 GiB card (62 GiB free after the weights) leaves room for
    far more than the default 2^27 elements, a 24 GiB card (8 GiB free) for about 2^26, and a
    budget too small for anything still gets the fewest; a plan with budgets takes the smaller
    of its own and the cap."""
    from queue_tinker.workers.model.memory import FEWEST_LOGIT_ELEMENTS, logit_chunk_cap
    from queue_tinker.workers.training.model_pass import PassPlan, budgeted

    roomy = budgets_for(LLAMA_8B, 62 * GIB, 2, checkpointing=True, lora_copy=0)
    tight = budgets_for(LLAMA_8B, 8 * GIB, 2, checkpointing=True, lora_copy=0)
    default = PassPlan().logit_chunk_elements
    assert default == 1 << 27
    assert logit_chunk_cap(roomy) == int(62 * GIB * 0.2) // 20 > default
    assert 1 << 26 < logit_chunk_cap(tight) == int(8 * GIB * 0.2) // 20 < default
    tiny = budgets_for(LLAMA_8B, 1 << 20, 2, checkpointing=True, lora_copy=0)
    assert logit_chunk_cap(tiny) == FEWEST_LOGIT_ELEMENTS
    plans = [budgeted(PassPlan(), b, LLAMA_8B, torch.bfloat16, lora_copy=0) for b in (roomy, tight)]
    assert [p.logit_chunk_elements for p in plans] == [default, logit_chunk_cap(tight)]
    assert (
        budgeted(PassPlan(), None, LLAMA_8B, torch.bfloat16, lora_copy=0).logit_chunk_elements
        == default
    )
