"""The training and sampling engine on CUDA, engine-level (no Redis, no Postgres): bf16 results
within tolerance of the fp32 CPU reference, AdamW equal to torch's, sampling, checkpoints that
move between devices, cross-adapter passes, out-of-memory recovery and memory budgets; the
mixture-of-experts and vision-language built-ins on CUDA.

Skipped, with the reason, where torch sees no CUDA device. On a GPU machine:
    python -m pytest -c tests/gpu/pytest.ini tests/gpu
A dry run on the CPU, before a GPU is lent (what only CUDA does is skipped):
    GPU_TESTS_DEVICE=cpu python -m pytest -c tests/gpu/pytest.ini tests/gpu
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import DeviceMemoryError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.requests.sampling import SamplingParams
from queue_tinker.types.requests.training import AdamParams, ForwardBackwardInput, LoraConfig
from queue_tinker.types.service.ops import Op
from queue_tinker.types.tensors import Datum, EncodedTextChunk, ImageChunk, ModelInput
from queue_tinker.workers.executor.lora import LoraExecutor
from queue_tinker.workers.interface import OpResult

# The device under test: CUDA, or the CPU for a dry run of the tests (not of their figures).
DEVICE = os.environ.get("GPU_TESTS_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="needs a CUDA device (torch.cuda.is_available() is False)",
    ),
]

# What only CUDA does (bf16 kernels, its allocator's out-of-memory, its free memory): skipped in
# a dry run on the CPU.
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="checks what only CUDA does")

BASE = "queue-tinker/llama-100m"
MOE, VL = "queue-tinker/tiny-moe", "queue-tinker/tiny-vl"
QWEN3_VL = "queue-tinker/tiny-qwen3-vl"
# Every family's tiny built-in beyond tiny-llama's family (docs/architecture.md, families/).
FAMILY_BUILT_INS = (
    MOE,
    VL,
    "queue-tinker/tiny-qwen3",
    "queue-tinker/tiny-gpt-oss",
    "queue-tinker/tiny-deepseek-v3",
    "queue-tinker/tiny-qwen3.5",
    QWEN3_VL,
)
ADAM = AdamParams(learning_rate=1e-3)
LOSS_RTOL = 2e-2  # bf16: 8 significant bits, through 12 layers and a sum over tokens
GRAD_RTOL = 0.1


def data(rows: int, tokens: int, seed: int) -> list[Datum]:
    ids = np.random.default_rng(seed).integers(0, 256, (rows, tokens + 1))
    return [
        Datum(
            model_input=ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:].astype(np.int64)},
        )
        for row in ids
    ]


class Run:
    """One model on one engine, driven op by op as its queue would."""

    def __init__(
        self, engine: LoraExecutor, model_id: str, seed: int = 1, base: str = BASE
    ) -> None:
        self.engine, self.model_id, self.seq = engine, model_id, 0
        self.op(
            OpKind.CREATE_MODEL,
            {
                "lora_config": LoraConfig(rank=32 if base == BASE else 8, seed=seed).model_dump(),
                "tenant_id": "t",
                "base_model": base,
            },
        )

    def make(self, kind: OpKind, body: Any) -> Op:
        self.seq += 1
        return Op(
            job_id=f"{self.model_id}:{self.seq}",
            model_id=self.model_id,
            seq=self.seq,
            kind=kind,
            payload=codec.encode(body),
        )

    def op(self, kind: OpKind, body: Any) -> Any:
        op = self.make(kind, body)
        if not self.engine.rules.stepped(op):
            return codec.decode(self.engine.execute(op).result)
        self.engine.sampling.join([op])  # a sample, as the worker runs it: stepped to its end
        (finished,) = self.engine.sampling.step(float("inf"))
        assert isinstance(finished[1], OpResult), finished[1]
        return codec.decode(finished[1].result)

    def fb_op(self, batch: list[Datum]) -> Op:
        body = ForwardBackwardInput(data=batch, loss_fn="cross_entropy").model_dump()
        return self.make(OpKind.FORWARD_BACKWARD, body)

    def forward_backward(self, batch: list[Datum]) -> float:
        out = codec.decode(self.engine.execute(self.fb_op(batch)).result)
        return float(out["metrics"]["loss:sum"])

    @property
    def adapter(self) -> Any:
        return self.engine.pool.adapters[self.model_id]

    def grads(self) -> dict[str, torch.Tensor]:
        return {k: p.grad.detach().float().cpu() for k, p in self.adapter.params.items()}


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="qt-gpu-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cuda(scratch: Path) -> LoraExecutor:
    return LoraExecutor(BASE, DEVICE, scratch / "storage", scratch / "models")


@pytest.fixture(scope="module")
def cpu(scratch: Path) -> LoraExecutor:
    """The fp32 reference, on the same storage (checkpoints move between them)."""
    return LoraExecutor(
        BASE, "cpu", scratch / "storage", scratch / "models", EngineConfig(dtype="fp32")
    )


def same_weights(into: Run, source: Run) -> None:
    with torch.no_grad():
        for key, param in into.adapter.params.items():
            param.copy_(source.adapter.params[key])


def sampled_twice(
    engine: LoraExecutor,
    session: dict[str, Any],
    prompt: ModelInput,
    num_samples: int,
    params: SamplingParams,
) -> list[dict[str, Any]]:
    """A sampling session (`session`: its create body) asked the same seeded sample twice:
    its sequences, shown equal the second time, each with tokens, all in the model's
    vocabulary, and finite logprobs."""
    run = Run.__new__(Run)
    run.engine, run.model_id, run.seq = engine, f"session-{uuid.uuid4().hex[:8]}", 0
    run.op(OpKind.CREATE_SAMPLING_SESSION, session)
    body = {
        "prompt": prompt.model_dump(),
        "num_samples": num_samples,
        "sampling_params": params.model_dump(),
    }
    first, second = (run.op(OpKind.SAMPLE, body) for _ in range(2))
    assert first["sequences"] == second["sequences"]
    sequences: list[dict[str, Any]] = first["sequences"]
    for sequence in sequences:
        assert len(sequence["tokens"]) > 0 and all(np.isfinite(sequence["logprobs"]))
        assert all(0 <= t < engine.limits.vocab_size for t in sequence["tokens"])
    return sequences


@cuda_only
def test_cuda_runs_bf16_base_with_fp32_adapters(cuda: LoraExecutor) -> None:
    """auto on CUDA: the base in bf16, the adapter's weights and moments fp32, on the GPU."""
    run = Run(cuda, "dtypes")
    run.forward_backward(data(2, 64, 0))
    run.op(OpKind.OPTIM_STEP, ADAM.model_dump())
    assert {p.dtype for n, p in cuda.pool.base.named_parameters() if "lora_" not in n} == {
        torch.bfloat16
    }
    assert {(p.dtype, p.device.type) for p in run.adapter.params.values()} == {
        (torch.float32, "cuda")
    }


