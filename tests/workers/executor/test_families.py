"""The LoRA engine on each family's tiny built-in that tiny-llama's and tiny-moe's tests do not
cover: Qwen3 dense, gpt-oss (sinks, a sliding-window layer, experts), DeepSeek-V3 (latent
attention, shared + routed experts), Qwen3.5 (linear-attention layers with a recurrent state) and
Qwen3-VL on text (its images: test_vision_language.py).

References come from outside the engine: transformers' eager model with PEFT's own forward on
the engine's adapter weights, in fp32; the same requests sampled alone; the padded step.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_driver import BatchDriver, datum, fb_body, rl_datum, run_op
from peft import get_peft_model

from queue_tinker.queue.dispatch.dispatcher import Op
from queue_tinker.types import OpKind, codec
from queue_tinker.types.enums import BUILT_IN_LOSSES, LossFn
from queue_tinker.types.requests.sampling import SampleInput, SamplingParams
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.types.tensors import Datum, ModelInput
from queue_tinker.workers.interface import OpResult
from queue_tinker.workers.model.adapters import (
    expert_parameters,
    linear_names,
    native_targets,
    peft_config,
)
from queue_tinker.workers.model.base_model import load_base_model
from queue_tinker.workers.model.families import family_of

BUILTINS = (
    "queue-tinker/tiny-qwen3",
    "queue-tinker/tiny-gpt-oss",
    "queue-tinker/tiny-deepseek-v3",
    "queue-tinker/tiny-qwen3.5",
    "queue-tinker/tiny-qwen3-vl",
)
TEXTS = ["hello lora world", "the quick brown fox jumps", "queue tinker!"]


@pytest.fixture(scope="module", params=BUILTINS, ids=lambda name: name.split("/")[1])
def family(request: pytest.FixtureRequest, root: Path) -> BatchDriver:
    name = request.param
    return BatchDriver(root, name.split("/")[1], base=name, max_resident_adapters=64)


def reference(driver: BatchDriver, root: Path, config: LoraConfig) -> torch.nn.Module:
    """transformers' eager model (eager attention, its loop over experts) with PEFT's forward,
    holding the engine's adapter weights."""
    base = load_base_model(driver.base, "cpu", root / "models")
    base.eval()
    base.config._attn_implementation = "eager"
    base.config._experts_implementation = "eager"
    family = family_of(base.config)
    cfg = peft_config(linear_names(base), config, driver.base, family, expert_parameters(base))
    with warnings.catch_warnings(), native_targets():
        warnings.simplefilter("ignore")
        peft = get_peft_model(base, cfg, adapter_name="ref")
    return peft


