"""L2 writes that share the Redis round trips other requests make anyway.

A Redis round trip costs CPU on both sides (two wake-ups of two processes), and on a
machine whose cores are busy running the model that CPU comes out of throughput: it
is most of what a cache with a Redis tier costs a new input. So while other requests
of this process are in flight, a request's L2 writes do not cost a round trip of their
own: they wait here and go out

- in front of the next L2 read of any request (one pipeline: the writes, then the GET);
- or with the last request to leave (nothing waits once the process is idle);
- or with whichever request finds them older than `max_delay_s`.

With one request at a time nothing waits: a result is in Redis when its request returns,
as before. Writes keep their order (a result before the raw alias that names it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


class L2Write:
    """One value for L2, already in L1. `sent` once handed to Redis or to the batch."""

    __slots__ = ("blob", "key", "sent", "ttl_s")

    def __init__(self, key: str, blob: bytes, ttl_s: int) -> None:
        self.key = key
        self.blob = blob
        self.ttl_s = ttl_s
        self.sent = False

    def item(self) -> tuple[str, bytes, int]:
        return self.key, self.blob, self.ttl_s


class WriteBatch:
    """Thread-safe: counts the requests in flight and holds their waiting writes."""

    def __init__(self, *, max_delay_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_delay_s = max_delay_s
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._waiting: list[L2Write] = []
        self._oldest = 0.0

    def enter(self) -> None:
        """A request starts."""
        with self._lock:
            self._in_flight += 1

    def leave(self) -> list[L2Write]:
        """A request ends: returns the writes it must send now (it is the last one in
        flight, or they are overdue), else []."""
        with self._lock:
            self._in_flight -= 1
            if self._waiting and (self._in_flight == 0 or self._overdue()):
                return self._take()
            return []

    def add(self, writes: Sequence[L2Write]) -> list[L2Write]:
        """A request has writes: returns what it must send now ([] when they can wait
        for another request's round trip; else the waiting writes followed by these)."""
        with self._lock:
            if self._in_flight > 1 and not self._overdue():
                if not self._waiting:
                    self._oldest = self._clock()
                self._waiting.extend(writes)
                return []
            return self._take() + list(writes)

    def take(self) -> list[L2Write]:
        """Every waiting write, for a round trip about to happen (an L2 read, a close)."""
        with self._lock:
            return self._take()

    def discard(self) -> int:
        """Drop the waiting writes (an operator flushed L2: they must not land after it)."""
        with self._lock:
            return len(self._take())

    def _overdue(self) -> bool:
        return bool(self._waiting) and self._clock() - self._oldest >= self._max_delay_s

    def _take(self) -> list[L2Write]:
        taken, self._waiting = self._waiting, []
        return taken
