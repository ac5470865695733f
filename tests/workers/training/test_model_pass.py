"""The model pass at GPU scale, shown on the CPU: logprobs through the unembedding in chunks and
activation checkpointing give what the whole-logits pass gives (values and LoRA gradients,
fp32, rtol 1e-5), alone and inside a cross-adapter pass, and checkpointing really recomputes.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from engine_driver import held_bytes, saved_bytes
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from queue_tinker.config.engine import EngineConfig
from queue_tinker.types.enums import LossFn
from queue_tinker.types.requests.training import ForwardBackwardOutput, LoraConfig
from queue_tinker.types.tensors import Datum, ModelInput
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.base_model import load_base_model
from queue_tinker.workers.model.fused_kernels import rope_on_copies, rotating_copies
from queue_tinker.workers.model.lora.row_blocks import stacks
from queue_tinker.workers.model.memory import (
    Checkpointing,
    LayerBytes,
    Recomputation,
    cheapest_recomputation,
    layer_bytes,
    pass_bytes_per_token,
)
from queue_tinker.workers.training.model_pass import (
    LoraForm,
    PassPlan,
    causal_lm,
    gemm_width,
    padded_targets,
    scored_positions,
    target_logprobs,
)
from queue_tinker.workers.training.packing import pack_rows, padding_fraction
from queue_tinker.workers.training.shared_pass import PassOp, lora_form, rows_for, shared_pass

BASE = "queue-tinker/tiny-llama"
CPU = torch.device("cpu")
CLOSE = {"rtol": 1e-5, "atol": 1e-6}
# A gradient sums many tokens' terms, so its small elements carry the rounding of its large
# ones: its absolute tolerance is rtol times the tensor's own scale.
RTOL = 1e-5
TEXTS = ["hello lora world, at some length", "short", "the quick brown fox jumps over it"]
# A handful of positions per chunk: many chunks, the last one partial.
SMALL_CHUNKS = PassPlan(activation_checkpointing="off", logit_chunk_elements=3 * 3 * 259)
CHECKPOINTED = PassPlan(activation_checkpointing="on", logit_chunk_elements=3 * 3 * 259)
EAGER_ROPE = modeling_llama.apply_rotary_pos_emb
SELECTIVE = PassPlan(activation_checkpointing="selective", logit_chunk_elements=3 * 3 * 259)
WHOLE = PassPlan(activation_checkpointing="off", logit_chunk_elements=1 << 40)
PACKED = PassPlan(activation_checkpointing="off", pack_above_padding=0.0)
UNPACKED = PassPlan(activation_checkpointing="off", pack_above_padding=None)


def one_op_pass(pool: AdapterPool, data: list[Datum], plan: PassPlan) -> ForwardBackwardOutput:
    """The engine's pass of one forward_backward op on the pool's active adapter."""
    assert pool.active is not None
    adapter = next(a for a in pool.adapters.values() if a.name == pool.active)
    op = PassOp(adapter, data, LossFn.CROSS_ENTROPY, {}, backward=True)
    (out,) = shared_pass(pool, [op], CPU, plan)
    assert isinstance(out, ForwardBackwardOutput), out
    return out


def datum(text: str, weights: bool = True) -> Datum:
    ids = list(text.encode())
    inputs: dict[str, np.ndarray] = {"target_tokens": np.array(ids[1:], dtype=np.int64)}
    if weights:  # some zero weights: the loss picks positions, the gradient follows
        inputs["weights"] = (np.arange(len(ids) - 1) % 3 != 0).astype(np.float32)
    return Datum(model_input=ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def models_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="qt-model-pass-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pool(models_dir: Path) -> AdapterPool:
    """The tiny model with three adapters on every linear, the unembedding included."""
    base = load_base_model(BASE, "cpu", models_dir)
    base.eval()
    base.name_or_path = BASE  # as the engine does: adapter configs name the public base
    pool = AdapterPool(base, BASE, max_resident=8)
    for i in range(3):
        adapter = pool.add(f"m{i}", "t", LoraConfig(rank=4, train_unembed=True), seed=i)
        with torch.no_grad():  # B starts at zero: make every adapter's update count
            for key, param in adapter.params.items():
                if "lora_B" in key:
                    param.normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
    return pool


def whole_logits_logprobs(model: torch.nn.Module, data: list[Datum]) -> list[torch.Tensor]:
    """The reference, the engine's former pass: the same right-padded batch through the model's
    own forward, the whole (rows, positions, vocab) logits, log_softmax in fp32."""
    rows = rows_for(data, CPU, UNPACKED)  # a datum a row, right-padded
    ids, mask = rows.ids, rows.mask
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    out = []
    for row, d in enumerate(data):
        targets = torch.from_numpy(np.array(d.loss_fn_inputs["target_tokens"].data))
        scored = torch.log_softmax(logits[row, : targets.numel()], -1)
        out.append(scored.gather(1, targets[:, None])[:, 0])
    return out


def grads_after(adapter: Adapter, run: object) -> dict[str, torch.Tensor]:
    for p in adapter.params.values():
        p.grad = None
    assert callable(run)
    run()
    grads = {k: p.grad.clone() for k, p in adapter.params.items() if p.grad is not None}
    for p in adapter.params.values():
        p.grad = None
    return grads


def shared_pass_grads(
    pool: AdapterPool, data: dict[str, list[Datum]], plan: PassPlan
) -> dict[str, dict[str, torch.Tensor]]:
    """Every adapter's gradient after one shared forward_backward pass of its data."""
    for adapter in pool.adapters.values():
        for p in adapter.params.values():
            p.grad = None
    ops = [
        PassOp(
            adapter=pool.adapters[name],
            data=rows,
            loss_fn=LossFn.CROSS_ENTROPY,
            config={},
            backward=True,
        )
        for name, rows in data.items()
    ]
    assert not any(isinstance(out, Exception) for out in shared_pass(pool, ops, CPU, plan))
    return {
        name: {k: p.grad.clone() for k, p in adapter.params.items()}
        for name, adapter in pool.adapters.items()
    }


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys() and actual
    assert any("lm_head" in k for k in actual), "the unembedding's LoRA must be trained too"
    for key in expected:
        scale = float(expected[key].abs().max())
        torch.testing.assert_close(
            actual[key],
            expected[key],
            rtol=RTOL,
            atol=RTOL * scale,
            msg=lambda m, k=key: f"{k}: {m}",
        )


