"""Operator console: stats, charts, flush and version bump, authentication."""
