"""The bottom of the project's exception tree (drawn in `engine/errors.py`, which
re-exports these): the stores raise them, and storage imports nothing above itself."""

from __future__ import annotations


class InferenceCacheError(Exception):
    """Base of every error this project raises on purpose."""


class CacheUnavailableError(InferenceCacheError):
    """A cache tier (Redis) is down, slow or switched off."""


class CacheSkippedError(CacheUnavailableError):
    """A call to one primary of a Redis Cluster not sent, its breaker being open: it cost no
    time, so the same request may still use the cluster's other primaries."""