def test_chunked_logprobs_and_gradients_equal_whole_logits(pool: AdapterPool) -> None:
    """Chunked logprobs equal log_softmax of the whole logits, and so do the LoRA gradients
    (the unembedding's LoRA included), across many chunks with a partial last one."""
    adapter = pool.adapters["m0"]
    pool.activate(adapter)
    data = [datum(t) for t in TEXTS]

    def reference() -> None:
        logprobs = whole_logits_logprobs(pool.model, data)
        loss = -sum(
            (lp * torch.from_numpy(np.array(d.loss_fn_inputs["weights"].data))).sum()
            for lp, d in zip(logprobs, data, strict=True)
        )
        assert isinstance(loss, torch.Tensor)
        loss.backward()

    expected = grads_after(adapter, reference)
    chunked: dict[str, object] = {}

    def engine() -> None:
        chunked["out"] = one_op_pass(pool, data, SMALL_CHUNKS)

    assert_same(grads_after(adapter, engine), expected)
    with torch.no_grad():
        reference_logprobs = whole_logits_logprobs(pool.model, data)
    out = chunked["out"]
    for got, want in zip(out.loss_fn_outputs, reference_logprobs, strict=True):  # type: ignore[attr-defined]
        torch.testing.assert_close(torch.from_numpy(got["logprobs"].to_numpy()), want, **CLOSE)


