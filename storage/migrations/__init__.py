"""Alembic migrations of the request and audit logs (run by `storage.sql.migrate`)."""
