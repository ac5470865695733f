"""ORM rows: the durable record. The schema itself is made only by migrations/ (alembic).

tests/store/test_migrations.py checks these classes match what the migrations build.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Text,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from queue_tinker.types.enums import CheckpointKind, JobStatus, OpKind

DEFAULT_TENANT_ID = "default"

# Explicit constraint names, so the migration can spell the same ones and alembic's
# compare_metadata lines them up.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def in_values_sql(column: str, values: type[StrEnum] | tuple[str, ...]) -> str:
    """`column IN ('a', 'b')` from a closed list, so CHECKs derive from the enums."""
    quoted = ", ".join("'" + str(v).replace("'", "''") + "'" for v in values)
    return f"{column} IN ({quoted})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _ts(*, nullable: bool = True, now: bool = False) -> Mapped[Any]:
    return mapped_column(
        DateTime(timezone=True), nullable=nullable, server_default=func.now() if now else None
    )


class TenantRow(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    created_at: Mapped[datetime] = _ts(nullable=False, now=True)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Text, ForeignKey("tenants.id"))
    key_hash: Mapped[str] = mapped_column(Text, unique=True)  # sha256 hex of the full key
    prefix: Mapped[str] = mapped_column(Text)  # first characters, for display only
    name: Mapped[str | None] = mapped_column(Text)
    # An admin key sees every tenant on the dashboard and may drain workers.
    admin: Mapped[bool] = mapped_column(Boolean, server_default=false())
    created_at: Mapped[datetime] = _ts(nullable=False, now=True)
    revoked_at: Mapped[datetime | None] = _ts()


class SessionRow(Base):
    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Text, ForeignKey("tenants.id"))
    created_at: Mapped[datetime] = _ts(nullable=False, now=True)
    last_heartbeat_at: Mapped[datetime | None] = _ts()


class TrainingRunRow(Base):
    """One model (LoRA adapter on a base model); its id is the model id."""

    __tablename__ = "training_runs"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Text, ForeignKey("tenants.id"))
    # No FK: the write-behind recorder may deliver the model before its session.
    session_id: Mapped[str | None] = mapped_column(Text)
    base_model: Mapped[str] = mapped_column(Text)
    lora_config: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # What the user attached at creation (the cookbook keeps its renderer's name here).
    user_metadata: Mapped[dict[str, str] | None] = mapped_column(JSONB(none_as_null=True))
    created_at: Mapped[datetime] = _ts(nullable=False, now=True)
    last_request_at: Mapped[datetime | None] = _ts()


class SamplingSessionRow(Base):
    """A sampling client's queue: samples from a checkpoint (model_path) or the base model."""

    __tablename__ = "sampling_sessions"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Text, ForeignKey("tenants.id"))
    session_id: Mapped[str | None] = mapped_column(Text)  # no FK, as for training runs
    base_model: Mapped[str] = mapped_column(Text)
    model_path: Mapped[str | None] = mapped_column(Text)  # None: the base model itself
    created_at: Mapped[datetime] = _ts(nullable=False, now=True)


class RequestRow(Base):
    """One op of one model (a training run or a sampling session). model_id is not a FK:
    write-behind may deliver a request before its model's row, and a batch must not fail."""

    __tablename__ = "requests"
    __table_args__ = (
        # Its index also serves lookups by (model_id, seq) and by model_id alone, so no
        # second index on the same columns (it would only slow every insert).
        UniqueConstraint("model_id", "seq"),
        Index(None, "status"),
        # The dashboard's recent requests: newest first, everyone's or one tenant's.
        Index("ix_requests_queued_at", "queued_at"),
        Index("ix_requests_tenant_id_queued_at", "tenant_id", "queued_at"),
        CheckConstraint(in_values_sql("status", JobStatus), name="status"),
        CheckConstraint(in_values_sql("kind", OpKind), name="kind"),
    )

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    model_id: Mapped[str] = mapped_column(Text)
    tenant_id: Mapped[str] = mapped_column(Text)
    seq: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    queued_at: Mapped[datetime] = _ts(nullable=False)
    started_at: Mapped[datetime | None] = _ts()
    finished_at: Mapped[datetime | None] = _ts()
    worker_id: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    # none_as_null: Python None is SQL NULL, not JSON 'null', so COALESCE and IS NULL work.
    metrics: Mapped[dict[str, float] | None] = mapped_column(JSONB(none_as_null=True))
    error: Mapped[str | None] = mapped_column(Text)
    error_category: Mapped[str | None] = mapped_column(Text)
    error_detail: Mapped[str | None] = mapped_column(Text)  # traceback of a server error


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("model_id", "kind", "name"),
        CheckConstraint(in_values_sql("kind", CheckpointKind), name="kind"),
    )

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    model_id: Mapped[str] = mapped_column(Text)
    tenant_id: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(Text)
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _ts(nullable=False, now=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), index=True)
    deleted_at: Mapped[datetime | None] = _ts()  # files removed (TTL expiry); row kept
    # Published: readable by every tenant of the deployment (its meta file says so too).
    public: Mapped[bool] = mapped_column(Boolean, server_default=false())
    # Saved behind a sampling client with no name of the user's: left out of the listings.
    ephemeral: Mapped[bool] = mapped_column(Boolean, server_default=false())


class CustomLossGraphRow(Base):
    """A tenant's uploaded custom loss (queue_tinker/types/requests/custom_loss.py), checked against
    the allow-list before it was stored; its session's forward_backward calls name it."""

    __tablename__ = "custom_loss_graphs"

    id: Mapped[str] = mapped_column(Text, primary_key=True)  # the loss_id
    tenant_id: Mapped[str] = mapped_column(Text, ForeignKey("tenants.id"))
    session_id: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text)
    inputs: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    graph: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = _ts(nullable=False, now=True)


class WorkerRow(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    base_model: Mapped[str] = mapped_column(Text)
    device: Mapped[str] = mapped_column(Text)
    host: Mapped[str] = mapped_column(Text)
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = _ts(nullable=False)
    last_heartbeat_at: Mapped[datetime] = _ts(nullable=False)
    stopped_at: Mapped[datetime | None] = _ts()
