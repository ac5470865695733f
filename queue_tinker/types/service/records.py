"""Record events: what the queue tells the durable Postgres record, via a Redis stream.

Each event is a full snapshot of the fields known at that moment, so the recorder can apply
events in any order and batch them (see queue_tinker/store/record_writer.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from queue_tinker.types.enums import CheckpointKind, JobStatus, OpKind


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SessionRecord(_Record):
    type: Literal["session"] = "session"
    id: str
    tenant_id: str
    created_at: float  # unix seconds
    last_heartbeat_at: float | None = None


class ModelRecord(_Record):
    """A training run: one model (LoRA adapter) on a base model."""

    type: Literal["model"] = "model"
    id: str
    tenant_id: str
    session_id: str | None = None
    base_model: str
    lora_config: dict[str, Any]
    user_metadata: dict[str, str] | None = None
    created_at: float


class SamplingSessionRecord(_Record):
    """A sampling client's queue, on a checkpoint (model_path) or the base model."""

    type: Literal["sampling_session"] = "sampling_session"
    id: str
    tenant_id: str
    session_id: str | None = None
    base_model: str
    model_path: str | None = None
    created_at: float


class RequestRecord(_Record):
    """One op of one model, at some point of its life."""

    type: Literal["request"] = "request"
    id: str
    model_id: str
    seq: int
    kind: OpKind
    status: JobStatus
    tenant_id: str
    idempotency_key: str | None = None
    queued_at: float
    started_at: float | None = None
    finished_at: float | None = None
    worker_id: str | None = None
    attempts: int = 0
    metrics: dict[str, float] | None = None
    error: str | None = None
    error_category: str | None = None
    error_detail: str | None = None  # the worker's traceback, for server errors


class WorkerRecord(_Record):
    type: Literal["worker"] = "worker"
    id: str
    base_model: str
    device: str
    host: str
    pid: int
    started_at: float
    last_heartbeat_at: float
    stopped_at: float | None = None


class CheckpointRecord(_Record):
    """A checkpoint written by a worker (or its files removed, with deleted_at)."""

    type: Literal["checkpoint"] = "checkpoint"
    id: str  # the tinker:// path: unique, and what users hold
    model_id: str
    tenant_id: str
    name: str
    kind: CheckpointKind
    path: str
    size_bytes: int
    created_at: float
    expires_at: float | None = None
    deleted_at: float | None = None
    ephemeral: bool = False  # weights behind a sampling client, not one of the user's checkpoints


Record = Annotated[
    SessionRecord
    | ModelRecord
    | SamplingSessionRecord
    | RequestRecord
    | WorkerRecord
    | CheckpointRecord,
    Field(discriminator="type"),
]
RECORD_ADAPTER: TypeAdapter[Record] = TypeAdapter(Record)