def test_forward_backward_on_cuda_matches_the_fp32_cpu_reference(
    cuda: LoraExecutor, cpu: LoraExecutor
) -> None:
    """Same adapter weights, same data: bf16 on CUDA is within 2% in loss and 10% in every
    LoRA gradient's norm of fp32 on the CPU."""
    batch = data(4, 128, 1)
    reference, gpu = Run(cpu, "ref"), Run(cuda, "ref")
    reference.forward_backward(batch)
    reference.op(OpKind.OPTIM_STEP, ADAM.model_dump())  # lora_B non-zero: every grad counts
    same_weights(gpu, reference)
    losses = (reference.forward_backward(batch), gpu.forward_backward(batch))
    assert losses[1] == pytest.approx(losses[0], rel=LOSS_RTOL)
    expected, got = reference.grads(), gpu.grads()
    for key in expected:
        error = float((got[key] - expected[key]).norm() / expected[key].norm())
        assert error < GRAD_RTOL, (key, error)


def test_optim_step_on_cuda_equals_torch_adamw(cuda: LoraExecutor) -> None:
    """The engine's AdamW step on CUDA gives what torch.optim.AdamW gives on the same fp32
    tensors and gradients."""
    run = Run(cuda, "adamw")
    run.forward_backward(data(2, 64, 2))
    before = {k: p.detach().clone() for k, p in run.adapter.params.items()}
    grads = {k: p.grad.detach().clone() for k, p in run.adapter.params.items()}
    run.op(OpKind.OPTIM_STEP, ADAM.model_dump())
    params = {k: torch.nn.Parameter(v.clone()) for k, v in before.items()}
    for key, param in params.items():
        param.grad = grads[key]
    torch.optim.AdamW(
        params.values(),
        lr=ADAM.learning_rate,
        betas=(ADAM.beta1, ADAM.beta2),
        eps=ADAM.eps,
        weight_decay=ADAM.weight_decay,
    ).step()
    for key, param in params.items():
        torch.testing.assert_close(
            run.adapter.params[key].detach(), param.detach(), rtol=1e-6, atol=1e-7
        )


