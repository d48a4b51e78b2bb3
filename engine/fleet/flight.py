"""Single flight across replicas: a short Redis lease per key on a miss.

Inside a replica, engine.cache.singleflight already lets one request per key reach the model.
Across replicas, that request first takes a lease in Redis (`SET NX PX` with an owner token):

- it gets the lease: it computes, and its result goes to L2 as usual (the lease is left to
  expire: dropping it before the result's L2 write lands would let another replica compute);
- another replica holds it: it polls L2 (backoff from 5 ms to 50 ms) until the result is
  there, and answers with it; if the lease goes (the holder died, or failed) it tries to take
  it and compute; past `max_wait_s` it computes without one;
- Redis is down, or the breaker skips it: no lease, the replica computes by itself.

The lease lasts `LEASE_P99_FACTOR` x this replica's recent p99 time from lease to result
(plus a margin), within [LEASE_MIN_S, max_wait_s]: near the model's p99, so a dead holder
costs the others about that, and a live one is seldom outlived by its lease.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from engine.errors import CacheUnavailableError
from storage.redis.fleet import FleetRedis

log = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_P99_FACTOR = 3.0
LEASE_MARGIN_S = 0.25
LEASE_MIN_S = 0.5
POLL_FIRST_S = 0.005
POLL_MAX_S = 0.05
SAMPLES = 256  # recent computations per task behind the p99


class Turn(Generic[T]):
    """One miss's place in the fleet: `found` when another replica's result arrived,
    else this replica computes (holding the lease or not) and calls `succeeded()`."""

    __slots__ = ("_flight", "_started", "_task", "found", "holder")

    def __init__(self, flight: FleetFlight, task: str, found: T | None, holder: bool) -> None:
        self.found = found
        self.holder = holder
        self._flight = flight
        self._task = task
        self._started = time.monotonic()

    def succeeded(self) -> None:
        if self.holder:
            self._flight.record(self._task, time.monotonic() - self._started)


class FleetFlight:
    def __init__(
        self,
        redis: FleetRedis,
        *,
        owner: str,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._redis = redis
        self._owner = owner
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._samples: dict[str, deque[float]] = {}
        self._serial = 0
        # Other live replicas, as the registry last said; the lease costs a round trip, so
        # a replica alone skips it. Unknown (None) counts as not alone.
        self.peers: int | None = None
        self.waits = 0  # misses that waited for another replica
        self.served_by_others = 0  # ...and got its result
        self.takeovers = 0  # ...and took the lease after it went

    def set_peers(self, peers: int) -> None:
        self.peers = peers

    def lease_s(self, task: str) -> float:
        with self._lock:
            samples = sorted(self._samples.get(task, ()))
        if not samples:
            return self.max_wait_s
        p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
        return min(self.max_wait_s, max(LEASE_MIN_S, LEASE_P99_FACTOR * p99 + LEASE_MARGIN_S))

    def record(self, task: str, seconds: float) -> None:
        with self._lock:
            self._samples.setdefault(task, deque(maxlen=SAMPLES)).append(seconds)

    def _token(self) -> str:
        with self._lock:
            self._serial += 1
            return f"{self._owner}:{os.getpid()}:{self._serial}"

    def take_turn(
        self, task: str, key: str, *, look: Callable[[], T | None], usable: Callable[[], bool]
    ) -> Turn[T]:
        """Called on a miss (L1 and L2 already looked at). `look` reads the result from the
        cache (None: not there); `usable()` is False once Redis failed during this request."""
        if self.peers == 0:
            return Turn(self, task, None, holder=False)
        token = self._token()
        try:
            if self._redis.take_lease(key, token, ttl_ms=int(self.lease_s(task) * 1000)):
                return Turn(self, task, None, holder=True)
        except CacheUnavailableError:
            return Turn(self, task, None, holder=False)  # Redis is down: compute here
        return self._wait(task, key, token, look, usable)

    def _wait(
        self, task: str, key: str, token: str, look: Callable[[], T | None], usable: Callable[[], bool]
    ) -> Turn[T]:
        with self._lock:
            self.waits += 1
        deadline = self._clock() + self.max_wait_s
        delay = POLL_FIRST_S
        while True:
            self._sleep(delay)
            delay = min(delay * 1.5, POLL_MAX_S)
            found = look()
            if found is not None:
                with self._lock:
                    self.served_by_others += 1
                return Turn(self, task, found, holder=False)
            if not usable() or self._clock() >= deadline:
                return Turn(self, task, None, holder=False)
            try:
                if self._redis.lease_held(key):
                    continue
                # The holder is gone (died, or failed): its turn passes to whoever takes it.
                if self._redis.take_lease(key, token, ttl_ms=int(self.lease_s(task) * 1000)):
                    found = look()  # it may have written the result just before its lease went
                    with self._lock:
                        self.takeovers += found is None
                    return Turn(self, task, found, holder=found is None)
            except CacheUnavailableError:
                return Turn(self, task, None, holder=False)
