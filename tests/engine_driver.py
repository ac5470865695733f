"""The LoRA engine driven in-process, as a worker drives it: ops built the way the client builds
them, numbered per model, and what the tests read back (weights, gradients, moments).
Shared by the engine tests under tests/workers/."""

from __future__ import annotations

import gc
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from queue_tinker.config.engine import EngineConfig
from queue_tinker.queue.dispatch.dispatcher import Op
from queue_tinker.types import OpKind, codec
from queue_tinker.types.requests.training import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraConfig,
)
from queue_tinker.types.tensors import Datum, ModelInput
from queue_tinker.workers.executor.lora import LoraExecutor
from queue_tinker.workers.interface import OpResult
from queue_tinker.workers.model.checkpoints import AdapterState, read_state, snapshot_dir

T = TypeVar("T")
BASE = "queue-tinker/tiny-llama"
RANK = 4
EXACT = {"rtol": 0.0, "atol": 0.0}
TIGHT = {"rtol": 1e-6, "atol": 1e-7}
TEXTS = ["hello lora world", "the quick brown fox", "queue tinker!", "adapters all the way"]
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01)
Tensors = dict[str, torch.Tensor]


# --- data and the op driver -----------------------------------------------------------------
def datum(text: str, **extra: Any) -> Datum:
    """Byte tokens of `text`: input tokens[:-1], targets tokens[1:] (plus any extra inputs)."""
    ids = list(text.encode())
    inputs = {"target_tokens": np.array(ids[1:], dtype=np.int64), **extra}
    return Datum(model_input=ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


def rl_datum(text: str, seed: int) -> Datum:
    """A datum with the sampling policy's logprobs and advantages (for the RL losses)."""
    n = len(text.encode()) - 1
    rng = np.random.default_rng(seed)
    return datum(
        text,
        logprobs=rng.uniform(-6.0, -4.0, n).astype(np.float32),
        advantages=rng.normal(0.0, 1.0, n).astype(np.float32),
    )


def batch(texts: list[str] = TEXTS) -> list[Datum]:
    return [datum(t) for t in texts]


def fb_body(
    data: list[Datum], loss_fn: str = "cross_entropy", config: dict[str, float] | None = None
) -> dict[str, Any]:
    return ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config).model_dump()


@dataclass
class Driver:
    """One engine plus each model's next seq, so tests issue ops as a model's queue would."""

    engine: LoraExecutor
    storage: Path
    base: str = BASE

    def __post_init__(self) -> None:
        self.seqs: dict[str, int] = defaultdict(int)

    def op(self, model_id: str, kind: OpKind, body: Any) -> Any:
        self.seqs[model_id] += 1
        seq = self.seqs[model_id]
        op = Op(
            job_id=f"{model_id}:{seq}",
            model_id=model_id,
            seq=seq,
            kind=kind,
            payload=codec.encode(body),
        )
        return codec.decode(run_op(self.engine, op).result)

    def create(
        self, model_id: str, seed: int | None = 0, rank: int = RANK, base: str | None = None
    ) -> None:
        """`base`: the base model name the run is created on (the engine's by default)."""
        lora = LoraConfig(rank=rank, seed=seed).model_dump()
        self.op(
            model_id,
            OpKind.CREATE_MODEL,
            {
                "lora_config": lora,
                "tenant_id": "default",
                "base_model": base or self.engine.base_model,
            },
        )

    def forward(self, model_id: str, data: list[Datum]) -> ForwardBackwardOutput:
        out = self.op(model_id, OpKind.FORWARD, fb_body(data))
        return ForwardBackwardOutput.model_validate(out)

    def fb(
        self,
        model_id: str,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        config: dict[str, float] | None = None,
    ) -> ForwardBackwardOutput:
        out = self.op(model_id, OpKind.FORWARD_BACKWARD, fb_body(data, loss_fn, config))
        return ForwardBackwardOutput.model_validate(out)

    def step(self, model_id: str, params: AdamParams = ADAM) -> dict[str, Any]:
        return self.op(model_id, OpKind.OPTIM_STEP, params.model_dump())

    def train(self, model_id: str, steps: int, data: list[Datum] | None = None) -> None:
        for _ in range(steps):
            self.fb(model_id, data or batch())
            self.step(model_id)

    def save(self, model_id: str, name: str, kind: OpKind = OpKind.SAVE_STATE) -> str:
        return self.op(model_id, kind, {"name": name, "ttl_seconds": None})["path"]

    def load(self, model_id: str, path: str, optimizer: bool) -> None:
        self.op(model_id, OpKind.LOAD_STATE, {"path": path, "optimizer": optimizer})

    # --- reading state (the model must be resident) ---
    def adapter(self, model_id: str) -> Any:
        return self.engine.pool.adapters[model_id]

    def weights(self, model_id: str) -> Tensors:
        return {k: p.detach().clone() for k, p in self.adapter(model_id).params.items()}

    def grads(self, model_id: str) -> Tensors:
        return {
            k: p.grad.clone()
            for k, p in self.adapter(model_id).params.items()
            if p.grad is not None
        }

    def moments(self, model_id: str) -> Tensors:
        adapter = self.adapter(model_id)
        out: Tensors = {}
        for key, p in adapter.params.items():
            for name, value in adapter.optimizer.state.get(p, {}).items():
                out[f"{key}.{name}"] = value.clone()
        return out


