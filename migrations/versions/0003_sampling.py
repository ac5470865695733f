"""Sampling: the sampling_sessions table and the create_sampling_session request kind.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from queue_tinker.store.models import in_values_sql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_OP_KINDS = (
    "create_model",
    "ping",
    "forward",
    "forward_backward",
    "optim_step",
    "save_state",
    "save_weights_for_sampler",
    "load_state",
    "unload_model",
    "sample",
)
OP_KINDS = (*OLD_OP_KINDS, "create_sampling_session")


def _replace_kind_check(kinds: tuple[str, ...]) -> None:
    op.drop_constraint(op.f("ck_requests_kind"), "requests", type_="check")
    op.create_check_constraint(op.f("ck_requests_kind"), "requests", in_values_sql("kind", kinds))


def upgrade() -> None:
    _replace_kind_check(OP_KINDS)
    op.create_table(
        "sampling_sessions",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=True),  # no FK: records arrive out of order
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("model_path", sa.Text(), nullable=True),  # NULL: the base model
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sampling_sessions")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_sampling_sessions_tenant_id_tenants")
        ),
    )


def downgrade() -> None:
    op.drop_table("sampling_sessions")
    op.execute(
        sa.text("DELETE FROM requests WHERE kind NOT IN :kinds").bindparams(
            sa.bindparam("kinds", OLD_OP_KINDS, expanding=True)
        )
    )
    _replace_kind_check(OLD_OP_KINDS)
