"""The LoRA executor: one base model, many adapters, every op a Tinker client sends.

It composes the parts and routes each op to its part: pings run here, training ops on the
training engine (training/), sampling sessions on the sampling sessions (sampling/), both over
one pool of adapters on the frozen base (model/). The runtime hands batches of training steps
straight to the training rounds and samples straight to the sampling sessions (`engine()`).
Which ops run inline, batched or stepped is LoraOpRules' (rules.py). The settings come in
whole, as an EngineConfig (workers/main.py hands over the deployment's); each part here reads
the fields it needs, and nothing here reads the environment, Redis or SQL.
"""

from __future__ import annotations

import logging
from dataclasses import astuple, dataclass, replace
from functools import partial
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from queue_tinker.builtin_models import load_tokenizer
from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import UserInputError
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.storage.local import LocalStore
from queue_tinker.types import OpKind
from queue_tinker.types.requests.loss_inputs import ModelLimits
from queue_tinker.types.requests.request_limits import RequestLimits, check_request_bytes
from queue_tinker.types.service.ops import Op
from queue_tinker.workers.executor.rules import LoraOpRules
from queue_tinker.workers.interface import Engine, OpResult, run_ping
from queue_tinker.workers.model import base_model as base_models
from queue_tinker.workers.model.adapters import AdapterPool
from queue_tinker.workers.model.fit import (
    FitPlan,
    FitSettings,
    fit_resident_adapters,
    require_fit,
)
from queue_tinker.workers.model.fused_kernels import apply_liger, liger_wanted
from queue_tinker.workers.model.memory import (
    Budgets,
    device_budgets,
    device_memory,
    hold_to,
    lora_compute_dtype,
    lora_copy_bytes,
    memory_cap,
)
from queue_tinker.workers.model.sharded_adapters import ShardedAdapterPool
from queue_tinker.workers.model.tensor_parallel import Shards, check_shardable, shard_decoder
from queue_tinker.workers.model.vision_language import ImageSupport, Vision, is_vl
from queue_tinker.workers.sampling.sessions import QuantumOver, SamplingSessions
from queue_tinker.workers.sampling.slot_decode import decode_step_of
from queue_tinker.workers.training import engine as training_engine
from queue_tinker.workers.training.engine import TrainingEngine
from queue_tinker.workers.training.model_pass import PassPlan, budgeted
from queue_tinker.workers.training.residency import Residency
from queue_tinker.workers.training.rounds import MemoryGuard, TrainingRounds
from queue_tinker.workers.training.saved_state import SavedState

log = logging.getLogger(__name__)

DEFAULT_TRAIN_BATCH_TOKENS = 32_768  # QT_TRAIN_BATCH_TOKENS unset, off CUDA


@dataclass(frozen=True)
class ModelDurability:
    """Durability by the kind of model: a training run's is its snapshot (residency.py); a
    sampling session has no state, so all it ran is durable and nothing is replayed."""

    training: Residency
    sampling: SamplingSessions

    def durable_seq(self, model_id: str) -> int | None:
        if self.sampling.owns(model_id):
            return self.sampling.durable_seq(model_id)
        return self.training.durable_seq(model_id)

    def restore_point(self, model_id: str) -> int | None:
        return self.training.restore_point(model_id)

    def persist(self, model_id: str) -> None:
        self.training.persist(model_id)

    def drop(self, model_id: str) -> None:
        self.training.drop(model_id)
        self.sampling.drop(model_id)


@dataclass(frozen=True)
class GroupRank:
    """A worker group's rank (workers/group/): its share of the base model, and how its decode
    quanta end (every rank takes rank 0's decision, so all take the same steps)."""

    shards: Shards
    quantum_over: QuantumOver | None = None