def assert_tensors(actual: Tensors, expected: Tensors, **tol: float) -> None:
    assert actual.keys() == expected.keys()
    assert actual, "no tensors to compare"
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], msg=lambda m, k=key: f"{k}: {m}", **tol
        )


def max_diff(a: Tensors, b: Tensors) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def saved_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """fn's result, and the bytes of the tensors autograd saved for its backward meanwhile."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


class _Outputs(TorchDispatchMode):
    """Holds the storage of every tensor an op makes meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, torch.UntypedStorage] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().nbytes():
                storage = leaf.untyped_storage()
                self.storages[storage.data_ptr()] = storage
        return out


def held_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """fn's result, and the bytes of the tensors its ops made that something still holds once
    it returns: what a forward keeps for its backward however it keeps it (autograd's saved
    tensors, a checkpoint's inputs, selective checkpointing's cache), which saved_bytes does
    not see inside a checkpoint."""
    outputs = _Outputs()
    with outputs:
        out = fn()
    gc.collect()
    # One reference is the storage object held here; a second is a live tensor's.
    held = [s for s in outputs.storages.values() if torch._C._storage_Use_Count(s._cdata) > 1]
    return out, sum(s.nbytes() for s in held)


def run_op(engine: LoraExecutor, op: Op) -> OpResult:
    """One op as the worker runs it alone: a sample joined to the decode loop and stepped to
    its end (its error raised), any other op through execute."""
    if not engine.rules.stepped(op):
        return engine.execute(op)
    (result,) = run_stepped(engine, [op])
    if isinstance(result, Exception):
        raise result
    return result


def run_stepped(engine: LoraExecutor, ops: list[Op]) -> list[OpResult | Exception]:
    """Sample ops joined to the decode loop together and stepped until all are done; their
    outcomes in order (the loop must hold nothing else)."""
    engine.sampling.join(ops)
    finished: dict[str, OpResult | Exception] = {}
    while engine.sampling.stepping():
        finished.update((op.job_id, out) for op, out in engine.sampling.step(float("inf")))
    assert finished.keys() == {op.job_id for op in ops}, "other ops were in the loop"
    return [finished[op.job_id] for op in ops]


def make_driver(
    scratch: Path, models_dir: Path, name: str, base: str = BASE, **kwargs: Any
) -> Driver:
    storage = scratch / name
    storage.mkdir()
    return Driver(
        LoraExecutor(base, "cpu", storage, models_dir, EngineConfig(**kwargs)), storage, base
    )


# Batched against alone (BatchDriver), float32 on one CPU thread. A shared pass pads rows to a
# wider batch and runs each LoRA layer on a gathered sub-batch, so sums run in other orders than
# alone: agreement is to float32 rounding. Results agree to RTOL. So do gradients, but for
# entries that cancel to ~0: they carry the rounding of the large terms they sum, so each tensor
# is also allowed GRAD_ATOL times its largest entry (seen: 4e-7 of it). AdamW divides each entry's
# step by its own gradient's size, so after a step such an entry's rounding reaches the weights
# (seen: 5e-8 on a weight of 5e-3 on an AMD EPYC; 2.6e-7 on a weight of 1.6e-2 on a Xeon with
# AVX-512 / AMX, whose matmul kernels round otherwise): WEIGHT_ATOL is lr x 1e-4, far under the
# lr-sized steps a wrong gradient makes.
RTOL = 1e-5
GRAD_ATOL = 1e-6
WEIGHT_ATOL = 1e-6


