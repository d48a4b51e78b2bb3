"""L1: an in-process LRU store bounded by bytes, with a TTL per entry."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachetools import TLRUCache


@dataclass(frozen=True)
class MemoryStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    max_bytes: int


@dataclass(frozen=True)
class _Item:
    value: Any
    size: int
    ttl_s: float


class _CountingTLRU(TLRUCache):
    """TLRUCache that counts capacity evictions (expiry is not an eviction)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.evictions = 0

    def popitem(self) -> Any:
        item = super().popitem()
        self.evictions += 1
        return item


class MemoryStore:
    """Thread-safe LRU bounded by `max_bytes`; each entry expires after its own TTL.

    Sizes are given by the caller (the encoded size of the value), so the budget
    counts what the entry really costs rather than the number of entries.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        default_ttl_s: float,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_bytes = max_bytes
        self._default_ttl_s = default_ttl_s
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._cache = _CountingTLRU(
            maxsize=max(max_bytes, 1),
            ttu=lambda _key, item, now: now + item.ttl_s,
            timer=timer,
            getsizeof=lambda item: item.size,
        )

    def get(self, key: str) -> Any | None:
        with self._lock:
            item = self._cache.get(key)
            if item is None:
                self._misses += 1
                return None
            self._hits += 1
            return item.value

    def set(self, key: str, value: Any, *, size: int, ttl_s: float | None = None) -> bool:
        """Store `value`; returns False when it is larger than the whole budget."""
        ttl = self._default_ttl_s if ttl_s is None else ttl_s
        if size > self._max_bytes or ttl <= 0:
            return False
        with self._lock:
            self._cache[key] = _Item(value, size, ttl)
        return True

    def peek(self, key: str) -> Any | None:
        """The value without counting a hit or a miss (an operator looking, not a request)."""
        with self._lock:
            item = self._cache.get(key)
        return None if item is None else item.value

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._cache.pop(key, None) is not None

    def clear(self) -> int:
        with self._lock:
            self._cache.expire()
            count = len(self._cache)
            evictions = self._cache.evictions
            self._cache.clear()  # clears through popitem(): not evictions
            self._cache.evictions = evictions
        return count

    def stats(self) -> MemoryStats:
        with self._lock:
            self._cache.expire()
            return MemoryStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._cache.evictions,
                entries=len(self._cache),
                bytes=int(self._cache.currsize),
                max_bytes=self._max_bytes,
            )