def test_a_checkpoint_saved_on_cuda_loads_on_the_cpu(cuda: LoraExecutor, cpu: LoraExecutor) -> None:
    """save_state on the CUDA worker; load_state with the optimizer on a CPU worker gives the
    same fp32 weights, bit for bit."""
    gpu = Run(cuda, "moves")
    gpu.forward_backward(data(2, 64, 3))
    gpu.op(OpKind.OPTIM_STEP, ADAM.model_dump())
    path = gpu.op(OpKind.SAVE_STATE, {"name": "from-cuda", "ttl_seconds": None})["path"]
    host = Run(cpu, "moves-host")
    host.op(OpKind.LOAD_STATE, {"path": path, "optimizer": True})
    for key, param in gpu.adapter.params.items():
        assert torch.equal(host.adapter.params[key], param.detach().cpu()), key


def test_sampling_on_cuda_is_seeded_and_finite(cuda: LoraExecutor) -> None:
    """A base-model sample on CUDA: the same seed gives the same tokens, logprobs are finite
    and the tokens are the model's."""
    sampled_twice(
        cuda,
        {"tenant_id": "t", "base_model": BASE},
        ModelInput.from_ints(list(b"Q: capital of France?\nA:")),
        4,
        SamplingParams(max_tokens=32, temperature=1.0, seed=7),
    )


def test_cross_adapter_pass_on_cuda_equals_one_at_a_time(cuda: LoraExecutor) -> None:
    """Four models' forward_backward ops in one shared pass give each adapter the gradients it
    gets alone (bf16: 5% in norm, the batch shapes round differently)."""
    batched = [Run(cuda, f"batched-{i}", seed=i) for i in range(4)]
    alone = [Run(cuda, f"alone-{i}", seed=i) for i in range(4)]
    batches = [data(2, 32 + 16 * i, 10 + i) for i in range(4)]
    outcomes = cuda.training.rounds.execute_batch(
        [run.fb_op(b) for run, b in zip(batched, batches, strict=True)]
    )
    assert not [o for o in outcomes if isinstance(o, Exception)]
    for run, single, batch in zip(batched, alone, batches, strict=True):
        single.forward_backward(batch)
        expected, got = single.grads(), run.grads()
        for key in expected:  # lora_A's gradient is zero while lora_B still is: compare norms
            error = float((got[key] - expected[key]).norm())
            assert error <= 0.05 * float(expected[key].norm()) + 1e-8, (run.model_id, key)


def test_a_pass_waits_for_the_device_once(cuda: LoraExecutor) -> None:
    """Two models' ops (ppo with its metrics, cross_entropy) in one pass: no scalar read and one
    copy back to the host (CUDA; none on the CPU), after the backward, for every op's logprobs
    and metrics together. Reads by transformers (its mask check) are not the pass's own."""
    from aten_calls import AtenCalls

    from queue_tinker.types.enums import LossFn
    from queue_tinker.workers.training.shared_pass import PassOp, shared_pass

    runs = [Run(cuda, f"reads-{i}", seed=i) for i in range(2)]
    rl = [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"].to_numpy(),
                "logprobs": np.full(d.model_input.length, -2.0, np.float32),
                "advantages": np.ones(d.model_input.length, np.float32),
            },
        )
        for d in data(3, 48, 21)
    ]
    ppo = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    ops = [
        PassOp(runs[0].adapter, rl, LossFn.PPO, ppo, backward=True),
        PassOp(runs[1].adapter, data(2, 64, 22), LossFn.CROSS_ENTROPY, {}, backward=True),
    ]
    plan = cuda.training.rounds.plan
    with AtenCalls() as calls:
        outcomes = shared_pass(cuda.pool, ops, torch.device(DEVICE), plan)
    assert all(not isinstance(o, Exception) for o in outcomes), outcomes
    assert len(calls.reads) == (1 if DEVICE == "cuda" else 0), calls.reads
    assert "ratio:mean" in outcomes[0].metrics  # type: ignore[union-attr]


