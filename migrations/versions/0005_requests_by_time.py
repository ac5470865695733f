"""Requests by time: the dashboard lists the newest requests (everyone's, or one tenant's)
every few seconds; without these it would scan the whole table each time.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_requests_queued_at", "requests", ["queued_at"])
    op.create_index("ix_requests_tenant_id_queued_at", "requests", ["tenant_id", "queued_at"])


def downgrade() -> None:
    op.drop_index("ix_requests_tenant_id_queued_at", table_name="requests")
    op.drop_index("ix_requests_queued_at", table_name="requests")
