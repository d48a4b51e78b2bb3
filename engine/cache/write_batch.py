"""L2 writes that share the Redis round trips other requests make anyway.

A Redis round trip costs CPU on both sides (two wake-ups of two processes), and on a
machine whose cores are busy running the model that CPU comes out of throughput: it
is most of what a cache with a Redis tier costs a new input. So while other requests
of this process are in flight, a request's L2 writes do not cost a round trip of their
own: they wait here and go out

- in front of the next L2 read of any request (one pipeline: the writes, then the GET);
- or with the last request to leave (nothing waits once the process is idle);
- or with whichever request finds them older than `max_delay_s`;
- or, when no request does any of that in time (the others in flight are all in a long
  forward pass), from `OverdueWriteTimer`'s thread once they are `max_delay_s` old.

With one request at a time nothing waits: a result is in Redis when its request returns,
as before. Writes keep their order (a result before the raw alias that names it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from common.background import STOP, BackgroundThread

log = logging.getLogger(__name__)

TIMER_JOIN_S = 5.0


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
        self._due = threading.Condition(self._lock)  # wakes the timer when writes start waiting
        self._timer_idle = False  # the timer sleeps until writes wait (not woken otherwise)
        self._timer_stopped = False
        self._in_flight = 0
        self._waiting: list[L2Write] = []
        self._oldest = 0.0

    @property
    def in_flight(self) -> int:
        """Requests inside the engine now (a plain read: a hint, e.g. "is the model idle")."""
        return self._in_flight

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
                    if self._timer_idle:
                        self._due.notify()
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

    def wait_overdue(self) -> list[L2Write] | None:
        """For the timer's thread: blocks until the waiting writes are `max_delay_s` old and
        returns them (unless a request took them first: then it waits for the next ones).
        Returns None once `stop_timer()` is called."""
        with self._lock:
            while not self._timer_stopped:
                if not self._waiting:
                    self._timer_idle = True
                    self._due.wait()
                    self._timer_idle = False
                    continue
                # Writes that start waiting later fall due later: this sleep never overshoots.
                remaining = self._oldest + self._max_delay_s - self._clock()
                if remaining <= 0:
                    return self._take()
                self._due.wait(remaining)
            return None

    def stop_timer(self) -> None:
        with self._lock:
            self._timer_stopped = True
            self._due.notify_all()

    def _overdue(self) -> bool:
        return bool(self._waiting) and self._clock() - self._oldest >= self._max_delay_s

    def _take(self) -> list[L2Write]:
        taken, self._waiting = self._waiting, []
        return taken


class OverdueWriteTimer:
    """One owned thread that sends waiting writes once they are `max_delay_s` old, for when
    no request comes by to carry them. `close()` stops it (idempotent); the writes still
    waiting then are the closer's to send."""

    def __init__(self, batch: WriteBatch, send: Callable[[list[L2Write]], None]) -> None:
        self._batch = batch
        self._send = send
        # join_s: a send in progress ends within a socket timeout
        self._worker = BackgroundThread("l2-write-timer", self._send_overdue, period_s=0,
                                        interrupt=batch.stop_timer, join_s=TIMER_JOIN_S, logger=log,
                                        what="sending overdue L2 writes")  # fmt: skip

    def start(self) -> None:
        self._worker.start()

    def close(self) -> None:
        self._worker.close()

    @property
    def running(self) -> bool:
        return self._worker.running

    def _send_overdue(self) -> object:
        due = self._batch.wait_overdue()
        if due is None:
            return STOP
        self._send(due)  # a failure is logged and the timer goes on
        return None
