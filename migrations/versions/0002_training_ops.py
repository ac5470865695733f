"""Training ops: new request kinds; checkpoints get an expiry index and deleted_at.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from queue_tinker.store.models import in_values_sql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_OP_KINDS = ("create_model", "ping")
OP_KINDS = (
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


def _replace_kind_check(kinds: tuple[str, ...]) -> None:
    op.drop_constraint(op.f("ck_requests_kind"), "requests", type_="check")
    op.create_check_constraint(op.f("ck_requests_kind"), "requests", in_values_sql("kind", kinds))


def upgrade() -> None:
    _replace_kind_check(OP_KINDS)
    op.add_column("checkpoints", sa.Column("deleted_at", sa.DateTime(timezone=True)))
    op.create_index(op.f("ix_checkpoints_expires_at"), "checkpoints", ["expires_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_checkpoints_expires_at"), table_name="checkpoints")
    op.drop_column("checkpoints", "deleted_at")
    op.execute(
        sa.text("DELETE FROM requests WHERE kind NOT IN :kinds").bindparams(
            sa.bindparam("kinds", OLD_OP_KINDS, expanding=True)
        )
    )
    _replace_kind_check(OLD_OP_KINDS)
