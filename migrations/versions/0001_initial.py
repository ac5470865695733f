"""Initial schema: tenants, API keys, sessions, training runs, requests, checkpoints, workers.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Constraint names are wrapped in op.f() so the naming convention of the target metadata
(queue_tinker.store.models.NAMING_CONVENTION) does not prefix them a second time.

The status/kind CHECK lists are spelled out as they were when this revision was written; a
new enum member in queue_tinker/types/enums.py needs a new revision that recreates the
constraint (see 0002).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from queue_tinker.store.models import DEFAULT_TENANT_ID, in_values_sql

JOB_STATUSES = ("queued", "running", "done", "failed")
OP_KINDS = ("create_model", "ping")
CHECKPOINT_KINDS = ("state", "sampler")

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, *, nullable: bool = True, now: bool = False) -> sa.Column[object]:
    default = sa.text("now()") if now else None
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable, server_default=default)


def _text(name: str, *, nullable: bool = False) -> sa.Column[str]:
    return sa.Column(name, sa.Text(), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenants",
        _text("id"),
        _text("name"),
        _ts("created_at", nullable=False, now=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.execute(
        sa.text("INSERT INTO tenants (id, name) VALUES (:id, :id)").bindparams(id=DEFAULT_TENANT_ID)
    )
    op.create_table(
        "api_keys",
        _text("id"),
        _text("tenant_id"),
        _text("key_hash"),  # sha256 hex of the full key; the key itself is never stored
        _text("prefix"),
        _text("name", nullable=True),
        _ts("created_at", nullable=False, now=True),
        _ts("revoked_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants")
        ),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_table(
        "sessions",
        _text("id"),
        _text("tenant_id"),
        _ts("created_at", nullable=False, now=True),
        _ts("last_heartbeat_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_sessions_tenant_id_tenants")
        ),
    )
    op.create_table(
        "training_runs",
        _text("id"),  # the model id
        _text("tenant_id"),
        _text("session_id", nullable=True),  # no FK: records arrive out of order
        _text("base_model"),
        sa.Column("lora_config", JSONB(), nullable=False),
        _ts("created_at", nullable=False, now=True),
        _ts("last_request_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_runs")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_training_runs_tenant_id_tenants")
        ),
    )
    op.create_table(
        "requests",
        _text("id"),
        _text("model_id"),  # no FK: a request may be recorded before its model
        _text("tenant_id"),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        _text("kind"),
        _text("status"),
        _text("idempotency_key", nullable=True),
        _ts("queued_at", nullable=False),
        _ts("started_at"),
        _ts("finished_at"),
        _text("worker_id", nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("metrics", JSONB(), nullable=True),
        _text("error", nullable=True),
        _text("error_category", nullable=True),
        _text("error_detail", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint("model_id", "seq", name=op.f("uq_requests_model_id_seq")),
        sa.CheckConstraint(in_values_sql("status", JOB_STATUSES), name=op.f("ck_requests_status")),
        sa.CheckConstraint(in_values_sql("kind", OP_KINDS), name=op.f("ck_requests_kind")),
    )
    op.create_index(op.f("ix_requests_status"), "requests", ["status"])
    op.create_table(
        "checkpoints",
        _text("id"),
        _text("model_id"),
        _text("tenant_id"),
        _text("name"),
        _text("kind"),
        _text("path"),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        _ts("created_at", nullable=False, now=True),
        _ts("expires_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint(
            "model_id", "kind", "name", name=op.f("uq_checkpoints_model_id_kind_name")
        ),
        sa.CheckConstraint(
            in_values_sql("kind", CHECKPOINT_KINDS), name=op.f("ck_checkpoints_kind")
        ),
    )
    op.create_table(
        "workers",
        _text("id"),
        _text("base_model"),
        _text("device"),
        _text("host"),
        sa.Column("pid", sa.Integer(), nullable=False),
        _ts("started_at", nullable=False),
        _ts("last_heartbeat_at", nullable=False),
        _ts("stopped_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )


def downgrade() -> None:
    # Reverse order of creation: api_keys, sessions and training_runs reference tenants.
    for table in (
        "workers",
        "checkpoints",
        "requests",
        "training_runs",
        "sessions",
        "api_keys",
        "tenants",
    ):
        op.drop_table(table)
