"""Single-flight: concurrent callers for one key share one computation."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

from engine.errors import ModelError

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """`run(key, fn)` calls `fn` once per key at a time; callers that arrive while it
    runs wait for its result (or its exception) instead of calling `fn` again."""

    def __init__(self, *, wait_timeout_s: float = 120.0) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, Future[T]] = {}
        self._wait_timeout_s = wait_timeout_s

    def run(self, key: str, fn: Callable[[], T]) -> tuple[T, bool]:
        """Returns (result, shared): shared is True for callers that joined a flight."""
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = Future()
                self._flights[key] = flight
        if not leader:
            try:
                return flight.result(timeout=self._wait_timeout_s), True
            except FutureTimeout:
                raise ModelError("timed out waiting for an identical request in flight") from None
        try:
            result = fn()
        except BaseException as exc:
            with self._lock:
                del self._flights[key]
            flight.set_exception(exc)  # waiters get the same error instead of hanging
            raise
        with self._lock:
            del self._flights[key]
        flight.set_result(result)
        return result, False
