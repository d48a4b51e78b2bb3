"""The cache generation ("cache version"): an operator-controlled integer in every key.

With Redis it lives under one key (the only key without a TTL) and a background
watcher re-reads it every `refresh_s`, so a bump by any replica reaches every
other within about that delay. Without Redis it is a local integer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.errors import CacheUnavailableError
from storage.redis_store import RedisStore

log = logging.getLogger(__name__)

GenerationListener = Callable[[int, int], None]


class _Generation:
    """The value and its listeners; subclasses decide where the value lives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0
        self._listeners: list[GenerationListener] = []

    @property
    def current(self) -> int:
        return self._value

    def subscribe(self, listener: GenerationListener) -> None:
        self._listeners.append(listener)

    def _set(self, value: int) -> None:
        with self._lock:
            old, self._value = self._value, value
        if old != value:
            log.info("cache generation %s -> %s", old, value)
            for listener in self._listeners:
                listener(old, value)


class LocalGeneration(_Generation):
    """Generation for a single process with no shared store."""

    def bump(self) -> int:
        with self._lock:
            new = self._value + 1
        self._set(new)
        return new

    def close(self) -> None:
        pass


class RedisGeneration(_Generation):
    """Generation shared through Redis, polled by one owned background thread."""

    def __init__(self, store: RedisStore, *, key: str, refresh_s: float) -> None:
        super().__init__()
        self._store = store
        self._key = key
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        try:
            self.refresh()
        except CacheUnavailableError:
            log.warning("Redis unreachable at start-up; generation %s until it answers", self._value)
        self._thread = threading.Thread(target=self._watch, name="generation-watcher", daemon=True)
        self._thread.start()

    def refresh(self) -> int:
        """Read the shared value now (raises CacheUnavailableError when Redis is down)."""
        self._set(self._store.get_int(self._key))
        return self._value

    def bump(self) -> int:
        """Increment the shared generation; raises CacheUnavailableError if Redis is down,
        because a bump other replicas cannot see would split the fleet.

        Returns only after two refresh periods: by then every replica that can reach
        Redis has re-read the generation, so once a bump is acknowledged no healthy
        replica starts a request under the old one.
        """
        new = self._store.incr(self._key)
        self._set(new)
        time.sleep(2 * self._refresh_s + 0.05)
        return new

    def _watch(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                self.refresh()
            except CacheUnavailableError:
                pass  # the breaker records it; the watcher doubles as Redis's health probe
            except Exception:  # keep watching whatever happens; never kill the thread
                log.exception("generation watcher failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