def test_logprobs_and_lora_gradients_equal_transformers_and_peft(
    family: BatchDriver, root: Path
) -> None:
    """After one step (B nonzero): forward's logprobs equal the reference's to 1e-5, and every
    LoRA matrix's gradient (experts' too) equals PEFT autograd's to 1e-4."""
    config = LoraConfig(rank=4, seed=3)
    family.create("ref", config)
    data = [datum(text) for text in TEXTS]
    out = run_op(family.engine, family.make("ref", OpKind.FORWARD, fb_body(data)))
    logprobs = [
        np.asarray(o["logprobs"]["data"]) for o in codec.decode(out.result)["loss_fn_outputs"]
    ]
    family.engine.execute(family.make("ref", OpKind.FORWARD_BACKWARD, fb_body(data)))
    state = family.state("ref")

    peft = reference(family, root, config)
    params = dict(peft.named_parameters())
    assert {k.replace(".ref.", ".") for k in params if ".ref." in k} == state.weights.keys()
    # Every linear of an MLP has its LoRA, a dense layer's and a shared expert's too.
    mlp = [
        name
        for name, module in peft.get_base_model().named_modules()
        if name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")
        and hasattr(module, "lora_A")
    ]
    linears = linear_names(load_base_model(family.base, "cpu", root / "models"))
    layers = peft.get_base_model().config.get_text_config().num_hidden_layers
    assert len(mlp) == 3 * layers or "gate_proj" not in linears
    for name in mlp:
        assert f"base_model.model.{name}.lora_A.weight" in state.weights, name
    with torch.no_grad():
        for key, value in state.weights.items():
            params[key.replace(".weight", ".ref.weight")].copy_(value)
    total = torch.zeros(())
    for d, ours in zip(data, logprobs, strict=True):
        ids = torch.tensor([d.model_input.to_ints()])
        targets = torch.as_tensor(np.array(d.loss_fn_inputs["target_tokens"].data))
        theirs = peft(input_ids=ids).logits[0].log_softmax(-1).gather(1, targets[:, None])[:, 0]
        np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-5, atol=1e-5)
        total = total - theirs.sum()
    total.backward()
    assert state.grads
    for key, grad in state.grads.items():
        want = params[key.replace(".weight", ".ref.weight")].grad
        assert want is not None and float(want.abs().max()) > 0, key
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_every_built_in_loss_trains_and_a_saved_state_loads_back(family: BatchDriver) -> None:
    """Each built-in loss gives a finite loss and a step that moves the weights; save_state
    then load_state into a new model restores them exactly."""
    family.create("losses", LoraConfig(rank=4, seed=8))
    for loss_fn in BUILT_IN_LOSSES:
        data = [datum("plain targets")] if loss_fn is LossFn.CROSS_ENTROPY else [rl_datum("rl", 9)]
        before = family.weights("losses")
        out = family.engine.execute(
            family.make("losses", OpKind.FORWARD_BACKWARD, fb_body(data, loss_fn.value))
        )
        assert np.isfinite(codec.decode(out.result)["metrics"]["loss:sum"]), loss_fn
        run_op(family.engine, family.make("losses", OpKind.OPTIM_STEP, {"learning_rate": 1e-2}))
        after = family.weights("losses")
        assert any(not torch.equal(after[k], before[k]) for k in before), loss_fn
    saved = run_op(
        family.engine,
        family.make("losses", OpKind.SAVE_STATE, {"name": "s", "ttl_seconds": None}),
    )
    family.create("loaded", LoraConfig(rank=4, seed=9))
    path = codec.decode(saved.result)["path"]
    run_op(
        family.engine,
        family.make("loaded", OpKind.LOAD_STATE, {"path": path, "optimizer": True}),
    )
    torch.testing.assert_close(family.weights("loaded"), family.weights("losses"), rtol=0, atol=0)


def sample_ops(driver: BatchDriver, name: str) -> list[SampleInput]:
    """Two seeded requests of different prompt lengths on one saved checkpoint."""
    driver.create(name, LoraConfig(rank=4, seed=21))
    saved = driver.engine.execute(
        driver.make(name, OpKind.SAVE_WEIGHTS_FOR_SAMPLER, {"name": "w", "ttl_seconds": None})
    )
    path = codec.decode(saved.result)["path"]
    return [
        SampleInput(
            prompt=ModelInput.from_ints(list(prompt.encode())),
            num_samples=2,
            model_path=path,
            sampling_params=SamplingParams(max_tokens=10, seed=seed, stop=[], temperature=1.0),
        )
        for seed, prompt in enumerate(["Q: 2+2?\nA:", "hi"])
    ]


def assert_same_samples(got: OpResult, want: OpResult, tokens: int | None = None) -> None:
    """Two sample responses hold the same sequences: the same tokens (`tokens` of them each,
    where given), logprobs to 1e-5."""
    ours, theirs = codec.decode(got.result), codec.decode(want.result)
    for a, b in zip(ours["sequences"], theirs["sequences"], strict=True):
        assert a["tokens"] == b["tokens"] and len(a["tokens"]) == (tokens or len(b["tokens"]))
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)


def assert_each_as_alone(
    family: BatchDriver,
    ops: list[Op],
    bodies: list[SampleInput],
    together: dict[str, OpResult | Exception],
) -> None:
    """Each op's response from a shared loop is what its request, sampled again alone,
    returns: every one of its max_tokens (no stop: none ends early)."""
    for op, body in zip(ops, bodies, strict=True):
        result = together[op.job_id]
        assert isinstance(result, OpResult), result
        alone = run_op(family.engine, family.make(op.model_id, OpKind.SAMPLE, body.model_dump()))
        assert_same_samples(result, alone, body.sampling_params.max_tokens)


def test_samples_sharing_steps_equal_each_alone(family: BatchDriver) -> None:
    """Two requests of different prompt lengths in one loop (the shorter left-padded; in
    Qwen3.5 the padding runs through its recurrent layers) return the seeded tokens and the
    logprobs each returns alone."""
    bodies = sample_ops(family, "smp")
    ops = [
        family.make(f"sess{i}", OpKind.SAMPLE, body.model_dump()) for i, body in enumerate(bodies)
    ]
    engine = family.engine
    engine.sampling.join(ops)
    together: dict[str, OpResult | Exception] = {}
    while engine.sampling.stepping():
        together.update((op.job_id, out) for op, out in engine.sampling.step(budget_s=0.0))
    assert_each_as_alone(family, ops, bodies, together)


