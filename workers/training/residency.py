"""The training runs resident on this worker: each run's adapter, made resident from its
snapshot in storage when it is not (the least recently used one evicted to storage to make
room), the kept results of ops a restored snapshot already holds, and what of each run is
durable (the runtime's Durability, for training runs)."""

from __future__ import annotations

import logging

from queue_tinker.errors import QueueTinkerError, UserInputError
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.types.service.ops import Op
from queue_tinker.workers.interface import OpResult
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.checkpoints import snapshot_key, stored_meta, stored_state
from queue_tinker.workers.training.saved_state import (
    SNAPSHOT_RESULTS,
    UNLOADED,
    SavedState,
    outcome_from_json,
)

log = logging.getLogger(__name__)


class Residency:
    def __init__(self, pool: AdapterPool, saved: SavedState, store: CheckpointStore) -> None:
        self.pool = pool
        self.saved = saved
        self.store = store

    def admit(self, op: Op) -> Adapter | OpResult:
        """The op's adapter, made resident; or, for an op the state already holds, its kept
        result."""
        adapter = self.get(op.model_id)
        if op.seq <= adapter.last_seq:
            return self._already_applied(adapter, op)
        adapter.extra.pop(SNAPSHOT_RESULTS, None)  # the state moves on: no op of them comes again
        return adapter

    def get(self, model_id: str) -> Adapter:
        """The run's adapter, restored from its snapshot if it is not resident."""
        adapter = self.pool.get(model_id)
        if adapter is not None:
            return adapter
        if self.store.read_text(model_id, UNLOADED) is not None:
            raise UserInputError(f"model {model_id} was unloaded; create a new training client")
        try:
            state = stored_state(self.store, snapshot_key(model_id), optimizer=True, grads=True)
        except FileNotFoundError:
            # Created, but its state never reached storage: its worker died before the first
            # snapshot. Rebuilding it by replaying the op log is the recovery path.
            raise QueueTinkerError(f"model {model_id}: no saved state to restore it from") from None
        adapter = self.add(
            model_id,
            state.meta.tenant_id,
            LoraConfig.model_validate(state.meta.lora_config),
            seed=0,
        )
        self.pool.load_weights(adapter, state.weights)
        self.pool.load_optimizer(adapter, state)
        self.pool.load_grads(adapter, state.grads)
        adapter.step = state.meta.step
        adapter.context_cap = state.meta.context_cap
        adapter.last_seq = adapter.snapshot_seq = state.meta.seq
        kept = {int(seq): outcome for seq, outcome in state.meta.batch_results.items()}
        if state.meta.op_result is not None:
            kept[state.meta.seq] = state.meta.op_result
        if kept:
            adapter.extra[SNAPSHOT_RESULTS] = kept
        return adapter

    def add(self, model_id: str, tenant_id: str, config: LoraConfig, seed: int) -> Adapter:
        """A fresh adapter, after evicting the least recently used ones beyond max_resident
        (their state written to storage first)."""
        for victim in self.pool.over_capacity():
            log.info("evicting %s (least recently used) to storage", victim.model_id)
            self.persist(victim.model_id)
            self.pool.remove(victim.model_id)
        return self.pool.add(model_id, tenant_id, config, seed)

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

    # --- Durability, for training runs -------------------------------------------------------
    def durable_seq(self, model_id: str) -> int | None:
        adapter = self.pool.adapters.get(model_id)
        return adapter.snapshot_seq if adapter is not None and adapter.snapshot_seq else None

    def restore_point(self, model_id: str) -> int | None:
        adapter = self.pool.adapters.get(model_id)
        if adapter is not None:
            return adapter.last_seq
        meta = stored_meta(self.store, snapshot_key(model_id))
        # No snapshot: a sampling session (no state), or a run that never got created.
        return meta.seq if meta is not None else None

    def persist(self, model_id: str) -> None:
        adapter = self.pool.adapters.get(model_id)
        if adapter is not None and adapter.last_seq > adapter.snapshot_seq:
            self.saved.snapshot(adapter)

    def drop(self, model_id: str) -> None:
        self.pool.remove(model_id)

    def resident(self) -> list[str]:
        return list(self.pool.adapters)
