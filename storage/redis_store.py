"""L2: a Redis store of bytes with TTLs, guarded by a circuit breaker.

Knows nothing of models or Gradio: keys and values are opaque strings and bytes.
Every Redis failure becomes `CacheUnavailableError` so callers can fall back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from storage.breaker import BreakerState, CircuitBreaker
from storage.errors import CacheUnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")

SCAN_BATCH = 500
# One quick retry on a dropped connection (a restarted server); never on a
# timeout, so a slow Redis costs at most one socket timeout per call.
RETRY_BACKOFF_BASE_S = 0.005
RETRY_BACKOFF_CAP_S = 0.05
RETRIES = 1


@dataclass(frozen=True)
class RedisStats:
    state: str  # "up" | "down"
    breaker: str
    failures: int


def escape_glob(text: str) -> str:
    """Escape Redis glob metacharacters so a prefix matches only itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def make_client(url: str, *, socket_timeout_s: float, max_connections: int = 64) -> redis.Redis:
    retry = Retry(
        ExponentialWithJitterBackoff(cap=RETRY_BACKOFF_CAP_S, base=RETRY_BACKOFF_BASE_S),
        RETRIES,
        supported_errors=(redis.ConnectionError,),
    )
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=socket_timeout_s,  # wait for a free pooled connection at most this long
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=retry,
    )
    return redis.Redis(connection_pool=pool)


def _require_ttls(items: Sequence[tuple[str, bytes, int]]) -> None:
    if any(ttl_s <= 0 for _, _, ttl_s in items):
        raise ValueError("every L2 write needs a positive TTL")


def _queue_sets(pipe: Any, items: Sequence[tuple[str, bytes, int]]) -> None:
    for key, value, ttl_s in items:
        pipe.set(key, value, ex=ttl_s)


class RedisStore:
    """get/set/delete/clear over one Redis, scoped to `prefix`."""

    def __init__(self, client: redis.Redis, *, prefix: str, breaker: CircuitBreaker) -> None:
        self._client = client
        self._prefix = prefix
        self._breaker = breaker
        self._closed = False

    @property
    def client(self) -> redis.Redis:
        return self._client

    def _call(self, operation: Callable[[], T]) -> T:
        if self._closed:
            raise CacheUnavailableError("the Redis store is closed")
        if not self._breaker.allow():
            raise CacheUnavailableError("Redis is skipped while the circuit breaker is open")
        try:
            result = operation()
        except redis.RedisError as exc:
            self._breaker.record_failure()
            raise CacheUnavailableError(f"Redis call failed: {exc.__class__.__name__}") from exc
        except BaseException:
            # Not Redis's fault (e.g. interrupted): release a half-open probe slot.
            self._breaker.record_success()
            raise
        self._breaker.record_success()
        return result

    def call(self, operation: Callable[[], T]) -> T:
        """One command of another storage module that keeps keys in this Redis (the fleet's
        leases), through the same breaker and error mapping as the store's own calls."""
        return self._call(operation)

    def get(self, key: str) -> bytes | None:
        return self._call(lambda: self._client.get(key))

    def set(self, key: str, value: bytes, *, ttl_s: int) -> None:
        self.set_many([(key, value, ttl_s)])

    def set_many(self, items: Sequence[tuple[str, bytes, int]]) -> None:
        """Several (key, value, ttl_s) writes in one round trip, in order (not atomic)."""
        _require_ttls(items)
        if len(items) == 1:
            key, value, ttl_s = items[0]
            self._call(lambda: self._client.set(key, value, ex=ttl_s))
            return

        def pipelined() -> None:
            with self._client.pipeline(transaction=False) as pipe:
                _queue_sets(pipe, items)
                pipe.execute()

        self._call(pipelined)

    def get_after_writes(
        self, writes: Sequence[tuple[str, bytes, int]], key: str
    ) -> tuple[bytes | None, int]:
        """Send `writes` (key, value, ttl_s), in order, then GET `key`, in one round trip.

        Returns (the value or None, how many writes Redis refused). A refused write (say,
        out of memory under noeviction) is dropped and does not fail the read.
        """
        if not writes:
            return self.get(key), 0
        _require_ttls(writes)

        def pipelined() -> list[Any]:
            with self._client.pipeline(transaction=False) as pipe:
                _queue_sets(pipe, writes)
                pipe.get(key)
                return pipe.execute(raise_on_error=False)

        replies = self._call(pipelined)
        refused = sum(isinstance(reply, Exception) for reply in replies[:-1])
        if refused:
            self._breaker.record_failure()  # as a refused write on its own would
        value = replies[-1]
        if isinstance(value, Exception):
            self._breaker.record_failure()
            raise CacheUnavailableError(f"Redis call failed: {value.__class__.__name__}")
        return value, refused

    def delete(self, key: str) -> bool:
        return bool(self._call(lambda: self._client.unlink(key)))

    def get_with_ttl(self, key: str) -> tuple[bytes | None, float | None]:
        """The value and the seconds before it expires (None: absent, or no TTL), one round trip."""

        def pipelined() -> list[Any]:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.get(key)
                pipe.pttl(key)
                return pipe.execute()

        value, pttl = self._call(pipelined)
        return value, (int(pttl) / 1000.0 if value is not None and int(pttl) >= 0 else None)

    def ping(self) -> bool:
        return bool(self._call(self._client.ping))

    def get_int(self, key: str) -> int:
        raw = self._call(lambda: self._client.get(key))
        return int(raw) if raw is not None else 0

    def incr(self, key: str, amount: int = 1) -> int:
        return int(self._call(lambda: self._client.incr(key, amount)))

    def _scan(self, match: str) -> Iterator[list[bytes]]:
        cursor: Any = 0
        while True:
            cursor, keys = self._call(
                lambda c=cursor: self._client.scan(cursor=c, match=match, count=SCAN_BATCH)
            )
            if keys:
                yield keys
            if int(cursor) == 0:
                return

    def clear(self, *, keep_prefix: str | None = None) -> int:
        """UNLINK every key under this store's prefix (SCAN in batches, never KEYS/FLUSH*).

        Keys starting with `keep_prefix` (e.g. the generation counter) survive.
        """
        removed = 0
        keep = keep_prefix.encode() if keep_prefix else None
        for batch in self._scan(escape_glob(self._prefix) + ":*"):
            doomed = [k for k in batch if keep is None or not k.startswith(keep)]
            if doomed:
                removed += int(self._call(lambda d=doomed: self._client.unlink(*d)))
        return removed

    def count_keys(self) -> int:
        return sum(len(batch) for batch in self._scan(escape_glob(self._prefix) + ":*"))

    def memory_used_bytes(self) -> int:
        info = self._call(lambda: self._client.info("memory"))
        return int(info.get("used_memory", 0))

    def stats(self) -> RedisStats:
        state = self._breaker.state
        return RedisStats(
            state="up" if state is BreakerState.CLOSED else "down",
            breaker=state.value,
            failures=self._breaker.total_failures,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.close()
        self._client.connection_pool.disconnect()
