"""What the cache is told (its key prefix and lifetimes) and what a flush answers: plain values."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CachePolicy:
    prefix: str
    l1_ttl_s: float
    l2_ttl_s: int
    negative_ttl_s: int

    @property
    def meta_prefix(self) -> str:
        """Keys under this prefix are bookkeeping (the generation), never flushed."""
        return f"{self.prefix}:meta:"


@dataclass(frozen=True)
class FlushResult:
    tier: str
    l1_removed: int
    l2_removed: int | None  # None when there is no L2 or it could not be reached
    l2_error: str | None = None
