"""External weights: the save_weights_external request kind and the `external` checkpoint kind
(tinker://<run>/external_weights/<name>, the PEFT files exported for download).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from queue_tinker.store.models import in_values_sql

revision: str = "0007"
down_revision: str | None = "0006"
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
    "create_sampling_session",
)
OP_KINDS = (*OLD_OP_KINDS, "save_weights_external")
OLD_CHECKPOINT_KINDS = ("state", "sampler")
CHECKPOINT_KINDS = (*OLD_CHECKPOINT_KINDS, "external")


def _replace_checks(op_kinds: tuple[str, ...], checkpoint_kinds: tuple[str, ...]) -> None:
    op.drop_constraint(op.f("ck_requests_kind"), "requests", type_="check")
    op.create_check_constraint(
        op.f("ck_requests_kind"), "requests", in_values_sql("kind", op_kinds)
    )
    op.drop_constraint(op.f("ck_checkpoints_kind"), "checkpoints", type_="check")
    op.create_check_constraint(
        op.f("ck_checkpoints_kind"), "checkpoints", in_values_sql("kind", checkpoint_kinds)
    )


def upgrade() -> None:
    _replace_checks(OP_KINDS, CHECKPOINT_KINDS)


def downgrade() -> None:
    op.execute("DELETE FROM checkpoints WHERE kind = 'external'")
    op.execute("DELETE FROM requests WHERE kind = 'save_weights_external'")
    _replace_checks(OLD_OP_KINDS, OLD_CHECKPOINT_KINDS)