class LoraExecutor:
    def __init__(
        self,
        base_model: str,
        device: str,
        storage: Path | CheckpointStore,
        models_dir: Path,
        config: EngineConfig | None = None,
        group: GroupRank | None = None,
    ) -> None:
        """`config`: the engine's settings (a worker hands over its settings whole; None: the
        defaults, whatever the environment says). `group`: a worker group rank's share."""
        config = config or EngineConfig()
        shards = group.shards if group is not None else None
        self.base_model = base_model
        # A directory: local storage there (the tests' and the embedded default's way).
        self.store = storage if isinstance(storage, CheckpointStore) else LocalStore(storage)
        self.rules = LoraOpRules(config.cross_adapter_batch)
        self.device = torch.device(device)
        # The same QT_MAX_* limits the client and gateway enforce, again here: an op may come
        # from a client configured otherwise, or straight from Redis.
        self.request_limits = RequestLimits.of(config)
        plan = PassPlan.of(config)
        # Before any weight is loaded: a setting this machine cannot honour stops the worker.
        liger = liger_wanted(config.liger_kernels, self.device, grouped=shards is not None)
        whole_config = None  # a group rank's: the model's config before the split
        if shards is not None:  # before any weight is loaded: a model the group cannot split
            path = base_models.resolve_model_path(base_model, models_dir)
            whole_config = base_models.load_config(path)
            check_shardable(whole_config, shards.world)
        fit = FitSettings.of(config)
        cap = memory_cap(config.device_memory_gib)
        hold_to(self.device, cap)  # before anything is allocated: the card as big as the cap
        fitted = check_fit(
            base_model,
            self.device,
            models_dir,
            config.dtype,
            fit,
            sized=config.max_resident_adapters is None,
            ranks=shards.world if shards is not None else 1,
            cap=cap,
        )
        resident = (fitted.demand.settings if fitted else fit).max_resident_adapters
        # A rank of a worker group keeps its share of each decoder layer, cut in host memory.
        share = None if shards is None else partial(shard_decoder, shards=shards)
        base = base_models.load_frozen_base(base_model, device, models_dir, config.dtype, share)
        if liger:
            apply_liger(base)
        images = ImageSupport(base_model)
        if is_vl(base.config):
            path = base_models.resolve_model_path(base_model, models_dir)
            images = ImageSupport(base_model, Vision(path, base.config))
            # Its 3-D positions are computed per row, so packed rows would attend across datums.
            plan = replace(plan, pack_above_padding=None)
        self.limits = limits = ModelLimits(
            vocab_size=base_models.vocab_size(base), context_length=base_models.context_length(base)
        )
        self.pool = adapter_pool(base, base_model, resident, shards, whole_config)
        self.pool.lora_compute = lora_compute_dtype(base.dtype, config.lora_matmul_dtype)
        lora_copy = lora_copy_bytes(base.dtype.itemsize, config.lora_matmul_dtype)
        # Unset budgets: the CPU defaults, or what the device's free memory holds now.
        # A vision-language model's sizes are its language model's (its text config).
        budgets = device_budgets(
            base.config.get_text_config(),
            self.device,
            base.dtype,
            checkpointing=plan.activation_checkpointing != "off",
            lora_copy=lora_copy,
            cap=cap,
        )
        if budgets is not None and shards is not None:
            # Every rank must split passes and admit samples alike: the smallest GPU's budgets.
            budgets = Budgets(*shards.least(astuple(budgets)))
        if budgets is not None:
            log.info("device budgets from free memory: %s", budgets)
        # auto checkpointing becomes a plan: the fewest layers that fit each pass.
        plan = budgeted(
            plan,
            budgets,
            base.config.get_text_config(),
            base.dtype,
            lora_copy=lora_copy,
            device=self.device if shards is None else None,
            cap=cap,
        )
        saved = SavedState(self.pool, self.store, base_model)
        residency = Residency(self.pool, saved, self.store)
        guard = MemoryGuard(self.device, config.train_batch_tokens or _train_tokens(budgets))
        rounds = TrainingRounds(
            self.pool,
            residency,
            saved,
            guard,
            plan,
            limits,
            config,
            images,
        )
        self.training = TrainingEngine(base_model, self.pool, residency, saved, rounds)
        self.sampling = SamplingSessions(
            config,
            self.pool,
            self.store,
            base_model,
            limits,
            self.device,
            tokenizer=lambda: load_tokenizer(base_model, models_dir),
            budgets=budgets,
            images=images,
            quantum_over=group.quantum_over if group is not None else None,
            decode_step=decode_step_of(config.decode_step, self.device, grouped=shards is not None),
        )
        self.durability = ModelDurability(residency, self.sampling)

    def engine(self) -> Engine:
        """The executor as the worker's runtime sees it."""
        return Engine(
            rules=self.rules,
            ops=self,
            batches=self.training.rounds,
            stepped=self.sampling,
            durability=self.durability,
            footprint=self,
            context_length=self.limits.context_length,
        )

    # --- OpCompute ------------------------------------------------------------------------
    def execute(self, op: Op) -> OpResult:
        check_request_bytes(len(op.payload), self.request_limits)  # before decoding it
        if op.kind is OpKind.PING:
            return run_ping(op)
        if op.kind is OpKind.CREATE_SAMPLING_SESSION:
            return self.sampling.create_session(op)
        if op.kind in training_engine.KINDS:
            return self.training.execute(op)
        if op.kind is OpKind.SAMPLE:  # the rules make it stepped: the runtime never sends it here
            raise RuntimeError("a sample op runs stepped (sampling.join / step), not alone")
        raise UserInputError(f"kind: {op.kind.value!r} is not supported by this worker")

    # --- Footprint ------------------------------------------------------------------------
    def resident(self) -> list[str]:
        return [*self.training.residency.resident(), *self.sampling.sessions]

    def device_memory_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_allocated(self.device))