def test_logits_are_recomputed_only_when_they_come_in_several_chunks(pool: AdapterPool) -> None:
    """A pass whose logits fit one chunk keeps them for backward (the unembedding runs once:
    holding one chunk is the bound anyway); in several chunks each is made again in backward
    (twice a chunk)."""
    pool.activate(pool.adapters["m1"])
    data = [datum(t) for t in TEXTS]
    head = causal_lm(pool.model).get_output_embeddings()
    calls = {"n": 0}

    def count(*_: object) -> None:
        calls["n"] += 1

    handle = head.register_forward_hook(count)
    try:
        one_op_pass(pool, data, WHOLE)
        whole, calls["n"] = calls["n"], 0
        one_op_pass(pool, data, SMALL_CHUNKS)
        chunked = calls["n"]
    finally:
        handle.remove()
        for adapter in pool.adapters.values():
            for param in adapter.params.values():
                param.grad = None
    width = max(len(t) for t in TEXTS) - 1
    chunks = -(-width // SMALL_CHUNKS.chunk_positions(len(data), 259))
    assert (whole, chunked) == (1, 2 * chunks)


def test_checkpointing_equals_no_checkpointing(pool: AdapterPool) -> None:
    """Decoder layers checkpointed (and logits chunked) give the same loss and gradients as a
    pass that keeps everything."""
    adapter = pool.adapters["m1"]
    pool.activate(adapter)
    data = [datum(t) for t in TEXTS]
    losses: list[float] = []

    def run(plan: PassPlan) -> object:
        def step() -> None:
            out = one_op_pass(pool, data, plan)
            losses.append(out.metrics["loss:sum"])

        return step

    assert_same(grads_after(adapter, run(CHECKPOINTED)), grads_after(adapter, run(WHOLE)))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_checkpointing_inside_a_cross_adapter_pass(pool: AdapterPool) -> None:
    """In a shared pass of three adapters (each row on its own LoRA), checkpointed layers
    recompute through the same row blocks: every adapter's gradient equals the pass without
    checkpointing."""
    data = {name: [datum(t) for t in TEXTS[i:] + TEXTS[:i]] for i, name in enumerate(pool.adapters)}

    expected = shared_pass_grads(pool, data, WHOLE)
    got = shared_pass_grads(pool, data, CHECKPOINTED)
    for name in pool.adapters:
        assert_same(got[name], expected[name])


@pytest.mark.parametrize("plan", [CHECKPOINTED, SELECTIVE], ids=["whole", "selective"])
def test_a_pass_that_fails_inside_a_checkpointed_layer_leaves_nothing_behind(
    pool: AdapterPool, plan: PassPlan
) -> None:
    """Out of memory inside a checkpointed layer, whole or selective (raised where a CUDA
    allocation would fail) while the exception is still held, as the worker's memory guard
    holds it: the next pass, on other rows and adapters, gets the gradients of a pass on a
    fresh start. torch's
    checkpoint leaves its saved-tensor hooks installed when the function raises; the next
    pass's tensors then went to the failed pass's recomputation (on the GPU: "split_with_sizes
    expects split_sizes to sum exactly to 16 ... got [8]")."""
    data = {name: [datum(t) for t in TEXTS[i:] + TEXTS[:i]] for i, name in enumerate(pool.adapters)}
    expected = shared_pass_grads(pool, data, plan)

    layer = pool.model.get_base_model().model.layers[-1]
    calls = {"n": 0}

    def fail_once(*_: object) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = layer.mlp.register_forward_pre_hook(fail_once)
    try:
        with pytest.raises(torch.OutOfMemoryError) as failed:
            shared_pass_grads(pool, {"m0": data["m0"] * 2, "m1": data["m1"]}, plan)
        got = shared_pass_grads(pool, data, plan)
    finally:
        handle.remove()
    assert failed.value is not None  # held until here, as a handler holds it
    for name in pool.adapters:
        assert_same(got[name], expected[name])


def kept_bytes(pool: AdapterPool, data: list[Datum], plan: PassPlan) -> int:
    """Bytes of the tensors a pass of the pool's active adapter saves for its backward."""
    return saved_bytes(lambda: one_op_pass(pool, data, plan))[1]


def test_checkpointing_keeps_only_layer_inputs_for_backward(pool: AdapterPool) -> None:
    """With checkpointing on, the tensors a step keeps for backward shrink to a fraction of
    what a pass without it keeps (the layers' intermediates are recomputed instead); a
    forward-only op never checkpoints, and auto turns on at its threshold."""
    pool.activate(pool.adapters["m2"])
    data = [datum(t) for t in TEXTS] * 4
    on, off = kept_bytes(pool, data, CHECKPOINTED), kept_bytes(pool, data, WHOLE)
    print(f"kept for backward: {on} bytes checkpointed, {off} without")
    assert on < off / 3
    auto = PassPlan(activation_checkpointing="auto", checkpoint_min_tokens=100)
    assert (
        auto.recomputation(99, True, 2),
        auto.recomputation(100, True, 2),
        auto.recomputation(100, False, 2),
    ) == (Recomputation(), Recomputation(whole=2), Recomputation())
    assert not CHECKPOINTED.recomputation(10**9, backward=False, layers=2)
    assert SELECTIVE.recomputation(1, True, 2) == Recomputation(selective=2)


def test_the_plan_counts_what_it_may_borrow_at_each_pass() -> None:
    """A plan with spare_activations asks it at every pass: the same pass checkpoints fewer
    layers while more lies spare, all of them while nothing does."""
    per_layer = layer_bytes(LlamaConfig(hidden_size=64, num_hidden_layers=2), 4, lora_copy=0)
    whole = 100 * pass_bytes_per_token(2, Recomputation(), per_layer)
    spare = [0]
    plan = PassPlan(
        activation_budget=100 * pass_bytes_per_token(2, Recomputation(whole=2), per_layer),
        layer_bytes=per_layer,
        spare_activations=lambda: spare[0],
    )
    assert plan.activation_budget is not None
    alone = cheapest_recomputation(100, 2, per_layer, plan.activation_budget)
    assert alone and plan.recomputation(100, True, 2) == alone
    spare[0] = whole
    assert not plan.recomputation(100, True, 2)
    spare[0] = 0
    assert plan.recomputation(100, True, 2) == alone


def test_a_stacked_pass_keeps_what_its_plan_counts_for_the_other_adapters_columns(
    models_dir: Path,
) -> None:
    """Stacked, every token computes every adapter's low-rank columns in every LoRA layer and
    keeps them for backward. The plan of such a pass (PassPlan.for_pass) adds the columns past
    a token's own adapter's: measured against the same pass in row blocks, what the stacked
    pass keeps more is that, to within what the unembedding's LoRA and the stacked weights
    add (1.12x here); and a budget that held the pass in row blocks then checkpoints a layer."""
    base = load_base_model(BASE, "cpu", models_dir)
    base.eval()
    base.name_or_path = BASE
    pool = AdapterPool(base, BASE, max_resident=8)
    adapters = [pool.add(f"s{i}", "t", LoraConfig(rank=8), seed=i) for i in range(4)]
    data = [datum(t) for t in TEXTS] * 4
    ops = [PassOp(a, data, LossFn.CROSS_ENTROPY, {}, backward=True) for a in adapters]
    kept = {}
    for stacked in (False, True):
        _, kept[stacked] = saved_bytes(
            lambda stacked=stacked: shared_pass(
                pool, ops, CPU, replace(WHOLE, lora_form="stacked" if stacked else "blocks")
            )
        )
        for adapter in adapters:
            for p in adapter.params.values():
                p.grad = None
    per_layer = layer_bytes(causal_lm(pool.model).config, 4, lora_copy=0)
    tokens = len(ops) * len(data) * max(d.model_input.length for d in data)
    plan = PassPlan().for_pass([8, 8, 8, 8], stacked=True)
    assert plan.extra_lora_columns == 24
    assert PassPlan().for_pass([8, 8, 8, 8], stacked=False).extra_lora_columns == 0
    counted = tokens * 2 * plan.extra_lora_columns * per_layer.low_rank_column
    assert 0.95 <= (kept[True] - kept[False]) / counted <= 1.3
    fits_blocks = PassPlan(
        activation_budget=tokens * pass_bytes_per_token(2, Recomputation(), per_layer),
        layer_bytes=per_layer,
    )
    assert not fits_blocks.recomputation(tokens, True, 2)
    assert fits_blocks.for_pass([8] * 4, stacked=True).recomputation(tokens, True, 2)


def test_a_planned_pass_checkpoints_some_layers_and_equals_none(pool: AdapterPool) -> None:
    """A budget between a plain pass's activations and a fully checkpointed one's makes the
    plan checkpoint some of the layers (one of the tiny model's two): the loss and every LoRA
    gradient equal the pass without checkpointing, and it keeps less for backward."""
    adapter = pool.adapters["m1"]
    pool.activate(adapter)
    data = [datum(t) for t in TEXTS]
    per_layer = layer_bytes(causal_lm(pool.model).config, 4, lora_copy=0)
    tokens = len(data) * max(d.model_input.length for d in data)
    budget = tokens * pass_bytes_per_token(2, Recomputation(whole=1), per_layer)
    planned = PassPlan(
        activation_budget=budget, layer_bytes=per_layer, logit_chunk_elements=1 << 40
    )
    assert planned.recomputation(tokens, True, 2) == Recomputation(whole=1)
    losses: list[float] = []

    def run(plan: PassPlan) -> object:
        def step() -> None:
            losses.append(one_op_pass(pool, data, plan).metrics["loss:sum"])

        return step

    assert_same(grads_after(adapter, run(planned)), grads_after(adapter, run(WHOLE)))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    unplanned = replace(planned, activation_checkpointing="off")
    assert kept_bytes(pool, data, planned) < kept_bytes(pool, data, unplanned)
    for param in adapter.params.values():
        param.grad = None


class _WideGemms(TorchDispatchMode):
    """Counts the matrix products that reduce over `width` or more (a layer's own GEMMs)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.count = width, 0

    def __torch_dispatch__(
        self, func: object, types: object, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        aten = torch.ops.aten
        operand = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1}.get(func)
        if operand is not None and args[operand].shape[-1] >= self.width:
            self.count += 1
        assert callable(func)
        return func(*args, **(kwargs or {}))


def forward_kept(
    model: torch.nn.Module, data: list[Datum], plan: PassPlan
) -> tuple[torch.Tensor, int]:
    """A backward pass's logprobs (their graph alive) and the bytes its forward keeps for
    backward, however it keeps them (engine_driver.held_bytes)."""
    batch = rows_for(data, CPU, plan)
    targets = padded_targets(
        batch, [np.asarray(d.loss_fn_inputs["target_tokens"].data) for d in data]
    )
    scored = scored_positions(batch, [d.model_input.length for d in data])
    return held_bytes(lambda: target_logprobs(model, batch, targets, scored, plan))


def test_a_selective_layer_keeps_its_gemm_outputs_and_remakes_the_rest(
    pool: AdapterPool,
) -> None:
    """Every layer selective: the logprobs and LoRA gradients are the plain pass's to the bit;
    its forward keeps less than the plain pass's and more than whole layers', and what it keeps
    past whole layers is the plan's estimate (memory.layer_bytes: 1.05x measured here, fp32);
    its backward runs no GEMM over the hidden width beyond the plain pass's (the projections'
    outputs are kept, LoRA's rank-wide B made again) where whole layers run every one again."""
    adapter = pool.adapters["m0"]
    pool.activate(adapter)
    data = [datum(t, weights=False) for t in TEXTS] * 8
    config = causal_lm(pool.model).config
    width = gemm_width(config)
    got: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor], int, int]] = {}
    modes: tuple[Checkpointing, ...] = ("off", "on", "selective")
    for mode in modes:
        plan = PassPlan(activation_checkpointing=mode, logit_chunk_elements=1 << 40)
        logprobs, kept = forward_kept(pool.model, data, plan)
        gemms = _WideGemms(width)
        with gemms:
            logprobs.sum().backward()
        grads = {k: p.grad.clone() for k, p in adapter.params.items() if p.grad is not None}
        for param in adapter.params.values():
            param.grad = None
        got[mode] = (logprobs.detach(), grads, kept, gemms.count)
    plain, whole, selective = got["off"], got["on"], got["selective"]
    assert torch.equal(selective[0], plain[0])
    assert selective[1].keys() == plain[1].keys() and plain[1]
    for key, grad in plain[1].items():
        assert torch.equal(selective[1][key], grad), key
    assert whole[2] < selective[2] < plain[2]
    tokens = rows_for(data, CPU, WHOLE).padded_tokens
    per_layer = layer_bytes(config, 4, lora_copy=0)
    measured = (selective[2] - whole[2]) / (tokens * config.num_hidden_layers)
    estimated = per_layer.selective - per_layer.checkpointed
    print(f"kept per token and layer past whole layers: {measured:.0f} B, estimate {estimated}")
    assert 0.85 <= measured / estimated <= 1.25
    assert selective[3] == plain[3] < whole[3]


