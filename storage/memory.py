"""L1: an in-process LRU store bounded by bytes, with a TTL per entry.

Its own structure rather than cachetools' TLRUCache: a cached hit reads L1 twice (the raw
input's alias, then the answer), and TLRUCache's read goes through five Python calls and a
timer context (~2.5 us); here it is one dict lookup, an expiry compare and a move to the end.
An OrderedDict in least-recently-used order holds [value, size, expires]; a heap of
(expires, sequence, key) finds what has expired, its stale items skipped when popped.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MemoryStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    max_bytes: int


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
        self._timer = timer
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0  # to make room; an expiry, a delete or a clear is not one
        self._bytes = 0
        self._items: OrderedDict[str, list[Any]] = OrderedDict()  # key -> [value, size, expires]
        self._expiries: list[tuple[float, int, str]] = []  # a heap; an item replaced since is stale
        self._sequence = itertools.count()

    def get(self, key: str) -> Any | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                if self._timer() < item[2]:
                    self._items.move_to_end(key)
                    self._hits += 1
                    return item[0]
                self._remove(key)
            self._misses += 1
            return None

    def set(self, key: str, value: Any, *, size: int, ttl_s: float | None = None) -> bool:
        """Store `value`; returns False when it is larger than the whole budget."""
        ttl = self._default_ttl_s if ttl_s is None else ttl_s
        if size > self._max_bytes or ttl <= 0:
            return False
        with self._lock:
            now = self._timer()
            if key in self._items:
                self._remove(key)
            if self._bytes + size > self._max_bytes:
                self._expire(now)
                while self._bytes + size > self._max_bytes:  # the least recently used make room
                    self._remove(next(iter(self._items)))
                    self._evictions += 1
            expires = now + ttl
            self._items[key] = [value, size, expires]
            self._bytes += size
            heapq.heappush(self._expiries, (expires, next(self._sequence), key))
            if len(self._expiries) > 2 * len(self._items) + 64:  # stale heap items from overwrites
                self._rebuild_expiries()
        return True

    def peek(self, key: str) -> Any | None:
        """The value without counting a hit or a miss (an operator looking, not a request)."""
        with self._lock:
            item = self._items.get(key)
            return item[0] if item is not None and self._timer() < item[2] else None

    def delete(self, key: str) -> bool:
        with self._lock:
            if key not in self._items:
                return False
            alive = self._timer() < self._items[key][2]
            self._remove(key)
            return alive

    def clear(self) -> int:
        with self._lock:
            self._expire(self._timer())
            count = len(self._items)
            self._items.clear()
            self._expiries.clear()
            self._bytes = 0
        return count

    def stats(self) -> MemoryStats:
        with self._lock:
            self._expire(self._timer())
            return MemoryStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                entries=len(self._items),
                bytes=self._bytes,
                max_bytes=self._max_bytes,
            )

    # ---- under the lock -------------------------------------------------------------

    def _remove(self, key: str) -> None:
        self._bytes -= self._items.pop(key)[1]

    def _expire(self, now: float) -> None:
        expiries, items = self._expiries, self._items
        while expiries and expiries[0][0] <= now:
            expires, _, key = heapq.heappop(expiries)
            item = items.get(key)
            if item is not None and item[2] == expires:  # not replaced since this heap item
                self._remove(key)

    def _rebuild_expiries(self) -> None:
        self._expiries = [(item[2], next(self._sequence), key) for key, item in self._items.items()]
        heapq.heapify(self._expiries)
