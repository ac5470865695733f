"""A training run's state in checkpoint storage: its snapshot (what the next owner
restores, with the outcomes of the ops it covers whose results may not have been published)
and the named checkpoints its user saves and loads.

Runs on the worker's compute thread, like the engine; knows no Redis and no SQL.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from queue_tinker.age import check_recipients
from queue_tinker.errors import (
    ErrorCategory,
    QueueTinkerError,
    StorageUnavailableError,
    UserInputError,
)
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.types import CheckpointKind, CheckpointRecord, codec
from queue_tinker.types.requests.training import (
    LoadInput,
    LoadWeightsResponse,
    LoraConfig,
    SaveInput,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    UnloadModelResponse,
)
from queue_tinker.types.service.checkpoints import CheckpointPath, check_name, loadable
from queue_tinker.types.service.ops import Op
from queue_tinker.workers.interface import OpResult, ResultOrError, parse_body
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.checkpoints import (
    CheckpointMeta,
    checkpoint_key,
    snapshot_key,
    stored_meta,
    stored_meta_version,
    stored_state,
    write_state,
)

log = logging.getLogger(__name__)

UNLOADED = "_unloaded"  # marker file: the model was unloaded; its ops fail from then on
# Adapter.extra key: seq -> kept outcome (JSON) of the ops the snapshot the adapter came from
# holds but whose results may never have been published (residency.py).
SNAPSHOT_RESULTS = "snapshot_results"


class SavedState:
    """Snapshots and named checkpoints of the adapters in `pool`, in `store`."""

    def __init__(self, pool: AdapterPool, store: CheckpointStore, base_model: str) -> None:
        self.pool = pool
        self.store = store
        self.base_model = base_model
        # The outcomes of the ops run so far in the batch being run, per model (rounds.py
        # records them; the worker publishes them when the whole batch is done): a snapshot
        # written meanwhile keeps them (residency.py's kept results).
        self.unpublished: dict[str, dict[int, ResultOrError]] = {}

    def snapshot(self, adapter: Adapter, result: OpResult | None = None) -> None:
        """Write the adapter's state as the model's snapshot. `result`: the outcome of the op
        being run (adapter.last_seq), which the snapshot already contains; it is kept with it,
        because the op's publish may never happen (the worker dies first) and the next owner,
        starting from this snapshot, must publish that result instead of running the op again.
        The same holds for the model's ops run earlier in the batch being run: their outcomes
        are kept too.
        """
        try:
            self.write_snapshot(adapter, result)
        except StorageUnavailableError as err:
            # The snapshot only moves durability on: the op's own effect is in memory and its
            # log entry stays (the log is trimmed only up to a snapshot written), so the op
            # succeeds and the next snapshot tries again.
            log.warning("model %s: snapshot not written (%s)", adapter.model_id, err)

    def write_snapshot(self, adapter: Adapter, result: OpResult | None = None) -> None:
        """snapshot(), its storage errors raised (a new model's first snapshot must land)."""
        key = snapshot_key(adapter.model_id)
        # The version read with the seq: the write lands only over this very snapshot, so a
        # newer owner's written in between (this worker cut off, its upload late) stays.
        stored, version = stored_meta_version(self.store, key)
        if stored is not None and stored.seq > adapter.last_seq:
            # Another worker owns the model now and has gone further (this one stalled past
            # its lease and has not heard yet). Going back would lose the steps in between:
            # the log is trimmed up to the newer snapshot.
            log.warning(
                "model %s: not overwriting the snapshot at seq %d with older state (seq %d)",
                adapter.model_id,
                stored.seq,
                adapter.last_seq,
            )
            return
        # Only ops the snapshot's state covers: an op after it (one that failed, leaving
        # last_seq behind it) is run again by the next owner, not taken from here.
        earlier = {
            seq: outcome
            for seq, outcome in self.unpublished.get(adapter.model_id, {}).items()
            if seq <= adapter.last_seq
        }
        meta = self.meta(
            adapter,
            kind="snapshot",
            op_result=result_to_json(result) if result is not None else None,
            batch_results={str(seq): outcome_to_json(outcome) for seq, outcome in earlier.items()},
        )
        write_state(
            self.store,
            key,
            self.pool.export(adapter, meta),
            self.pool.peft_adapter_config(adapter),
            optimizer=True,
            grads=True,
            expect=version,
        )
        adapter.snapshot_seq = adapter.last_seq

    def meta(self, adapter: Adapter, kind: str, **extra: Any) -> CheckpointMeta:
        return CheckpointMeta(
            model_id=adapter.model_id,
            tenant_id=adapter.tenant_id,
            base_model=self.base_model,
            lora_config=adapter.config.model_dump(),
            seq=adapter.last_seq,
            step=adapter.step,
            created_at=time.time(),
            kind=kind,
            context_cap=adapter.context_cap,
            **extra,
        )

    def save_state(self, adapter: Adapter, op: Op) -> OpResult:
        path, record = self._save(adapter, op, CheckpointKind.STATE)
        response = SaveWeightsResponse(path=str(path))
        return OpResult(result=codec.encode(response.model_dump()), records=[record])

    def save_for_sampler(self, adapter: Adapter, op: Op) -> OpResult:
        path, record = self._save(adapter, op, CheckpointKind.SAMPLER)
        response = SaveWeightsForSamplerResponse(path=str(path))
        return OpResult(result=codec.encode(response.model_dump()), records=[record])

    def save_external(self, adapter: Adapter, op: Op) -> OpResult:
        """The PEFT files (adapter_config.json, adapter_model.safetensors) for download,
        each encrypted to the age recipients when there are any."""
        path, record = self._save(adapter, op, CheckpointKind.EXTERNAL)
        response = SaveWeightsExternalResponse(path=str(path), size_bytes=record.size_bytes)
        return OpResult(result=codec.encode(response.model_dump()), records=[record])

    def _save(
        self, adapter: Adapter, op: Op, kind: CheckpointKind
    ) -> tuple[CheckpointPath, CheckpointRecord]:
        body = parse_body(SaveInput, op.payload)
        if body.age_encryption_recipients and kind is not CheckpointKind.EXTERNAL:
            raise UserInputError(
                "age_encryption_recipients: only external weights are "
                "encrypted (save_weights_external)"
            )
        recipients = check_recipients(body.age_encryption_recipients)
        path = CheckpointPath(adapter.model_id, kind, check_name(body.name))
        key = checkpoint_key(path)
        existing = stored_meta(self.store, key)
        now = time.time()
        expires_at = now + body.ttl_seconds if body.ttl_seconds else None
        if existing is not None and existing.seq != op.seq:
            raise UserInputError(
                f"name: {body.name!r} is already a {kind.value} checkpoint of this model "
                f"({path}); checkpoints are never overwritten, pick a new name"
            )
        adapter.last_seq = op.seq
        meta = self.meta(adapter, kind=kind.value, id=str(path), expires_at=expires_at)
        if existing is None:
            size = write_state(
                self.store,
                key,
                self.pool.export(adapter, meta),
                self.pool.peft_adapter_config(adapter),
                optimizer=kind is CheckpointKind.STATE,
                encrypt_to=recipients,  # before the set is visible: never plain in storage
            )
        else:  # a replay of this op: the set is there, whole
            size = sum(self.store.files(key).values())
        record = CheckpointRecord(
            id=str(path),
            model_id=adapter.model_id,
            tenant_id=adapter.tenant_id,
            name=body.name,
            kind=kind,
            path=self.store.location(key),
            size_bytes=size,
            created_at=now,
            expires_at=expires_at,
            ephemeral=body.ephemeral,
        )
        return path, record

    def load_state(self, adapter: Adapter, op: Op) -> OpResult:
        body = parse_body(LoadInput, op.payload)
        path = loadable(CheckpointPath.parse(body.path))
        if body.optimizer and path.kind is not CheckpointKind.STATE:
            raise UserInputError(
                f"path: {body.path} holds weights only (sampler weights); optimizer state "
                "comes from a tinker://<run>/weights/<name> checkpoint"
            )
        key = checkpoint_key(path)
        meta = stored_meta(self.store, key)
        # Another tenant's checkpoint is reported exactly like a missing one, unless published.
        if meta is None or (meta.tenant_id != adapter.tenant_id and not meta.public):
            raise UserInputError(f"path: no checkpoint at {body.path}")
        self._check_compatible(adapter, meta, body.path)
        state = stored_state(self.store, key, optimizer=body.optimizer)
        self.pool.load_weights(adapter, state.weights)
        # load_state resets the optimizer (moments and step count); with_optimizer restores them.
        self.pool.load_optimizer(adapter, state)
        self.pool.load_grads(adapter, {})
        adapter.step = state.meta.step if body.optimizer else 0
        adapter.last_seq = op.seq
        result = OpResult(result=codec.encode(LoadWeightsResponse(path=body.path).model_dump()))
        self.snapshot(adapter, result)
        return result

    def _check_compatible(self, adapter: Adapter, meta: CheckpointMeta, path: str) -> None:
        if meta.base_model != self.base_model:
            raise UserInputError(
                f"path: {path} was trained on {meta.base_model}, this model is on {self.base_model}"
            )
        theirs = LoraConfig.model_validate(meta.lora_config).model_dump(exclude={"seed"})
        ours = adapter.config.model_dump(exclude={"seed"})
        if theirs != ours:
            raise UserInputError(
                f"path: {path} has LoRA config {theirs}, this model has {ours}; they must match"
            )

    def unload(self, adapter: Adapter, op: Op) -> OpResult:
        self.pool.remove(adapter.model_id)
        self.store.remove(snapshot_key(adapter.model_id))
        self.store.mark(adapter.model_id, UNLOADED)
        return OpResult(
            result=codec.encode(UnloadModelResponse(model_id=adapter.model_id).model_dump())
        )


def outcome_to_json(outcome: ResultOrError) -> dict[str, Any]:
    """An op's result, or its error as the worker would publish it, as JSON for a snapshot."""
    if isinstance(outcome, OpResult):
        return result_to_json(outcome)
    if isinstance(outcome, QueueTinkerError):
        return {"error": outcome.message, "category": outcome.category.value}
    return {"error": f"{type(outcome).__name__}: {outcome}", "category": ErrorCategory.SERVER.value}


def outcome_from_json(kept: dict[str, Any]) -> OpResult:
    """A kept outcome: the result, or its error raised again."""
    if "error" in kept:
        category = ErrorCategory(kept["category"])
        if category is ErrorCategory.USER:
            raise UserInputError(kept["error"])
        raise QueueTinkerError(kept["error"], category=category)
    return result_from_json(kept)


def result_to_json(result: OpResult) -> dict[str, Any]:
    """An op's outcome as JSON for a snapshot's meta (its records are not kept: the ops that
    snapshot write none)."""
    return {
        "result": base64.b64encode(result.result).decode(),
        "metrics": result.metrics,
        "tokens": result.tokens,
    }


def result_from_json(kept: dict[str, Any]) -> OpResult:
    return OpResult(
        result=base64.b64decode(kept["result"]),
        metrics=kept.get("metrics"),
        tokens=int(kept.get("tokens", 0)),
    )
