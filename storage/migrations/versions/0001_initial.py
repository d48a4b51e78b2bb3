"""The request log and the audit log as the first schema (the old `schema_version` 1).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "request_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("task", sa.String(16), nullable=False),
        sa.Column("tier", sa.String(16)),
        sa.Column("latency_ms", sa.Float, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error_code", sa.String(64)),
        sa.Column("key_digest", sa.String(32)),
        sa.Column("model_version", sa.String(64), nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("top_label", sa.String(128)),
    )
    op.create_index("ix_request_log_at", "request_log", ["at"])
    op.create_index("ix_request_log_key", "request_log", ["key_digest"])
    op.create_table(
        "admin_audit",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("params", sa.Text, nullable=False),
        sa.Column("result", sa.Text, nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
    )