@cuda_only
def test_out_of_memory_on_cuda_splits_the_pass(cuda: LoraExecutor) -> None:
    """With the process capped a little above what one op needs, a two-op pass that does not
    fit runs as two passes; an op four times as big fails alone with DeviceMemoryError; the
    engine goes on."""
    a, b, c = (Run(cuda, f"oom-{name}") for name in "abc")
    rows, tokens = 8, 1024
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    a.forward_backward(data(rows, tokens, 20))
    one_op = torch.cuda.max_memory_allocated() - base
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (base + 1.4 * one_op) / total))
    try:
        pair = cuda.training.rounds.execute_batch(
            [a.fb_op(data(rows, tokens, 21)), b.fb_op(data(rows, tokens, 22))]
        )
        too_big = cuda.training.rounds.execute_batch([c.fb_op(data(4 * rows, tokens, 23))])[0]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert not [o for o in pair if isinstance(o, Exception)], pair
    assert isinstance(too_big, DeviceMemoryError), too_big
    assert f"{4 * rows * tokens} padded tokens" in str(too_big)
    assert c.forward_backward(data(1, 64, 24)) > 0


@cuda_only
def test_budgets_from_free_memory_are_conservative(scratch: Path) -> None:
    """Unset budgets come from free memory, an idle worker's passes borrow the sampler's share,
    and a pass of 16K tokens uses no more activation memory than the estimate of the
    checkpointing plan it ran under (the fewest layers that fit the budget and what it
    borrowed)."""
    from queue_tinker.workers.model.memory import pass_bytes_per_token

    engine = LoraExecutor(BASE, DEVICE, scratch / "storage-budget", scratch / "models")
    rounds = engine.training.rounds
    assert rounds.guard.train_batch_tokens > 0
    plan = rounds.plan
    assert plan.activation_budget is not None and plan.layer_bytes is not None
    assert plan.spare_activations is not None
    run = Run(engine, "budget")
    torch.cuda.synchronize()
    borrowed = plan.spare_activations()
    assert borrowed > 0  # no sample holds the sampler's share
    layers = int(engine.pool.base.config.num_hidden_layers)
    planned = plan.recomputation(16 * 1024, True, layers)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run.forward_backward(data(16, 1024, 30))
    used = torch.cuda.max_memory_allocated() - base
    estimate = 16 * 1024 * pass_bytes_per_token(layers, planned, plan.layer_bytes)
    assert estimate <= plan.activation_budget + borrowed
    assert used <= 1.5 * estimate + (256 << 20), (used, estimate, planned)  # + a logits chunk


@cuda_only
def test_selective_checkpointing_on_cuda_equals_plain_and_keeps_between(
    scratch: Path, cuda: LoraExecutor
) -> None:
    """On CUDA (bf16, SDPA's flash or efficient kernel, whose outputs a selective layer keeps):
    every layer selective gives the plain pass's loss and, within bf16's noise, its gradients,
    and its pass peaks above whole layers' and below the plain pass's."""
    batch = data(8, 512, 3)
    source = Run(cuda, "selective-source")
    source.forward_backward(batch)
    source.op(OpKind.OPTIM_STEP, ADAM.model_dump())  # lora_B non-zero: every grad counts
    results = {}
    for mode in ("off", "on", "selective"):
        engine = LoraExecutor(
            BASE,
            DEVICE,
            scratch / f"storage-{mode}",
            scratch / "models",
            EngineConfig(activation_checkpointing=mode),  # type: ignore[arg-type]
        )
        run = Run(engine, f"selective-{mode}")
        same_weights(run, source)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = run.forward_backward(batch)
        results[mode] = (loss, run.grads(), torch.cuda.max_memory_allocated() - base)
        del run, engine
    (plain, plain_grads, plain_peak) = results["off"]
    (_, _, whole_peak) = results["on"]
    (selective, selective_grads, selective_peak) = results["selective"]
    print(f"peaks: plain {plain_peak}, whole {whole_peak}, selective {selective_peak} bytes")
    assert selective == pytest.approx(plain, rel=1e-3)
    for key, grad in plain_grads.items():
        error = float((selective_grads[key] - grad).norm() / grad.norm())
        assert error < 1e-2, (key, error)
    assert whole_peak < selective_peak < plain_peak


# --- every family's built-in ---------------------------------------------------------------------
def image_prompt() -> ModelInput:
    """Text, a 32x24 PNG (12 image tokens on tiny-vl), text."""
    from io import BytesIO

    from PIL import Image

    pixels = np.zeros((24, 32, 3), dtype=np.uint8)
    pixels[:, :16] = (200, 30, 30)
    out = BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return ModelInput(
        chunks=[
            EncodedTextChunk(tokens=list(b"look: ")),
            ImageChunk(data=out.getvalue(), format="png", expected_tokens=12),
            EncodedTextChunk(tokens=list(b"it is")),
        ]
    )


