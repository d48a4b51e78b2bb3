"""request_log.replica and admin_audit.replica: which replica served or acted.

Replicas of a fleet share one database; the console counts them all and can tell them apart.
Rows written before this revision have NULL.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("request_log", sa.Column("replica", sa.String(64)))
    op.add_column("admin_audit", sa.Column("replica", sa.String(64)))
