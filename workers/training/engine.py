"""Every TrainingClient op on one base model's adapters: create_model, forward,
forward_backward and optim_step (in rounds: one op, or many models' steps in one shared pass),
save_state / save_weights_for_sampler / save_weights_external, load_state and unload_model.

Runs on the worker's compute thread; knows no Redis and no SQL. State that must outlive this
process goes to storage (saved_state.py), a directory every worker of the deployment shares.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from queue_tinker.errors import StorageUnavailableError, UserInputError
from queue_tinker.types import OpKind, codec
from queue_tinker.types.model_names import check_served_name
from queue_tinker.types.requests.training import MAX_MOE_LORA_RANK, CreateModelInput, LoraConfig
from queue_tinker.types.service.ops import Op
from queue_tinker.workers.interface import TRAIN_BATCH_KINDS, OpResult, parse_body
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.checkpoints import snapshot_key, stored_meta
from queue_tinker.workers.training.residency import Residency
from queue_tinker.workers.training.rounds import TrainingRounds
from queue_tinker.workers.training.saved_state import SavedState

KINDS = TRAIN_BATCH_KINDS | {
    OpKind.CREATE_MODEL,
    OpKind.SAVE_STATE,
    OpKind.SAVE_WEIGHTS_FOR_SAMPLER,
    OpKind.SAVE_WEIGHTS_EXTERNAL,
    OpKind.LOAD_STATE,
    OpKind.UNLOAD_MODEL,
}


def default_seed(model_id: str) -> int:
    """A model created without a seed still initialises the same way every time (replay)."""
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "big")


class TrainingEngine:
    def __init__(
        self,
        base_model: str,
        pool: AdapterPool,
        residency: Residency,
        saved: SavedState,
        rounds: TrainingRounds,
    ) -> None:
        self.base_model = base_model
        self.pool = pool
        self.residency = residency
        self.saved = saved
        self.rounds = rounds
        # What a checkpoint op runs on its model's adapter.
        self._checkpoint_ops: dict[OpKind, Callable[[Adapter, Op], OpResult]] = {
            OpKind.SAVE_STATE: saved.save_state,
            OpKind.SAVE_WEIGHTS_FOR_SAMPLER: saved.save_for_sampler,
            OpKind.SAVE_WEIGHTS_EXTERNAL: saved.save_external,
            OpKind.LOAD_STATE: saved.load_state,
            OpKind.UNLOAD_MODEL: saved.unload,
        }

    def execute(self, op: Op) -> OpResult:
        """One training op; its error raised (bad input fails only this op)."""
        if op.kind is OpKind.CREATE_MODEL:
            return self._create(op)
        if op.kind in TRAIN_BATCH_KINDS:  # the same rounds as a batch of many models' ops
            (outcome,) = self.rounds.run([op])
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        adapter = self.residency.admit(op)
        if isinstance(adapter, OpResult):
            return adapter
        result = self._checkpoint_ops[op.kind](adapter, op)
        adapter.last_seq = op.seq
        return result

    def _create(self, op: Op) -> OpResult:
        body = parse_body(CreateModelInput, op.payload)
        cap = check_served_name(body.base_model, self.base_model, self.rounds.limits.context_length)
        if self.pool.get(op.model_id) is None:
            if stored_meta(self.saved.store, snapshot_key(op.model_id)) is not None:
                self.residency.get(op.model_id)  # created before, by an earlier owner
            else:
                config = body.lora_config
                self._check_rank(config)
                seed = config.seed if config.seed is not None else default_seed(op.model_id)
                adapter = self.residency.add(op.model_id, body.tenant_id, config, seed)
                adapter.last_seq = op.seq
                adapter.context_cap = cap
                try:
                    # From here on the model survives its worker. Without it, no other worker
                    # could restore the model: the create fails (retryably) instead.
                    self.saved.write_snapshot(adapter)
                except StorageUnavailableError:
                    self.pool.remove(op.model_id)
                    raise
        return OpResult(result=codec.encode({"model_id": op.model_id}))

    def _check_rank(self, config: LoraConfig) -> None:
        """Tinker's rank cap on mixture-of-experts models (whose experts LoRA adapts)."""
        if self.pool.expert_parameters and config.rank > MAX_MOE_LORA_RANK:
            raise UserInputError(
                f"lora_config.rank: {config.rank} exceeds the max LoRA rank {MAX_MOE_LORA_RANK} "
                f"for {self.base_model} (a mixture-of-experts model)"
            )
