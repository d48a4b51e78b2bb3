"""request_log.model_ms: the model's time on a miss, for "model time saved" (old version 2).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("request_log", sa.Column("model_ms", sa.Float))