# The families whose decode steps run on slots (slot_decode.slots_fit): plain KV in every
# layer, full attention, no experts' wrappers, one axis of positions.
ON_SLOTS = {"queue-tinker/tiny-qwen3"}


def test_the_slot_step_samples_what_the_padded_step_samples(family: BatchDriver) -> None:
    """The same seeded requests on a worker that decodes on slots (QT_DECODE_STEP=slots) give
    the padded step's tokens and logprobs; a family the slots cannot take decodes padded
    there, and says so by leaving the slots empty."""
    slots = BatchDriver(
        family.storage.parent,
        f"{family.storage.name}-slots",
        base=family.base,
        decode_step="slots",
    )
    bodies = sample_ops(family, "kinds")
    assert sample_ops(slots, "kinds") == bodies  # the same checkpoint, made on each worker
    for i, body in enumerate(bodies):
        padded = run_op(family.engine, family.make(f"p{i}", OpKind.SAMPLE, body.model_dump()))
        slotted = run_op(slots.engine, slots.make(f"s{i}", OpKind.SAMPLE, body.model_dump()))
        assert_same_samples(slotted, padded)
    decoder = slots.engine.sampling._loop_of().slots
    assert decoder is not None
    assert (decoder.kv is not None) is (family.base in ON_SLOTS)


@pytest.mark.parametrize("first", [0, 1], ids=["longer-first", "shorter-first"])
def test_a_request_joining_running_rows_samples_what_it_samples_alone(
    family: BatchDriver, first: int
) -> None:
    """A second request joins while the first decodes (the narrower side left-padded;
    Qwen3.5's linear-attention states appended by row; gpt-oss's sliding-window layer joined
    by its window of the newest columns, past which the 11-token prompt already is and the
    2-token one goes): both return the seeded tokens and logprobs each returns alone, and the
    second shares the first's steps on every family."""
    bodies = sample_ops(family, f"join{first}")
    bodies = [bodies[first], bodies[1 - first]]
    ops = [
        family.make(f"late{first}{i}", OpKind.SAMPLE, b.model_dump()) for i, b in enumerate(bodies)
    ]
    engine = family.engine
    engine.sampling.join(ops[:1])
    together: dict[str, OpResult | Exception] = {}
    for _ in range(3):  # the first request's prefill and two decode steps
        together.update((op.job_id, out) for op, out in engine.sampling.step(budget_s=0.0))
    engine.sampling.join(ops[1:])
    widest = 0
    while engine.sampling.stepping():
        together.update((op.job_id, out) for op, out in engine.sampling.step(budget_s=0.0))
        widest = max(widest, engine.sampling._loop_of().step_rows)
    assert widest == 4  # 2 samples each
    assert_each_as_alone(family, ops, bodies, together)


def test_a_kept_prompt_is_reused_whole_and_as_the_start_of_a_longer_one(
    family: BatchDriver,
) -> None:
    """The prefix cache keeps every family's prompts: Qwen3.5's linear-attention states and
    gpt-oss's sliding windows as they stand at the prompt's end, key / value layers whole. A
    prompt seen before joins from it (every token a hit), a prompt that begins with it
    prefills only the rest (11 tokens: no whole block, its end is what is found); both
    sample what they sample with nothing kept."""
    prompt = list(b"Q: 2+2?\nA:")
    [body, *_] = sample_ops(family, "kept")
    longer = [*prompt, *b" 4\nQ: 3+3?\nA:"]

    def sampled(tokens: list[int], seed: int) -> tuple[OpResult, dict[str, Any]]:
        again = body.model_copy(
            update={
                "prompt": ModelInput.from_ints(tokens),
                "sampling_params": body.sampling_params.model_copy(update={"seed": seed}),
            }
        )
        out = run_op(family.engine, family.make("kept", OpKind.SAMPLE, again.model_dump()))
        return out, codec.decode(out.result)

    prompts = family.engine.sampling._loop_of().prompts
    prompts.clear()
    assert sampled(prompt, 0)[1]["prompt_cache_hit_tokens"] == 0
    whole, whole_body = sampled(prompt, 1)
    start, start_body = sampled(longer, 2)
    assert whole_body["prompt_cache_hit_tokens"] == len(prompt)
    assert start_body["prompt_cache_hit_tokens"] == len(prompt)
    for tokens, seed, kept in ((prompt, 1, whole), (longer, 2, start)):
        prompts.clear()
        fresh, fresh_body = sampled(tokens, seed)
        assert fresh_body["prompt_cache_hit_tokens"] == 0
        assert_same_samples(kept, fresh, body.sampling_params.max_tokens)


