"""The one error a bad setting raises."""

from __future__ import annotations


class SettingsError(ValueError):
    """An environment variable holds a value the app cannot run with."""
