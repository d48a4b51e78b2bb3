"""Alembic's environment: runs on the connection `storage.sql.migrate` hands it.

`migrate` opens that connection, takes the migration lock (a PostgreSQL advisory lock or an
SQLite exclusive transaction) and passes it in `config.attributes["connection"]`, so every
revision runs inside that one locked transaction.
"""

from __future__ import annotations

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through storage.sql.migrate(), which holds the migration lock")
context.configure(connection=connection, target_metadata=None)
with context.begin_transaction():
    context.run_migrations()