def make_op(model_id: str, seq: int, kind: OpKind, body: Any) -> Op:
    return Op(
        job_id=f"{model_id}:{seq}",
        model_id=model_id,
        seq=seq,
        kind=kind,
        payload=codec.encode(body),
    )


class BatchDriver:
    """One engine plus each model's next seq, so ops are numbered as a model's queue numbers
    them."""

    def __init__(self, root: Path, name: str, base: str = BASE, **kwargs: Any) -> None:
        self.storage = root / name
        self.base = base
        self.engine = LoraExecutor(
            base, "cpu", self.storage, root / "models", EngineConfig(**kwargs)
        )
        self.seqs: dict[str, int] = {}

    def make(self, model_id: str, kind: OpKind, body: Any) -> Op:
        seq = self.seqs[model_id] = self.seqs.get(model_id, 0) + 1
        return make_op(model_id, seq, kind, body)

    def create(self, model_id: str, config: LoraConfig) -> None:
        """A new model, stepped once alone: B starts at zero (and with it every gradient of
        A); one step makes every LoRA matrix's gradient non-trivial."""
        run_op(
            self.engine,
            self.make(
                model_id,
                OpKind.CREATE_MODEL,
                {
                    "lora_config": config.model_dump(),
                    "tenant_id": "default",
                    "base_model": self.base,
                },
            ),
        )
        self.engine.execute(
            self.make(
                model_id,
                OpKind.FORWARD_BACKWARD,
                fb_body([datum("one step first"), datum("to move B")]),
            )
        )
        run_op(self.engine, self.make(model_id, OpKind.OPTIM_STEP, ADAM.model_dump()))

    def batched(self, ops: list[Op]) -> list[OpResult | Exception]:
        return self.engine.engine().batches.execute_batch(ops)

    def one_by_one(self, ops: list[Op]) -> list[OpResult | Exception]:
        out: list[OpResult | Exception] = []
        for op in ops:
            try:
                out.append(run_op(self.engine, op))
            except Exception as exc:
                out.append(exc)
        return out

    def state(self, model_id: str) -> AdapterState:
        """The model's weights and pending gradients, resident or evicted: its snapshot,
        written now if the model moved on since."""
        self.engine.durability.persist(model_id)
        return read_state(snapshot_dir(self.storage, model_id), optimizer=False, grads=True)

    def weights(self, model_id: str) -> Tensors:
        return self.state(model_id).weights

    def grads(self, model_id: str) -> Tensors:
        return self.state(model_id).grads


def assert_batched_tensors(
    actual: Tensors, expected: Tensors, atol: float = 0.0, atol_of_max: float = 0.0
) -> None:
    """allclose to RTOL, plus `atol`, plus `atol_of_max` times the tensor's largest entry."""
    assert actual.keys() == expected.keys() and expected
    for key, want in expected.items():
        tol = atol + atol_of_max * float(want.abs().max())
        torch.testing.assert_close(
            actual[key], want, rtol=RTOL, atol=tol, msg=lambda m, k=key: f"{k}: {m}"
        )


def assert_same_outcome(
    batched: OpResult | Exception, alone: OpResult | Exception, kind: OpKind
) -> None:
    if isinstance(alone, Exception):
        assert type(batched) is type(alone) and str(batched) == str(alone)
        return
    assert isinstance(batched, OpResult), batched
    assert batched.tokens == alone.tokens
    ours, theirs = codec.decode(batched.result), codec.decode(alone.result)
    if kind is OpKind.OPTIM_STEP:
        assert ours.keys() == theirs.keys()
        np.testing.assert_allclose(
            [ours["metrics"][k] for k in sorted(theirs["metrics"])],
            [theirs["metrics"][k] for k in sorted(theirs["metrics"])],
            rtol=RTOL,
        )
        return
    got = ForwardBackwardOutput.model_validate(ours)
    want = ForwardBackwardOutput.model_validate(theirs)
    assert got.metrics.keys() == want.metrics.keys()
    for key, value in want.metrics.items():
        assert got.metrics[key] == pytest.approx(value, rel=RTOL), key
    assert len(got.loss_fn_outputs) == len(want.loss_fn_outputs)
    for ours_out, theirs_out in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(
            ours_out["logprobs"].to_numpy(), theirs_out["logprobs"].to_numpy(), rtol=RTOL
        )
