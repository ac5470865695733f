"""The LoRA training engine: one base model, many adapters, every TrainingClient op.

Runs on the worker's compute thread, one op or one batch of ops at a time; knows no Redis and
no SQL. State that must outlive this process (checkpoints, snapshots) goes to `storage`, a
directory every worker of the deployment shares (workers/training/saved_state.py writes and
reads it).
Training ops of many models run together through workers/training/rounds.py; which ops run
inline, batched or stepped is TrainingOpRules' (workers/interface.py). Settings come in through
the constructor (workers/main.py passes the deployment's); the engine reads no environment.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedModel
from transformers.utils import logging as transformers_logging

from queue_tinker.builtin_models import load_tokenizer
from queue_tinker.errors import QueueTinkerError, UserInputError
from queue_tinker.types import LossFn, OpKind, codec
from queue_tinker.types.loss_inputs import ModelLimits, check_batch, resolve_loss_config
from queue_tinker.types.ops import Op
from queue_tinker.types.request_limits import (
    RequestLimits,
    check_batch_size,
    check_request_bytes,
)
from queue_tinker.types.training import (
    CreateModelInput,
    ForwardBackwardInput,
    LoraConfig,
    OptimParams,
    OptimStepResponse,
)
from queue_tinker.workers.interface import (
    PASS_KINDS,
    BatchShare,
    OpResult,
    TrainingOpRules,
    parse_body,
    run_ping,
)
from queue_tinker.workers.model import base_model as base_models
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.checkpoints import read_meta, read_state, snapshot_dir
from queue_tinker.workers.model.memory import device_budgets
from queue_tinker.workers.sampling.sessions import SamplingOps
from queue_tinker.workers.training.custom_loss_graph import GraphLoss
from queue_tinker.workers.training.dimuon import parse_optim_params
from queue_tinker.workers.training.model_pass import PassPlan
from queue_tinker.workers.training.optimizers import (
    forward_backward,
    grads_kept_on_error,
    optim_steps,
)
from queue_tinker.workers.training.rounds import MemoryGuard, TrainingRounds, pass_result
from queue_tinker.workers.training.saved_state import (
    SNAPSHOT_RESULTS,
    UNLOADED,
    SavedState,
    outcome_from_json,
)
from queue_tinker.workers.training.shared_pass import PassOp

log = logging.getLogger(__name__)

Outcome = OpResult | Exception
DEFAULT_TRAIN_BATCH_TOKENS = 32_768  # QT_TRAIN_BATCH_TOKENS unset, off CUDA
DEFAULT_SAMPLE_BATCH_SEQUENCES = 64  # QT_SAMPLE_BATCH_SEQUENCES unset, off CUDA


def default_seed(model_id: str) -> int:
    """A model created without a seed still initialises the same way every time (replay)."""
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "big")


def load_frozen_base(base_model: str, device: str, models_dir: Path, dtype: str) -> PreTrainedModel:
    transformers_logging.disable_progress_bar()  # per-shard bars are noise in worker logs
    # A transformers model (from_pretrained), typed as a Module by the loader.
    base = cast(PreTrainedModel, base_models.load_base_model(base_model, device, models_dir, dtype))
    base.eval()  # no dropout anywhere: a step is a pure function of its inputs
    # What adapter_config.json names as the base: the name users know, not a local path.
    base.name_or_path = base_model
    return base


class LoraEngine:
    def __init__(
        self,
        base_model: str,
        device: str,
        storage: Path,
        models_dir: Path,
        *,
        max_resident: int = 32,
        snapshot_every: int = 20,
        max_batch_sequences: int | None = None,
        sample_cache_tokens: int | None = None,
        request_limits: RequestLimits | None = None,
        cross_adapter_batch: bool = True,
        train_batch_tokens: int | None = None,
        dtype: str = "auto",
        plan: PassPlan | None = None,
    ) -> None:
        self.base_model = base_model
        self.rules = TrainingOpRules(cross_adapter_batch)  # what runs inline, batched, stepped
        self.plan = plan or PassPlan()
        # The same QT_MAX_* limits the client and gateway enforce, again here: an op may come
        # from a client configured otherwise, or straight from Redis. The worker passes its
        # settings' (workers/main.py); None: the settings' defaults, whatever the environment.
        self.request_limits = request_limits or RequestLimits.defaults()
        self.device = torch.device(device)
        self.storage = storage
        self.snapshot_every = snapshot_every
        base = load_frozen_base(base_model, device, models_dir, dtype)
        self.limits = ModelLimits(
            vocab_size=base_models.vocab_size(base), context_length=base_models.context_length(base)
        )
        self.pool = AdapterPool(base, base_model, max_resident)
        # Unset budgets: the CPU defaults, or what the device's free memory holds now.
        budgets = device_budgets(
            base.config,
            self.device,
            base.dtype,
            checkpointing=self.plan.activation_checkpointing != "off",
        )
        if budgets is not None:
            log.info("device budgets from free memory: %s", budgets)
        self.guard = MemoryGuard(
            self.device,
            train_batch_tokens
            or (budgets.train_batch_tokens if budgets else DEFAULT_TRAIN_BATCH_TOKENS),
        )
        self.rounds = TrainingRounds(self, self.guard, self.plan)
        self.saved = SavedState(self.pool, storage, base_model, self.rounds.unpublished)
        max_batch_sequences = max_batch_sequences or (
            budgets.sample_batch_sequences if budgets else DEFAULT_SAMPLE_BATCH_SEQUENCES
        )
        self.sampling = SamplingOps(
            self.pool,
            storage,
            base_model,
            self.limits,
            self.device,
            tokenizer=lambda: load_tokenizer(base_model, models_dir),
            max_batch_sequences=max_batch_sequences,
            request_limits=self.request_limits,
            max_cache_tokens=sample_cache_tokens
            or (budgets.sample_cache_tokens if budgets else None),
        )
        self._handlers = self._op_handlers()

    def _op_handlers(self) -> dict[OpKind, Callable[[Adapter, Op], OpResult]]:
        """What execute runs for each op kind on a model's adapter."""
        return {
            OpKind.FORWARD: self._forward,
            OpKind.FORWARD_BACKWARD: self._forward_backward,
            OpKind.OPTIM_STEP: self._optim_step,
            OpKind.SAVE_STATE: self.saved.save_state,
            OpKind.SAVE_WEIGHTS_FOR_SAMPLER: self.saved.save_for_sampler,
            OpKind.SAVE_WEIGHTS_EXTERNAL: self.saved.save_external,
            OpKind.LOAD_STATE: self.saved.load_state,
            OpKind.UNLOAD_MODEL: self.saved.unload,
        }

    @property
    def train_batch_tokens(self) -> int:
        """Padded tokens one shared pass may hold (lowered after an out-of-memory pass)."""
        return self.guard.train_batch_tokens

    @property
    def largest_pass(self) -> int:
        return self.guard.largest_pass

    # --- the Engine interface --------------------------------------------------------------
    def execute(self, op: Op) -> OpResult:
        check_request_bytes(len(op.payload), self.request_limits)  # before decoding it
        if op.kind is OpKind.PING:
            return run_ping(op)
        if op.kind is OpKind.CREATE_MODEL:
            return self._create(op)
        if op.kind is OpKind.CREATE_SAMPLING_SESSION:
            return self.sampling.create_session(op)
        if op.kind is OpKind.SAMPLE:
            result = self.sampling.run([op])[0]
            if isinstance(result, Exception):
                raise result
            return result
        handler = self._handlers.get(op.kind)
        if handler is None:
            raise UserInputError(f"kind: {op.kind.value!r} is not supported by this worker")
        adapter = self._admit(op)
        if isinstance(adapter, OpResult):
            return adapter
        if op.kind in PASS_KINDS:
            # Only a model pass reads PEFT's active adapter; the other ops touch this adapter's
            # own tensors, and set_adapter walks every module (0.7 ms a call on the tiny model).
            self.pool.activate(adapter)
        result = handler(adapter, op)
        adapter.last_seq = op.seq
        return result

    def batchable(self, op: Op) -> bool:
        return self.rules.batchable(op)

    def stepped(self, op: Op) -> bool:
        return self.rules.stepped(op)

    def join(self, ops: Sequence[Op]) -> None:
        self.sampling.join(ops)

    def step(self, budget_s: float) -> list[tuple[Op, OpResult | Exception]]:
        return self.sampling.step(budget_s)

    def stepping(self) -> bool:
        return self.sampling.stepping()

    def stop(self, reasons: Mapping[str, str]) -> None:
        self.sampling.stop(reasons)

    def batch_share(self, backlog: Iterable[Op]) -> BatchShare:
        return self.rules.batch_share(backlog)

    def execute_batch(self, ops: Sequence[Op]) -> list[OpResult | Exception]:
        """Training ops in rounds (_run_training); sample ops, if any, through the decode loop
        to their end (the worker joins them instead). An op with bad input fails alone, as in
        execute."""
        outcomes: list[Outcome | None] = [None] * len(ops)
        samples = [i for i, op in enumerate(ops) if op.kind is OpKind.SAMPLE]
        for i, outcome in zip(samples, self.sampling.run([ops[i] for i in samples]), strict=True):
            outcomes[i] = outcome
        training = [(i, op) for i, op in enumerate(ops) if op.kind is not OpKind.SAMPLE]
        try:
            self.rounds.run(training, outcomes)
        finally:
            self.rounds.unpublished.clear()
        done = [o for o in outcomes if o is not None]  # every op got a result or its error
        assert len(done) == len(ops)
        return done

    def runs_inline(self, op: Op) -> bool:
        return self.rules.runs_inline(op)

    def durable_seq(self, model_id: str) -> int | None:
        if self.sampling.owns(model_id):
            return self.sampling.sessions[model_id]  # nothing to replay: all of it is durable
        adapter = self.pool.adapters.get(model_id)
        return adapter.snapshot_seq if adapter is not None and adapter.snapshot_seq else None

    def restore_point(self, model_id: str) -> int | None:
        adapter = self.pool.adapters.get(model_id)
        if adapter is not None:
            return adapter.last_seq
        meta = read_meta(snapshot_dir(self.storage, model_id))
        # No snapshot: a sampling session (no state), or a run that never got created.
        return meta.seq if meta is not None else None

    def persist(self, model_id: str) -> None:
        adapter = self.pool.adapters.get(model_id)
        if adapter is not None and adapter.last_seq > adapter.snapshot_seq:
            self.saved.snapshot(adapter)

    def drop(self, model_id: str) -> None:
        self.pool.remove(model_id)
        self.sampling.cancel(model_id)
        self.sampling.sessions.pop(model_id, None)

    def resident(self) -> list[str]:
        return [*self.pool.adapters, *self.sampling.sessions]

    def device_memory_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_allocated(self.device))

    # --- residency ---------------------------------------------------------------------------
    def _resident(self, model_id: str) -> Adapter:
        adapter = self.pool.get(model_id)
        if adapter is not None:
            return adapter
        if (self.storage / model_id / UNLOADED).exists():
            raise UserInputError(f"model {model_id} was unloaded; create a new training client")
        directory = snapshot_dir(self.storage, model_id)
        if read_meta(directory) is None:
            # Created, but its state never reached storage: its worker died before the first
            # snapshot. Rebuilding it by replaying the op log is the recovery path.
            raise QueueTinkerError(f"model {model_id}: no saved state to restore it from")
        state = read_state(directory, optimizer=True, grads=True)
        adapter = self._add(
            model_id,
            state.meta.tenant_id,
            LoraConfig.model_validate(state.meta.lora_config),
            seed=0,
        )
        self.pool.load_weights(adapter, state.weights)
        self.pool.load_optimizer(adapter, state)
        self.pool.load_grads(adapter, state.grads)
        adapter.step = state.meta.step
        adapter.last_seq = adapter.snapshot_seq = state.meta.seq
        kept = {int(seq): outcome for seq, outcome in state.meta.batch_results.items()}
        if state.meta.op_result is not None:
            kept[state.meta.seq] = state.meta.op_result
        if kept:
            adapter.extra[SNAPSHOT_RESULTS] = kept
        return adapter

    def _admit(self, op: Op) -> Adapter | OpResult:
        """The op's adapter, made resident; or, for an op the state already holds, its kept
        result."""
        adapter = self._resident(op.model_id)
        if op.seq <= adapter.last_seq:
            return self._already_applied(adapter, op)
        adapter.extra.pop(SNAPSHOT_RESULTS, None)  # the state moves on: no op of them comes again
        return adapter

    def _already_applied(self, adapter: Adapter, op: Op) -> OpResult:
        """An op whose effect the state already holds: the op that wrote the snapshot this
        adapter was restored from, or one run before it in the same batch, by an owner that died
        (or lost its lease) before it published the result. The snapshot kept that result:
        publish it (or raise its error), do not apply the op a second time."""
        kept = adapter.extra.get(SNAPSHOT_RESULTS, {})
        # max(kept) is the snapshot's own seq: equal to last_seq while nothing ran since.
        if op.seq in kept and max(kept) == adapter.last_seq:
            log.info(
                "model %s: op %d is in the snapshot already; its kept result is published",
                op.model_id,
                op.seq,
            )
            return outcome_from_json(kept[op.seq])
        raise RuntimeError(f"model {op.model_id}: op seq {op.seq} after {adapter.last_seq}")

    def _add(self, model_id: str, tenant_id: str, config: LoraConfig, seed: int) -> Adapter:
        for victim in self.pool.over_capacity():
            log.info("evicting %s (least recently used) to storage", victim.model_id)
            self.persist(victim.model_id)
            self.pool.remove(victim.model_id)
        return self.pool.add(model_id, tenant_id, config, seed)

    # --- what TrainingRounds asks of the engine ---------------------------------------------
    def admit_batched(self, op: Op) -> Adapter | OpResult:
        """execute's checks of a training op, in its order: its size, then its model (or, for
        an op the state already holds, its kept result)."""
        check_request_bytes(len(op.payload), self.request_limits)
        return self._admit(op)

    def pass_op(self, op: Op) -> PassOp | OpResult:
        """execute's checks, in its order, and the op ready for a shared pass."""
        adapter = self.admit_batched(op)
        if isinstance(adapter, OpResult):
            return adapter
        batch, config = self._checked_batch(op)
        return PassOp(
            adapter=adapter,
            data=batch.data,
            loss_fn=self._loss(batch),
            config=config,
            backward=op.kind is OpKind.FORWARD_BACKWARD,
        )

    # --- ops -----------------------------------------------------------------------------------
    def _create(self, op: Op) -> OpResult:
        body = parse_body(CreateModelInput, op.payload)
        if body.base_model != self.base_model:
            raise UserInputError(
                f"base_model: {body.base_model!r} is not served by this worker ({self.base_model})"
            )
        if self.pool.get(op.model_id) is None:
            if read_meta(snapshot_dir(self.storage, op.model_id)) is not None:
                self._resident(op.model_id)  # created before, by an earlier owner
            else:
                config = body.lora_config
                seed = config.seed if config.seed is not None else default_seed(op.model_id)
                adapter = self._add(op.model_id, body.tenant_id, config, seed)
                adapter.last_seq = op.seq
                self.saved.snapshot(adapter)  # from here on the model survives its worker
        return OpResult(result=codec.encode({"model_id": op.model_id}))

    def _forward(self, adapter: Adapter, op: Op) -> OpResult:
        return self._run_batch(op, backward=False)

    def _forward_backward(self, adapter: Adapter, op: Op) -> OpResult:
        with grads_kept_on_error([adapter]):
            return self._run_batch(op, backward=True)

    def _run_batch(self, op: Op, *, backward: bool) -> OpResult:
        batch, config = self._checked_batch(op)
        out = self.guard.unless_out_of_memory(
            f"model {op.model_id}: op {op.seq}",
            lambda: forward_backward(
                self.pool.model,
                batch.data,
                self._loss(batch),
                config,
                self.device,
                backward=backward,
                plan=self.plan,
            ),
            len(batch.data) * max(d.model_input.length for d in batch.data),
        )
        if out is None:
            raise self.guard.memory_error(batch.data)
        return pass_result(out, batch.data)

    def _loss(self, batch: ForwardBackwardInput) -> LossFn | GraphLoss:
        """The batch's loss: built in, or the uploaded loss it carries (rebuilt from the
        allow-list, workers/training/custom_loss_graph.py)."""
        if batch.custom_loss is not None:
            return GraphLoss(batch.custom_loss, self.device)
        return batch.loss_fn

    def _checked_batch(self, op: Op) -> tuple[ForwardBackwardInput, dict[str, float]]:
        """A forward / forward_backward op's body, checked, and its loss config resolved."""
        batch = parse_body(ForwardBackwardInput, op.payload)
        check_batch_size(batch, self.request_limits)
        check_batch(batch, self.limits)
        return batch, resolve_loss_config(batch.loss_fn, batch.loss_fn_config)

    def _optim_step(self, adapter: Adapter, op: Op) -> OpResult:
        params = parse_optim_params(adapter.config.optimizer, op.payload)
        return self.optimizer_step([(adapter, op, params)])[0]

    def optimizer_step(self, steps: Sequence[tuple[Adapter, Op, OptimParams]]) -> list[OpResult]:
        """optim_step ops of different models, in one optimizer call (alone or batched: the
        same code, so the same numbers); each model snapshots every snapshot_every steps."""
        all_metrics = optim_steps([(adapter, params) for adapter, _, params in steps])
        results = []
        for (adapter, op, _), metrics in zip(steps, all_metrics, strict=True):
            adapter.last_seq = op.seq
            result = OpResult(
                result=codec.encode(OptimStepResponse(metrics=metrics).model_dump()),
                metrics=metrics,
            )
            if adapter.step % self.snapshot_every == 0:
                self.saved.snapshot(adapter, result)
            results.append(result)
        return results