def built_in_data(base: str, seed: int) -> list[Datum]:
    """Two text rows, and on a vision-language built-in a third whose prompt holds an image."""
    batch = data(2, 48, seed)
    if base in (VL, QWEN3_VL):
        prompt = image_prompt()
        targets = np.zeros(prompt.length, dtype=np.int64)
        targets[-5:] = list(b" red.")
        batch.append(Datum(model_input=prompt, loss_fn_inputs={"target_tokens": targets}))
    return batch


@pytest.fixture(scope="module", params=FAMILY_BUILT_INS, ids=lambda name: name.rsplit("/", 1)[-1])
def built_in(
    request: pytest.FixtureRequest, scratch: Path
) -> tuple[str, LoraExecutor, LoraExecutor]:
    """(base model, fp32 engine on the device, fp32 engine on the CPU) on one storage; a
    family the device's transformers lacks is skipped, naming it (scripts/gpu_wheels would
    carry the lock's transformers)."""
    from transformers import CONFIG_MAPPING

    from queue_tinker.builtin_models import BUILTIN_MODELS

    base: str = request.param
    model_type = BUILTIN_MODELS[base].model_type
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type} models")
    name = base.rsplit("/", 1)[-1]
    engines = (
        LoraExecutor(
            base,
            device,
            scratch / f"{name}-storage",
            scratch / "models",
            EngineConfig(dtype="fp32"),
        )
        for device in (DEVICE, "cpu")
    )
    return (base, *engines)  # type: ignore[return-value]


def experts_in(base: str) -> bool:
    """Whether a built-in's family adapts stacked experts (its registry entry says)."""
    from queue_tinker.builtin_models import BUILTIN_MODELS
    from queue_tinker.workers.model.families import family_of

    return family_of(BUILTIN_MODELS[base].model_type).experts


def test_a_built_in_trains_and_reloads_on_the_device_as_on_the_cpu(
    built_in: tuple[str, LoraExecutor, LoraExecutor],
) -> None:
    """fp32 on both sides: after the same step from the same seed, the loss, every LoRA
    gradient (the experts' on tiny-moe, the text after an image on tiny-vl) and the weights
    agree within 1e-4; the device's checkpoint loads on the CPU bit for bit."""
    base, device, cpu = built_in
    on_device, on_cpu = Run(device, "same", base=base), Run(cpu, "same", base=base)
    losses = []
    for run in (on_device, on_cpu):
        run.forward_backward(built_in_data(base, 40))
        run.op(OpKind.OPTIM_STEP, ADAM.model_dump())
        losses.append(run.forward_backward(built_in_data(base, 41)))
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    expected, got = on_cpu.grads(), on_device.grads()
    assert any("experts" in key for key in expected) == experts_in(base)
    for key in expected:
        error = float((got[key] - expected[key]).norm())
        assert error <= 1e-4 * float(expected[key].norm()) + 1e-7, key
    path = on_device.op(OpKind.SAVE_STATE, {"name": "moves", "ttl_seconds": None})["path"]
    host = Run(cpu, "moved", base=base)
    host.op(OpKind.LOAD_STATE, {"path": path, "optimizer": True})
    for key, param in on_device.adapter.params.items():
        assert torch.equal(host.adapter.params[key], param.detach().cpu()), key


def test_a_built_in_samples_seeded_on_the_device(
    built_in: tuple[str, LoraExecutor, LoraExecutor],
) -> None:
    """A sample of the trained adapter (from an image prompt on tiny-vl): the same seed gives
    the same tokens, logprobs are finite, tokens are in the vocabulary."""
    base, device, _cpu = built_in
    run = Run(device, "sampled", base=base)
    run.forward_backward(built_in_data(base, 42))
    run.op(OpKind.OPTIM_STEP, ADAM.model_dump())
    path = run.op(OpKind.SAVE_WEIGHTS_FOR_SAMPLER, {"name": "w", "ttl_seconds": None})["path"]
    prompt = (
        image_prompt() if base in (VL, QWEN3_VL) else ModelInput.from_ints(list(b"Q: 2+2?\nA:"))
    )
    sampled_twice(
        device,
        {"tenant_id": "t", "base_model": base, "model_path": path},
        prompt,
        2,
        SamplingParams(max_tokens=16, temperature=1.0, seed=3),
    )