def test_a_long_prompt_goes_in_kept_chunks_while_rows_decode(family: BatchDriver) -> None:
    """While a request decodes, a prompt over the step's prefill budget is prefilled a chunk
    of whole blocks a step, each on top of the kept one before (Qwen3.5's states and gpt-oss's
    windows as they stand at the chunk's end), then joins; both requests sample what they
    sample alone with nothing kept."""
    short, _ = sample_ops(family, "chunks")
    document = list((b"a long document to read before answering. " * 2)[:80])
    long = short.model_copy(update={"prompt": ModelInput.from_ints(document)})
    ops = [
        family.make(f"chunked{i}", OpKind.SAMPLE, b.model_dump())
        for i, b in enumerate([short, long])
    ]
    engine = family.engine
    loop = engine.sampling._loop_of()
    loop.prompts.clear()
    engine.sampling.join(ops[:1])
    together: dict[str, OpResult | Exception] = {}
    for _ in range(2):  # the short request's prefill and a decode step
        together.update((op.job_id, out) for op, out in engine.sampling.step(budget_s=0.0))
    budget, loop.admission.prefill_tokens = loop.admission.prefill_tokens, 40  # chunks of 32
    try:
        engine.sampling.join(ops[1:])
        prefilled = []
        while engine.sampling.stepping():
            before = loop.prefilled_tokens
            together.update((op.job_id, out) for op, out in engine.sampling.step(budget_s=0.0))
            prefilled.append(loop.prefilled_tokens - before)
    finally:
        loop.admission.prefill_tokens = budget
    assert prefilled[:3] == [32, 32, 16]
    loop.prompts.clear()
    assert_each_as_alone(family, ops, [short, long], together)


def test_an_architecture_no_family_declares_trains_and_samples(root: Path) -> None:
    """A checkpoint of an architecture the registry has no family for (Phi-3's fused qkv_proj
    and gate_up_proj) is served by the generic one: its fused linears adapted, the loss
    falls, its weights sample."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from queue_tinker.builtin_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, write_tokenizer
    from queue_tinker.workers.model.families import GENERIC

    config = AutoConfig.for_model(
        "phi3",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    assert family_of(config) is GENERIC
    torch.manual_seed(0)
    path = root / "phi3-checkpoint"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    write_tokenizer(path)
    driver = BatchDriver(root, "phi3", base=str(path))
    driver.create("m", LoraConfig(rank=4, seed=1))
    adapted = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in driver.weights("m")}
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    data = [datum(text) for text in TEXTS]
    losses = []
    for _ in range(10):
        out = run_op(driver.engine, driver.make("m", OpKind.FORWARD_BACKWARD, fb_body(data)))
        losses.append(codec.decode(out.result)["metrics"]["loss:sum"])
        run_op(driver.engine, driver.make("m", OpKind.OPTIM_STEP, {"learning_rate": 2e-2}))
    assert losses[-1] < 0.8 * losses[0], losses
    (body, _) = sample_ops(driver, "phi3-samples")
    sampled = run_op(driver.engine, driver.make("s", OpKind.SAMPLE, body.model_dump()))
    assert [len(s["tokens"]) for s in codec.decode(sampled.result)["sequences"]] == [10, 10]


def test_sampled_logprobs_are_what_a_forward_pass_scores(family: BatchDriver) -> None:
    """The logprobs a sample returns for its tokens equal a forward pass's over the prompt and
    those tokens with the same weights (the trainer's path: the whole sequence at once, the
    model's own masks, a sliding window's included), past gpt-oss's window of 8."""
    (body, _) = sample_ops(family, "scored")
    sampled = run_op(family.engine, family.make("scored-s", OpKind.SAMPLE, body.model_dump()))
    prompt = body.prompt.to_ints()
    for sequence in codec.decode(sampled.result)["sequences"]:
        tokens = prompt + sequence["tokens"]
        scored = Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)},
        )
        out = run_op(family.engine, family.make("scored", OpKind.FORWARD, fb_body([scored])))
        (output,) = codec.decode(out.result)["loss_fn_outputs"]
        forward = np.asarray(output["logprobs"]["data"])[len(prompt) - 1 :]
        np.testing.assert_allclose(sequence["logprobs"], forward, rtol=1e-4, atol=1e-4)
