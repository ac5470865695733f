"""Ephemeral checkpoints: checkpoints.ephemeral, set for the sampler weights saved behind a
sampling client with no name of the user's (save_weights_and_get_sampling_client); they are
kept for their TTL and left out of the checkpoint listings.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "checkpoints",
        sa.Column("ephemeral", sa.Boolean(), server_default=sa.false(), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("checkpoints", "ephemeral")
