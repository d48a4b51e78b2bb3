"""A circuit breaker: after repeated failures skip the backend for a while, then probe."""

from __future__ import annotations

import enum
import random
import threading
import time
from collections.abc import Callable


class BreakerState(enum.StrEnum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are skipped until the retry time
    HALF_OPEN = "half_open"  # one probe call is in flight


class CircuitBreaker:
    """Opens after `failure_threshold` consecutive failures.

    While open, calls are refused without touching the backend. After the reset
    delay one caller is let through as a probe: success closes the breaker,
    failure re-opens it with a longer delay (exponential, full jitter, capped).
    """

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        reset_s: float = 2.0,
        max_reset_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._threshold = failure_threshold
        self._reset_s = reset_s
        self._max_reset_s = max(max_reset_s, reset_s)
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive_failures = 0
        self._open_count = 0
        self._retry_at = 0.0
        self.total_failures = 0
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._state is BreakerState.OPEN and self._clock() >= self._retry_at:
                return BreakerState.HALF_OPEN
            return self._state

    def retry_in_s(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when closed or due)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return 0.0
            return max(0.0, self._retry_at - self._clock())

    def allow(self) -> bool:
        """True when a call may go to the backend now."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() >= self._retry_at:
                self._state = BreakerState.HALF_OPEN
                return True  # this caller is the probe
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._consecutive_failures = 0
            self._open_count = 0

    def record_failure(self) -> None:
        with self._lock:
            self.total_failures += 1
            self._consecutive_failures += 1
            if self._state is BreakerState.HALF_OPEN or self._consecutive_failures >= self._threshold:
                self._open()

    def trip(self) -> None:
        """Open now, whatever the count (a caller that knows the backend is unusable)."""
        with self._lock:
            self.total_failures += 1
            self._consecutive_failures += 1
            self._open()

    def _open(self) -> None:
        delay = min(self._max_reset_s, self._reset_s * (2**self._open_count))
        # Full jitter in [delay/2, delay]: replicas that lost Redis together do not
        # all probe it at the same instant.
        delay = delay / 2 + self._rng.uniform(0, delay / 2)
        if self._state is BreakerState.CLOSED:  # an outage starts; re-opens after probes don't count
            self.times_opened += 1
        self._state = BreakerState.OPEN
        self._open_count += 1
        self._retry_at = self._clock() + delay