def adapter_pool(
    base: PreTrainedModel,
    base_model: str,
    resident: int,
    shards: Shards | None,
    whole_config: PretrainedConfig | None,
) -> AdapterPool:
    """One process's pool, or a group rank's over its share of the base (`whole_config`: the
    model's config before the split, which a fresh adapter's weights are drawn for)."""
    if shards is None or whole_config is None:
        return AdapterPool(base, base_model, resident)
    return ShardedAdapterPool(base, base_model, resident, shards, whole_config)


def check_fit(
    base_model: str,
    device: torch.device,
    models_dir: Path,
    dtype: str,
    settings: FitSettings,
    *,
    sized: bool = False,
    ranks: int = 1,
    cap: int | None = None,
) -> FitPlan | None:
    """Before any weight is loaded: the fit plan for the CUDA device's total memory, or
    WorkerFitError naming its numbers when the base model, the resident adapters and the
    budgets do not fit it. `sized`: the resident adapters were not set, so the plan keeps as
    many as fit (at most settings' count) and refuses only when not even one does. None on
    the CPU, where no check is made: there is no device memory to plan, and the budgets
    there are the settings' defaults. `ranks`: a worker group's, each holding its share on
    a device like this one. `cap`: QT_DEVICE_MEMORY_GIB, in bytes (device_memory)."""
    if device.type != "cuda":
        return None
    path = base_models.resolve_model_path(base_model, models_dir)
    # A vision-language model's config: the planner counts its vision tower too.
    config = base_models.load_config(path)
    _free, total = device_memory(device, cap)
    dtype_bytes = base_models.resolve_dtype(dtype, device.type).itemsize
    what = f"{base_model} on {device}" if ranks == 1 else f"{base_model} on {ranks} x {device}"
    if sized:
        plan = fit_resident_adapters(config, dtype_bytes, total, settings, what, ranks)
    else:
        plan = require_fit(config, dtype_bytes, total, settings, what, ranks)
    log.info("%s: %s", what, plan.explanation())
    return plan


def _train_tokens(budgets: Budgets | None) -> int:
    return budgets.train_batch_tokens if budgets else DEFAULT_TRAIN_BATCH_TOKENS
