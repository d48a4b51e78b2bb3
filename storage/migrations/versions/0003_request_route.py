"""request_log.route: which front door a request came through, gradio or rest (old version 3).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("request_log", sa.Column("route", sa.String(16)))