def test_a_budget_a_selective_layer_meets_recomputes_no_layer_whole(pool: AdapterPool) -> None:
    """A budget a plain pass misses and one selective layer meets: the plan recomputes that
    layer's elementwise work alone, and the pass equals the plain one."""
    adapter = pool.adapters["m2"]
    pool.activate(adapter)
    data = [datum(t) for t in TEXTS]
    per_layer = layer_bytes(causal_lm(pool.model).config, 4, lora_copy=0)
    tokens = len(data) * max(d.model_input.length for d in data)
    budget = tokens * pass_bytes_per_token(2, Recomputation(selective=1), per_layer)
    assert budget < tokens * pass_bytes_per_token(2, Recomputation(), per_layer)
    planned = PassPlan(
        activation_budget=budget, layer_bytes=per_layer, logit_chunk_elements=1 << 40
    )
    assert planned.recomputation(tokens, True, 2) == Recomputation(selective=1)
    assert_same(
        grads_after(adapter, lambda: one_op_pass(pool, data, planned)),
        grads_after(adapter, lambda: one_op_pass(pool, data, WHOLE)),
    )


@pytest.mark.parametrize("form", ["blocks", "stacked", "grouped"])
def test_selective_layers_inside_a_cross_adapter_pass(pool: AdapterPool, form: LoraForm) -> None:
    """In a shared pass of three adapters, in each LoRA form, selective layers remake their
    elementwise work through the same LoRA wrapping: every adapter's gradient equals the pass
    without checkpointing."""
    data = {name: [datum(t) for t in TEXTS[i:] + TEXTS[:i]] for i, name in enumerate(pool.adapters)}
    expected = shared_pass_grads(pool, data, replace(WHOLE, lora_form=form))
    got = shared_pass_grads(pool, data, replace(SELECTIVE, lora_form=form))
    for name in pool.adapters:
        assert_same(got[name], expected[name])


def one_adapter(
    base: str, models_dir: Path, lora: LoraConfig, seed: int
) -> tuple[AdapterPool, Adapter]:
    """`base` with one active adapter whose B is drawn non-zero (every update counts)."""
    model = load_base_model(base, "cpu", models_dir)
    model.name_or_path = base
    pool = AdapterPool(model, base, max_resident=2)
    adapter = pool.add("m", "t", lora, seed=seed)
    with torch.no_grad():
        for key, param in adapter.params.items():
            if "lora_B" in key:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    pool.activate(adapter)
    return pool, adapter


