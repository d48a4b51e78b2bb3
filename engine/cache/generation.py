"""The cache generation ("cache version"): an operator-controlled integer in every key.

With Redis it lives under one key (the only key without a TTL) and a background
watcher re-reads it every `refresh_s`, so a bump by any replica reaches every
other within about that delay. Without Redis it is a local integer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from common.background import BackgroundThread
from engine.errors import CacheUnavailableError
from storage.redis.store import RAISE_TO_FLOOR_SCRIPT, RedisStore

log = logging.getLogger(__name__)

GenerationListener = Callable[[int, int], None]


def restore_generation_key(store: RedisStore, key: str, seen: int) -> int:
    """The generation key is the one key without a TTL, yet any eviction policy
    (`allkeys-lru`, `allkeys-random`...) or a Redis restarted without its data can remove
    it, and INCR or a plain read would then start again from 0, serving entries a bump had
    retired. A replica that finds it missing (or lower than it has seen) writes back the
    highest generation it has seen; returns the value now in Redis."""
    value = int(store.call(lambda: store.client.eval(RAISE_TO_FLOOR_SCRIPT, 1, key, seen)))
    if value == seen and seen > 0:  # (absent at 0 is a new deployment's first start)
        log.warning("the generation key %s was missing or behind; restored to %s", key, seen)
    return value


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
        # Never backwards: a value read before a bump may arrive after it (a slow poll, a
        # Redis restarted without its data); the generation only grows.
        with self._lock:
            old = self._value
            if value <= old:
                return
            self._value = value
        log.info("cache generation %s -> %s", old, value)
        for listener in self._listeners:
            listener(old, value)

    def observe(self, value: int) -> None:
        """A value of the shared generation learnt elsewhere (the fleet channel): taken if newer."""
        self._set(value)


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
        # CacheUnavailableError: the breaker records it; the watcher doubles as Redis's health probe.
        self._watcher = BackgroundThread("generation-watcher", self.refresh, period_s=refresh_s, join_s=5,
                                         expected=(CacheUnavailableError,), logger=log,
                                         what="generation watcher")  # fmt: skip

    def start(self) -> None:
        if self._watcher.started:
            return
        try:
            self.refresh()
        except CacheUnavailableError:
            log.warning("Redis unreachable at start-up; generation %s until it answers", self._value)
        self._watcher.start()

    def refresh(self) -> int:
        """Read the shared value now (raises CacheUnavailableError when Redis is down).
        A key that vanished (evicted, Redis restarted empty) is written back, never read as 0."""
        raw = self._store.get(self._key)
        if raw is None or int(raw) < self._value:
            self._set(restore_generation_key(self._store, self._key, self._value))
        else:
            self._set(int(raw))
        return self._value

    def bump(self) -> int:
        """Increment the shared generation; raises CacheUnavailableError if Redis is down,
        because a bump other replicas cannot see would split the fleet.

        Returns at once: the other replicas learn it from the fleet channel, and the
        operator's acknowledgement waits for theirs (engine.fleet.member).
        """
        new = self._store.incr(self._key)
        if new <= self._value:  # Redis lost the key: lift it past what this replica saw
            new = self._store.incr(self._key, self._value - new + 1)
        self._set(new)
        return new

    def close(self) -> None:
        self._watcher.close()
