"""L1 served only while this replica knows the fleet's generation.

A replica cut off from Redis cannot learn of a bump; its memory would go on answering
under the old generation. So L1 reads need a confirmation of the shared generation (a read
of it, or a bump message from the fleet channel) younger than `bound_s`; past that, L1 reads
miss (writes go on: a later confirmation of the same generation makes them servable again,
and a new generation clears them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from storage.memory import MemoryStore


class GenerationConfirmations:
    """When this replica last confirmed the shared generation (monotonic clock)."""

    def __init__(self, *, bound_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound_s = bound_s
        self._clock = clock
        self._lock = threading.Lock()
        self._confirmed_at: float | None = None
        self._bypassed = 0

    def confirm(self) -> None:
        now = self._clock()
        with self._lock:
            self._confirmed_at = now

    def fresh(self) -> bool:
        confirmed = self._confirmed_at
        return confirmed is not None and self._clock() - confirmed <= self.bound_s

    def age_s(self) -> float | None:
        confirmed = self._confirmed_at
        return None if confirmed is None else self._clock() - confirmed

    def note_bypass(self) -> None:
        with self._lock:
            self._bypassed += 1

    @property
    def bypassed(self) -> int:
        """L1 reads that missed because the generation was not confirmed."""
        return self._bypassed


class GatedMemoryStore(MemoryStore):
    """A MemoryStore whose reads miss while `confirmations` are stale."""

    def __init__(self, *, confirmations: GenerationConfirmations, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.confirmations = confirmations

    def get(self, key: str) -> Any | None:
        if not self.confirmations.fresh():
            self.confirmations.note_bypass()
            return None
        return super().get(key)