def backward_pass(
    pool: AdapterPool, adapter: Adapter, data: list[Datum], mode: Checkpointing
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A backward pass's logprobs and the adapter's LoRA gradients under `mode` (cleared
    after)."""
    logprobs, _ = forward_kept(pool.model, data, PassPlan(activation_checkpointing=mode))
    logprobs.sum().backward()
    grads = {k: p.grad.clone() for k, p in adapter.params.items() if p.grad is not None}
    for param in adapter.params.values():
        param.grad = None
    return logprobs.detach(), grads


@pytest.mark.parametrize(
    "base", ["queue-tinker/tiny-moe", "queue-tinker/tiny-gpt-oss", "queue-tinker/tiny-qwen3.5"]
)
def test_selective_layers_equal_plain_ones_in_other_families(models_dir: Path, base: str) -> None:
    """Routed experts (their grouped GEMMs kept; gpt-oss adds its experts' bias into theirs in
    place, so those are remade) and linear attention: the logprobs and LoRA gradients of a pass
    of selective layers are the plain pass's."""
    pool, adapter = one_adapter(base, models_dir, LoraConfig(rank=4), seed=0)
    data = [datum(t, weights=False) for t in TEXTS]
    plain, plain_grads = backward_pass(pool, adapter, data, "off")
    selective, selective_grads = backward_pass(pool, adapter, data, "selective")
    assert selective_grads.keys() == plain_grads.keys() == adapter.params.keys()
    torch.testing.assert_close(selective, plain, **CLOSE)
    for key, grad in plain_grads.items():
        torch.testing.assert_close(selective_grads[key], grad, **CLOSE, msg=key)


def test_whole_and_selective_layers_in_one_pass_equal_plain_ones(
    models_dir: Path, tmp_path: Path
) -> None:
    """A three-layer model whose plan recomputes its first layer whole and its second
    selectively (a budget between, on hand-set layer bytes): the gradients equal the plain
    pass's."""
    config = LlamaConfig(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "three-layers")
    base = str(tmp_path / "three-layers")
    pool, adapter = one_adapter(base, models_dir, LoraConfig(rank=4), seed=1)
    data = [datum(t) for t in TEXTS]
    tokens = len(data) * max(d.model_input.length for d in data)
    # Plain 300 a token; every layer selective 220; one whole, one selective 161.
    per_layer = LayerBytes(kept=100, checkpointed=1, selective=60)
    mixed = PassPlan(activation_budget=tokens * 161, layer_bytes=per_layer)
    assert mixed.recomputation(tokens, True, 3) == Recomputation(whole=1, selective=1)
    got = grads_after(adapter, lambda: one_op_pass(pool, data, mixed))
    expected = grads_after(adapter, lambda: one_op_pass(pool, data, WHOLE))
    assert got.keys() == expected.keys() and expected
    for key, grad in expected.items():
        torch.testing.assert_close(got[key], grad, **CLOSE, msg=key)


class _RopeInPlace(torch.autograd.Function):
    """transformers' RoPE written into q and k themselves where they are contiguous, as liger's
    Triton kernel writes them: through `.data`, so no version counter sees it."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Any:
        ctx.save_for_backward(cos, sin)
        rotated_q, rotated_k = EAGER_ROPE(q, k, cos, sin)
        q_rows, k_rows = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        q_rows.data.copy_(rotated_q.transpose(1, 2))
        k_rows.data.copy_(rotated_k.transpose(1, 2))
        return q_rows.transpose(1, 2), k_rows.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> Any:
        cos, sin = ctx.saved_tensors
        return (*EAGER_ROPE(dq, dk, cos, -sin), None, None)  # the rotation back


def rope_in_place(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_: Any, **__: Any
) -> Any:
    return _RopeInPlace.apply(q, k, cos, sin)


def test_selective_layers_give_an_in_place_rotary_kernel_copies(models_dir: Path) -> None:
    """With q_proj and k_proj unadapted (train_attn=False), q and k are the projections' own
    outputs, which a selective layer keeps. A rotary kernel that rotates them in place where
    torch cannot see it (liger's) left the kept q and k rotated, and the recomputation rotated
    them again: the LoRA gradients came out wrong. Given copies (fused_kernels.rotating_copies,
    which the worker wraps liger's RoPE in), they equal the plain pass's."""
    pool, adapter = one_adapter(BASE, models_dir, LoraConfig(rank=4, train_attn=False), seed=0)
    data = [datum(t, weights=False) for t in TEXTS]

    def error(rope: Any) -> float:
        modeling_llama.apply_rotary_pos_emb = rope
        try:
            _, plain = backward_pass(pool, adapter, data, "off")
            _, selective = backward_pass(pool, adapter, data, "selective")
        finally:
            modeling_llama.apply_rotary_pos_emb = EAGER_ROPE
        assert plain.keys() == selective.keys() and plain
        return max(float((selective[k] - plain[k]).abs().max()) for k in plain)

    assert error(EAGER_ROPE) == 0.0
    assert error(rope_in_place) > 1e-3  # the hazard, shown
    assert error(rotating_copies(rope_in_place)) == 0.0


def test_only_liger_s_rotary_functions_are_given_copies() -> None:
    def liger_rope(q: torch.Tensor, k: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return q.mul_(2), k.mul_(2)

    liger_rope.__module__ = "liger_kernel.transformers.rope"
    modeling = SimpleNamespace(
        apply_rotary_pos_emb=liger_rope, apply_multimodal_rotary_pos_emb=EAGER_ROPE
    )
    rope_on_copies(modeling)
    assert modeling.apply_multimodal_rotary_pos_emb is EAGER_ROPE
    q, k = torch.ones(2, 3), torch.ones(2, 3)
    rotated_q, rotated_k = modeling.apply_rotary_pos_emb(q, k)
    assert torch.equal(q, torch.ones(2, 3)) and torch.equal(k, torch.ones(2, 3))
    assert torch.equal(rotated_q, torch.full((2, 3), 2.0)) and torch.equal(rotated_k, rotated_q)


MIXED = [
    "a long datum of many bytes, which sets the width",
    "tiny",
    "small one",
    "mid-size text",
    "x!",
    "another fairly long datum, not the longest",
]


def test_pack_rows_fits_every_datum_once_within_the_width() -> None:
    """First fit by decreasing length: every datum placed once, no row over the width, and
    short datums share rows."""
    lengths = [50, 3, 8, 12, 2, 41, 9]
    rows = pack_rows(lengths, 50)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 50 for row in rows)
    assert rows == [[0], [5, 6], [3, 2, 1, 4]]  # 125 tokens: three rows are the fewest
    assert padding_fraction([4, 4]) == 0.0 and padding_fraction([1, 3]) == pytest.approx(1 / 3)


def test_packed_rows_equal_one_datum_a_row(pool: AdapterPool) -> None:
    """Datums packed into shared rows (position ids restarting, block-diagonal attention) give
    the logprobs and LoRA gradients of one datum a row: no datum sees another."""
    adapter = pool.adapters["m0"]
    pool.activate(adapter)
    data = [datum(t) for t in MIXED]
    assert len(rows_for(data, CPU, PACKED).group_rows) == 1
    assert rows_for(data, CPU, PACKED).ids.shape[0] < len(data)  # really packed
    outs: dict[str, object] = {}

    def run(label: str, plan: PassPlan) -> object:
        def step() -> None:
            outs[label] = one_op_pass(pool, data, plan)

        return step

    assert_same(
        grads_after(adapter, run("packed", PACKED)), grads_after(adapter, run("unpacked", UNPACKED))
    )
    for got, want in zip(
        outs["packed"].loss_fn_outputs,  # type: ignore[attr-defined]
        outs["unpacked"].loss_fn_outputs,
        strict=True,
    ):  # type: ignore[attr-defined]
        torch.testing.assert_close(
            got["logprobs"].to_numpy(), want["logprobs"].to_numpy(), rtol=1e-5, atol=1e-5
        )


def test_packing_inside_a_cross_adapter_pass(pool: AdapterPool) -> None:
    """In a shared pass, each adapter's datums are packed into rows of their own (a row never
    mixes adapters): every adapter's gradient equals the unpacked pass."""
    data = {name: [datum(t) for t in MIXED[i:] + MIXED[:i]] for i, name in enumerate(pool.adapters)}

    expected = shared_pass_grads(pool, data, UNPACKED)
    got = shared_pass_grads(pool, data, PACKED)
    for name in pool.adapters:
        assert_same(got[name], expected[name])


def test_stacked_lora_gives_the_row_blocks_gradients(pool: AdapterPool) -> None:
    """A pass of four adapters' ops (ranks 4 and 2, one adapting the MLP and unembedding only)
    with their LoRA stacked gives every adapter the loss and gradients the row blocks give."""
    pool.add("narrow", "t", LoraConfig(rank=2, train_attn=False, train_unembed=True), seed=9)
    with torch.no_grad():
        for key, param in pool.adapters["narrow"].params.items():
            if "lora_B" in key:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(9))
    data = {
        "m0": [datum(TEXTS[0])],
        "m1": [datum(TEXTS[1]), datum(TEXTS[2])],
        "narrow": [datum(TEXTS[2])],
        "m2": [datum(TEXTS[0]), datum(TEXTS[1])],
    }
    blocks = [(name, len(rows)) for name, rows in data.items()]
    assert stacks(pool.lora_layers(), blocks)
    expected = shared_pass_grads(pool, data, replace(UNPACKED, lora_form="blocks"))
    got = shared_pass_grads(pool, data, replace(UNPACKED, lora_form="stacked"))
    for name in data:
        assert_same(got[name], expected[name])


def test_a_pass_of_several_adapters_groups_its_lora_where_it_can() -> None:
    """Where the plan does not say: grouped wherever the pass allows it, else stacked on CUDA
    (fewer launches) and row blocks on the CPU (fewer FLOPs); a form the plan asks for is
    followed where the pass allows it, the rule's otherwise."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = PassPlan()
    assert auto.lora_form_for(cpu, groups=True, stacks=True) == "grouped"
    assert auto.lora_form_for(cuda, groups=True, stacks=True) == "grouped"
    assert auto.lora_form_for(cuda, groups=False, stacks=True) == "stacked"
    assert auto.lora_form_for(cpu, groups=False, stacks=True) == "blocks"
    assert auto.lora_form_for(cuda, groups=False, stacks=False) == "blocks"
    blocks = PassPlan(lora_form="blocks")
    assert blocks.lora_form_for(cuda, groups=True, stacks=True) == "blocks"
    stacked = PassPlan(lora_form="stacked")
    assert stacked.lora_form_for(cpu, groups=True, stacks=True) == "stacked"
    assert stacked.lora_form_for(cpu, groups=True, stacks=False) == "grouped"
    grouped = PassPlan(lora_form="grouped")
    assert grouped.lora_form_for(cuda, groups=False, stacks=True) == "stacked"
    assert PassPlan.of(EngineConfig(lora_form="blocks")).lora_form == "blocks"
    assert PassPlan.of(EngineConfig()).lora_form is None  # auto: the rule


def test_a_pass_reads_its_numbers_from_the_device_once_after_backward(pool: AdapterPool) -> None:
    """No op's loss or metric is read back (a device sync on a GPU) before the backward is
    launched: the pass makes no scalar read at all, and its outputs, read in one piece at the
    end, are each datum's logprobs and the metrics losses.batch_loss gives for them. An op whose
    loss fails gets its error; the others their outputs."""
    from aten_calls import AtenCalls

    from queue_tinker.workers.training.losses import batch_loss

    def rl(text: str, seed: int) -> Datum:
        base = datum(text)
        n = len(base.loss_fn_inputs["target_tokens"].data)
        rng = np.random.default_rng(seed)
        inputs = {
            "target_tokens": np.asarray(base.loss_fn_inputs["target_tokens"].data),
            "logprobs": rng.uniform(-4, -1, n).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
        }
        return Datum(model_input=base.model_input, loss_fn_inputs=inputs)

    first, second = list(pool.adapters.values())[:2]
    ppo = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    ops = [
        PassOp(first, [rl(t, i) for i, t in enumerate(TEXTS)], LossFn.PPO, ppo, backward=True),
        PassOp(second, [datum(t) for t in TEXTS[:2]], LossFn.CROSS_ENTROPY, {}, backward=True),
        # ppo without its clip thresholds: this op's loss fails, the pass goes on
        PassOp(second, [rl(TEXTS[2], 9)], LossFn.PPO, {}, backward=False),
    ]
    with AtenCalls() as calls:
        outcomes = shared_pass(pool, ops, CPU, WHOLE)
    assert calls.reads == []
    assert isinstance(outcomes[2], KeyError)
    for op, out in zip(ops[:2], outcomes[:2], strict=True):
        assert isinstance(out, ForwardBackwardOutput), out
        name = op.adapter.name
        pool.activate(op.adapter)
        with torch.no_grad():
            want = whole_logits_logprobs(pool.model, list(op.data))
        got = [torch.from_numpy(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **CLOSE)
        inputs = [
            {k: torch.from_numpy(np.array(v.data, copy=True)) for k, v in d.loss_fn_inputs.items()}
            for d in op.data
        ]
        _, metrics = batch_loss(op.loss_fn.value, got, inputs, op.config)
        assert out.metrics.keys() == metrics.keys(), name
        assert out.metrics == pytest.approx(metrics, rel=1e-5), name
    assert {"ratio:mean", "clip_fraction:mean"} <= outcomes[0].metrics.keys()  # type: ignore[union-attr]


@pytest.mark.parametrize("loss_fn", [LossFn.PPO, LossFn.GSPO])
def test_a_built_in_loss_launches_as_many_kernels_for_many_datums_as_for_few(
    pool: AdapterPool, loss_fn: LossFn
) -> None:
    """An op of a built-in loss takes it over all its datums' tokens at once: a pass of 32
    equal datums runs as many aten ops, forward and backward, as a pass of 4 (a GPU launches a
    kernel each; an RL op of 64 datums once launched some 2,500 more for its loss). With
    inputs that differ between datums (weights on every other one) the loss runs datum by
    datum and the count grows with them: the count sees the difference."""
    from aten_calls import AtenCalls

    base = datum(TEXTS[0])
    n = len(base.loss_fn_inputs["target_tokens"].data)
    rng = np.random.default_rng(0)
    rl = Datum(
        model_input=base.model_input,
        loss_fn_inputs={
            "target_tokens": np.asarray(base.loss_fn_inputs["target_tokens"].data),
            "logprobs": rng.uniform(-4, -1, n).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
        },
    )
    adapter = next(iter(pool.adapters.values()))
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

    weighted = Datum(
        model_input=rl.model_input,
        loss_fn_inputs={**rl.loss_fn_inputs, "weights": np.ones(n, np.float32)},
    )

    def ops_of(datums: int, mixed: bool = False) -> int:
        data = [weighted if mixed and i % 2 else rl for i in range(datums)]
        op = PassOp(adapter, data, loss_fn, config, backward=True)
        with AtenCalls() as calls:
            (out,) = shared_pass(pool, [op], CPU, UNPACKED)
        assert isinstance(out, ForwardBackwardOutput), out
        return calls.count

    ops_of(4)  # a first pass also counts one-off set-up
    assert ops_of(32) == ops_of(4)
    assert ops_of(32, mixed=True) > ops_of(4, mixed=True) + 28 * 4


@pytest.mark.parametrize("loss_fn", [LossFn.PPO, LossFn.GSPO])
def test_a_joined_loss_equals_the_datum_by_datum_one(pool: AdapterPool, loss_fn: LossFn) -> None:
    """The same op with every datum sending the same inputs (the loss over all tokens at once)
    and with one datum's weights of ones left out, the others' kept (datum by datum): equal
    losses, metrics, logprobs and gradients."""
    from queue_tinker.workers.training.shared_pass import op_loss_inputs

    def rl(text: str, seed: int, weights: bool) -> Datum:
        base = datum(text, weights=weights)
        n = len(base.loss_fn_inputs["target_tokens"].data)
        rng = np.random.default_rng(seed)
        inputs = {
            **{k: np.asarray(v.data) for k, v in base.loss_fn_inputs.items()},
            "logprobs": rng.uniform(-4, -1, n).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
        }
        return Datum(model_input=base.model_input, loss_fn_inputs=inputs)

    joined = [rl(t, i, weights=True) for i, t in enumerate(TEXTS)]
    ones = np.ones(len(joined[1].loss_fn_inputs["target_tokens"].data), np.float32)
    unweighted = rl(TEXTS[1], 1, weights=False)
    # datum 1's weights, all ones where the joined op's are not: give it the joined op's own
    joined[1] = Datum(
        model_input=joined[1].model_input,
        loss_fn_inputs={**joined[1].loss_fn_inputs, "weights": ones},
    )
    per_datum = [joined[0], unweighted, joined[2]]
    assert op_loss_inputs(joined, CPU).joined is not None
    assert op_loss_inputs(per_datum, CPU).joined is None
    adapter = next(iter(pool.adapters.values()))
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    results = []
    for data in (joined, per_datum):
        op = PassOp(adapter, data, loss_fn, config, backward=True)
        (out,) = shared_pass(pool, [op], CPU, SMALL_CHUNKS)
        assert isinstance(out, ForwardBackwardOutput), out
        grads = {k: p.grad.clone() for k, p in adapter.params.items() if p.grad is not None}
        for p in adapter.params.values():
            p.grad = None
        results.append((out, grads))
    (a, a_grads), (b, b_grads) = results
    assert a.metrics == pytest.approx(b.metrics, rel=1e-5)
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(x["logprobs"].to_numpy(), y["logprobs"].to_numpy())
    assert a_grads.keys() == b_grads.keys() and a_grads
    for key in a_grads:
        torch.testing.assert_close(a_grads[key], b_grads[key], **CLOSE)


def test_an_ops_loss_inputs_go_over_together_and_come_out_as_each_datum_sent_them() -> None:
    """op_loss_inputs: each datum gets its own inputs back, values and dtype as sent, whether
    or not the other datums have the same names (no weights for one datum, advantages for
    another alone), cut from one copy per name and dtype."""
    from queue_tinker.workers.training.shared_pass import op_loss_inputs

    data = [datum(t) for t in TEXTS]
    data[1] = datum(TEXTS[1], weights=False)
    n = len(data[2].loss_fn_inputs["target_tokens"].data)
    data[2] = Datum(
        model_input=data[2].model_input,
        loss_fn_inputs={
            **{k: np.asarray(v.data) for k, v in data[2].loss_fn_inputs.items()},
            "advantages": np.linspace(-1, 1, n).astype(np.float32),
        },
    )
    got = op_loss_inputs(data, CPU)
    assert got.joined is None  # the datums' names differ
    for d, inputs in zip(data, got.per_datum, strict=True):
        assert inputs.keys() == d.loss_fn_inputs.keys()
        for key, value in d.loss_fn_inputs.items():
            sent = np.asarray(value.data)
            assert inputs[key].dtype == torch.from_numpy(sent).dtype, key
            np.testing.assert_array_equal(inputs[key].numpy(), sent)


def pass_outputs(
    pool: AdapterPool, ops: list[PassOp], plan: PassPlan
) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    """Each op's loss and every adapter's gradient after one shared pass of the ops."""
    for adapter in pool.adapters.values():
        for p in adapter.params.values():
            p.grad = None
    outs = shared_pass(pool, ops, CPU, plan)
    assert all(isinstance(out, ForwardBackwardOutput) for out in outs), outs
    losses = [float(out.metrics["loss:sum"]) for out in outs]  # type: ignore[union-attr]
    grads = {
        name: {k: p.grad.clone() for k, p in adapter.params.items() if p.grad is not None}
        for name, adapter in pool.adapters.items()
    }
    return losses, grads


@pytest.mark.parametrize(
    "plan",
    [UNPACKED, PACKED, CHECKPOINTED, SELECTIVE],
    ids=["rows", "packed", "ckpt", "selective"],
)
def test_grouped_lora_gives_the_row_blocks_losses_and_gradients(
    pool: AdapterPool, plan: PassPlan
) -> None:
    """Ops of three adapters out of slot order, one adapter's ops apart (m2, m0, m1, m2), in
    one grouped pass: every op's loss and every adapter's gradients are the row blocks'
    (fp32, 1e-5), packed, unpacked and with layers recomputed (whole or selectively, the
    logits in many chunks: each layer's stacks cast once a pass serve every call of it); the
    ops' outputs come back in their order."""
    adapters = pool.adapters
    names = ["m2", "m0", "m1", "m2"]
    ops = [
        PassOp(adapters[name], [datum(TEXTS[i % 3]), datum(TEXTS[(i + 1) % 3])],
               LossFn.CROSS_ENTROPY, {}, backward=True)
        for i, name in enumerate(names)
    ]  # fmt: skip
    assert lora_form(pool, ops, CPU, plan) == "grouped"
    want_losses, want = pass_outputs(pool, ops, replace(plan, lora_form="blocks"))
    losses, got = pass_outputs(pool, ops, plan)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for name in adapters:
        assert_same(got[name], want[name])


def test_grouped_stacks_are_the_adapters_weights(pool: AdapterPool) -> None:
    """After a grouped pass each adapter's LoRA weights are views of its slot in the stacks:
    an optimizer step moves them there (the next grouped pass equals the row blocks after
    the step), a checkpoint's weights load into them, and a newcomer's arrival restacks
    without changing anyone's weights; a removed adapter's slot goes at the next restack."""
    adapters = list(pool.adapters.values())
    ops = [PassOp(a, [datum(TEXTS[0])], LossFn.CROSS_ENTROPY, {}, backward=True) for a in adapters]
    pass_outputs(pool, ops, UNPACKED)
    assert set(pool.lora_stacks.names) == {a.name for a in adapters}

    def stacked(adapter: Adapter) -> bool:
        """Every LoRA weight of the adapter lives in a stack's storage."""
        storages = {
            stack.untyped_storage().data_ptr()
            for layer in pool.lora_stacks.layers.values()
            for stack in (layer.a, layer.b)
        }
        return all(p.untyped_storage().data_ptr() in storages for p in adapter.params.values())

    assert all(stacked(a) for a in adapters)
    for adapter in adapters:
        adapter.optimizer.step()
    _, after_blocks = pass_outputs(pool, ops, replace(UNPACKED, lora_form="blocks"))
    _, after_grouped = pass_outputs(pool, ops, UNPACKED)
    for model_id in pool.adapters:
        assert_same(after_grouped[model_id], after_blocks[model_id])

    first = adapters[0]
    saved = {k: p.detach().clone() for k, p in first.params.items()}
    with torch.no_grad():
        for p in first.params.values():
            p.mul_(0.5)
    pool.load_weights(first, saved)
    assert stacked(first)
    assert all(torch.equal(first.params[k], saved[k]) for k in saved)

    before = {a.name: {k: p.detach().clone() for k, p in a.params.items()} for a in adapters}
    newcomer = pool.add("m3", "t", LoraConfig(rank=4, train_unembed=True), seed=3)
    ops.append(PassOp(newcomer, [datum(TEXTS[1])], LossFn.CROSS_ENTROPY, {}, backward=True))
    pass_outputs(pool, ops, UNPACKED)
    gone = adapters[-1]
    pool.remove(gone.model_id)
    ops = [op for op in ops if op.adapter is not gone]
    pool.add("m4", "t", LoraConfig(rank=4, train_unembed=True), seed=4)
    ops.append(PassOp(pool.adapters["m4"], [datum(TEXTS[2])], LossFn.CROSS_ENTROPY, {}, True))
    pass_outputs(pool, ops, UNPACKED)
    assert gone.name not in pool.lora_stacks.names  # a removed adapter's slot goes
    survivors = [*adapters[:-1], newcomer, pool.adapters["m4"]]
    assert all(a.name in pool.lora_stacks.names and stacked(a) for a in survivors)
    for adapter in adapters[:-1]:
        assert all(torch.equal(adapter.params[k], v) for k, v in before[adapter.name].items())


def test_adapters_of_different_ranks_in_one_layer_take_the_row_blocks(
    pool: AdapterPool, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass whose adapters differ in rank in a layer cannot share a stack there: the pass
    runs its LoRA in row blocks (the CPU's form without grouping), and the log says why."""
    pool.add("wide", "t", LoraConfig(rank=8, train_unembed=True), seed=11)
    ops = [
        PassOp(pool.adapters[name], [datum(TEXTS[0])], LossFn.CROSS_ENTROPY, {}, backward=True)
        for name in ("m0", "wide")
    ]
    with caplog.at_level(logging.DEBUG, logger="queue_tinker.workers.training.shared_pass"):
        assert lora_form(pool, ops, CPU, UNPACKED) == "blocks"
    assert "runs their LoRA blocks (not groupable: mixed ranks" in caplog.text


def test_grouped_passes_of_other_ranks_restack_without_the_old_adapters(
    pool: AdapterPool,
) -> None:
    """A grouped pass of two rank-8 adapters after one of the rank-4 ones: the stacks drop the
    adapters of the other rank (they cannot share a layer's stack) and the pass gives the row
    blocks' gradients; the rank-4 adapters group again after it."""
    for i in range(2):
        pool.add(f"w{i}", "t", LoraConfig(rank=8, train_unembed=True), seed=20 + i)

    def ops_of(names: list[str]) -> list[PassOp]:
        return [
            PassOp(pool.adapters[n], [datum(TEXTS[i])], LossFn.CROSS_ENTROPY, {}, backward=True)
            for i, n in enumerate(names)
        ]

    for names in (["m0", "m1"], ["w0", "w1"], ["m1", "m2"]):
        ops = ops_of(names)
        assert lora_form(pool, ops, CPU, UNPACKED) == "grouped"
        _, want = pass_outputs(pool, ops, replace(UNPACKED, lora_form="blocks"))
        _, got = pass_outputs(pool, ops, UNPACKED)
        for name in names:
            assert_same(got[name], want[name])
        stacked = {pool.adapters[n].name for n in names}
        assert stacked <= set(pool.lora_stacks.names)
    assert not {pool.adapters[n].name for n in ("w0", "w1")} & set(pool.lora_stacks.names)