def mixed_samples(engine: LoraExecutor, paths: list[str | None]) -> list[dict[str, Any]]:
    """A seeded sample of each checkpoint (None: the base model), joined to the decode loop at
    once and stepped to the end: each op's response."""
    ops = []
    for index, path in enumerate(paths):
        run = Run.__new__(Run)
        run.engine, run.model_id, run.seq = engine, f"mixed-{uuid.uuid4().hex[:8]}", 0
        run.op(
            OpKind.CREATE_SAMPLING_SESSION,
            {"tenant_id": "t", "base_model": BASE, "model_path": path},
        )
        body = {
            "prompt": ModelInput.from_ints(list(b"Q: capital of France?\nA:")[index:]).model_dump(),
            "num_samples": 3,
            "sampling_params": SamplingParams(
                max_tokens=24, temperature=1.0, seed=index
            ).model_dump(),
            "model_path": path,
        }
        ops.append(run.make(OpKind.SAMPLE, body))
    engine.sampling.join(ops)
    finished: dict[str, Any] = {}
    while engine.sampling.stepping():
        finished.update((op.job_id, out) for op, out in engine.sampling.step(float("inf")))
    return [codec.decode(finished[op.job_id].result) for op in ops]


def test_decode_graphs_equal_the_eager_slots_and_the_padded_loop(scratch: Path) -> None:
    """QT_DECODE_STEP=graphs, slots and padded on the device, fp32, one storage: two
    checkpoints' and the base model's seeded samples, joined at once, are the same tokens on
    all three, logprobs to float32 rounding; the graphs engine captured its steps."""
    engines = {
        step: LoraExecutor(
            BASE,
            DEVICE,
            scratch / "storage-steps",
            scratch / "models",
            EngineConfig(dtype="fp32", decode_step=step),
        )
        for step in ("padded", "slots", "graphs")
    }
    paths: list[str | None] = [None]
    for seed in (1, 2):
        run = Run(engines["padded"], f"steps-{seed}", seed=seed)
        run.forward_backward(data(2, 32, seed))
        run.op(OpKind.OPTIM_STEP, ADAM.model_dump())  # lora_B non-zero: the adapter counts
        saved = run.op(OpKind.SAVE_WEIGHTS_FOR_SAMPLER, {"name": "s", "ttl_seconds": None})
        paths.append(saved["path"])
    results = {step: mixed_samples(engine, paths) for step, engine in engines.items()}
    for step in ("slots", "graphs"):
        for got, want in zip(results[step], results["padded"], strict=True):
            for one, other in zip(got["sequences"], want["sequences"], strict=True):
                assert one["tokens"] == other["tokens"], step
                np.testing.assert_allclose(one["logprobs"], other["logprobs"], rtol=1e-4, atol=1e-4)
    loop = engines["graphs"].sampling._loop
    assert loop is not None and loop.slots is not None
    assert loop.slots.captured > 0 if DEVICE == "cuda" else loop.slots.captured == 0


# --- last: liger patches transformers' rotary function for the whole process ------------------
@cuda_only
def test_liger_kernels_on_cuda_equal_the_eager_model(cuda: LoraExecutor, scratch: Path) -> None:
    """QT_LIGER_KERNELS=on: the same weights and data through liger's RMSNorm, RoPE and SwiGLU
    give the eager engine's loss and LoRA gradients within bf16's rounding, and a seeded sample
    repeats with finite logprobs. The eager side runs first: liger's RoPE is process-wide."""
    pytest.importorskip("liger_kernel", reason="the gpu extra (liger-kernel) is not installed")
    batch = data(4, 128, 5)
    eager_run = Run(cuda, "liger-ref")
    eager_run.forward_backward(batch)
    eager_run.op(OpKind.OPTIM_STEP, ADAM.model_dump())  # lora_B non-zero: every grad counts
    eager_loss = eager_run.forward_backward(batch)
    expected = eager_run.grads()
    liger = LoraExecutor(
        BASE,
        DEVICE,
        scratch / "storage-liger",
        scratch / "models",
        EngineConfig(liger_kernels="on"),
    )
    liger_run = Run(liger, "liger")
    same_weights(liger_run, eager_run)
    assert liger_run.forward_backward(batch) == pytest.approx(eager_loss, rel=1e-2)
    got = liger_run.grads()
    for key in expected:
        error = float((got[key] - expected[key]).norm() / expected[key].norm())
        assert error < 0.05, (key, error)
    sampled_twice(
        liger,
        {"tenant_id": "t", "base_model": BASE},
        ModelInput.from_ints(list(b"Q: capital of France?\nA:")),
        2,
        SamplingParams(max_tokens=16, temperature=1.0, seed=7),
    )
