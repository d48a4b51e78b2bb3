"""The two tiers as the pipeline uses them: L1 (process memory) then L2 (Redis).

Reads promote an L2 value into L1; writes go to L1 at once and to L2 in the round trip of
another request when one is under way (engine.cache.write_batch), so a miss rarely pays a
Redis write of its own. A value that fails its checksum or signature is deleted and counted,
never served. Redis failures never leave this module: a request's `L2Budget` is spent by the
first one and the rest of the request stays in L1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.cache.codec import CachedRejection, CachedValue, ForgedValue, UndecodableValue, ValueCodec
from engine.cache.policy import CachePolicy, FlushResult
from engine.cache.write_batch import L2Write, OverdueWriteTimer, WriteBatch
from engine.errors import CacheSkippedError, CacheUnavailableError, InvalidInputError
from storage.memory import MemoryStore
from storage.redis.store import RedisStore

log = logging.getLogger(__name__)

# How long an L2 write may wait for another request's round trip (see engine.cache.write_batch).
L2_WRITE_DELAY_S = 0.05


class L2Budget:
    """Per request: after one L2 failure, skip L2 for the rest of the request, so a
    slow or dead Redis costs a request at most one socket timeout. A cluster primary
    skipped by its open breaker (CacheSkippedError) cost nothing and spends nothing."""

    __slots__ = ("available",)

    def __init__(self, available: bool) -> None:
        self.available = available


class CacheTiers:
    """L1 and L2 behind one read, one write, a flush and an eviction. Thread-safe.

    `count(name, n)` is told of L2 errors and of values deleted as forged or corrupt (the
    engine's counters). Owns the overdue-write timer: `close()` stops it and sends what waits.
    """

    def __init__(
        self,
        *,
        l1: MemoryStore,
        l2: RedisStore | None,
        codec: ValueCodec,
        policy: CachePolicy,
        count: Callable[[str, int], None],
    ) -> None:
        self.l1 = l1
        self.l2 = l2
        self.codec = codec
        self._policy = policy
        self._count = count
        self._writes = WriteBatch(max_delay_s=L2_WRITE_DELAY_S)
        # Sends waiting writes that no request carried within L2_WRITE_DELAY_S; close() stops it.
        self._write_timer = OverdueWriteTimer(self._writes, lambda due: self.send_writes(due, L2Budget(True)))
        if l2 is not None:
            self._write_timer.start()

    # ---- a request's passage ------------------------------------------------------

    def budget(self) -> L2Budget:
        """A new request's L2 budget: available when there is an L2."""
        return L2Budget(self.l2 is not None)

    def enter(self) -> None:
        """A request that may write L2 starts (its writes wait for the last one out)."""
        self._writes.enter()

    def leave(self, budget: L2Budget) -> None:
        """That request is done: the last one out sends the writes still waiting."""
        due = self._writes.leave()
        if due:
            self.send_writes(due, budget)

    @property
    def in_flight(self) -> int:
        """Requests inside now (background work waits for 0)."""
        return self._writes.in_flight

    # ---- reads and writes ---------------------------------------------------------

    def lookup(
        self, key: str, expected: tuple[type, ...], budget: L2Budget | None
    ) -> tuple[CachedValue | None, str]:
        """L1, then (when `budget` allows) L2 with promotion into L1: (value, "l1"|"l2"|"miss")."""
        value = self.l1.get(key)
        if value is not None:
            return value, "l1"
        if budget is None or not budget.available or self.l2 is None:
            return None, "miss"
        waiting = self._writes.take()  # they ride along with this read
        try:
            raw, refused = self.l2.get_after_writes([w.item() for w in waiting], key)
        except CacheUnavailableError as exc:
            budget.available = isinstance(exc, CacheSkippedError)
            self._count("l2_errors", 1)
            return None, "miss"
        if refused:
            self._count("l2_errors", refused)
        if raw is None:
            return None, "miss"
        try:
            value = self.codec.decode(raw, key=key)
            if not isinstance(value, expected):
                raise UndecodableValue(f"{type(value).__name__} under a {expected[0].__name__} key")
        except UndecodableValue as exc:
            forged = isinstance(exc, ForgedValue)
            log.warning("deleting %s L2 value at %s: %s", "forged" if forged else "undecodable", key, exc)
            self._count("forged_values" if forged else "corrupt_values", 1)
            try:
                self.l2.delete(key)
            except CacheUnavailableError:
                budget.available = False
                self._count("l2_errors", 1)
            return None, "miss"
        self.l1.set(key, value, size=len(raw) + len(key), ttl_s=self._l1_ttl_for(value))
        return value, "l2"

    def _l1_ttl_for(self, value: CachedValue) -> float:
        if isinstance(value, CachedRejection):
            return min(float(self._policy.negative_ttl_s), self._policy.l1_ttl_s)
        return self._policy.l1_ttl_s

    def store(
        self, key: str, value: CachedValue, l2_ttl_s: int, l1_ttl_s: float, budget: L2Budget | None
    ) -> bytes:
        """L1, and L2 unless `budget` is None (L1 only) or spent; returns the encoded value."""
        blob = self.codec.encode(value, key=key)
        self.l1.set(key, value, size=len(blob) + len(key), ttl_s=l1_ttl_s)
        if budget is not None:
            self.write_l2([L2Write(key, blob, l2_ttl_s)], budget)
        return blob

    def write_l2(self, writes: list[L2Write], budget: L2Budget) -> None:
        """Values already in L1, to L2: now in one round trip, or with another request's."""
        if self.l2 is None or not budget.available:
            return
        for write in writes:
            write.sent = True
        due = self._writes.add(writes)
        if due:
            self.send_writes(due, budget)

    def send_writes(self, writes: list[L2Write], budget: L2Budget) -> None:
        if self.l2 is None or not budget.available:
            return  # dropped: a cache write is never worth a second timeout
        try:
            self.l2.set_many([w.item() for w in writes])
        except CacheUnavailableError as exc:
            budget.available = isinstance(exc, CacheSkippedError)
            self._count("l2_errors", 1)

    # ---- operator actions -----------------------------------------------------------

    def flush(self, tier: str) -> FlushResult:
        """Remove cached entries: tier is "l1", "l2" or "all". Scoped to this app's prefix."""
        if tier not in ("l1", "l2", "all"):
            raise InvalidInputError("bad_tier", "tier must be 'l1', 'l2' or 'all'")
        l1_removed = self.l1.clear() if tier in ("l1", "all") else 0
        l2_removed: int | None = None
        l2_error = None
        if tier in ("l2", "all"):
            self._writes.discard()  # computed before the flush: they must not land after it
            if self.l2 is None:
                l2_error = "L2 is disabled"
            else:
                try:
                    l2_removed = self.l2.clear(keep_prefix=self._policy.meta_prefix)
                except CacheUnavailableError as exc:
                    l2_error = str(exc)
        log.info("flush %s: l1=%s l2=%s %s", tier, l1_removed, l2_removed, l2_error or "")
        return FlushResult(tier, l1_removed, l2_removed, l2_error)

    def drop_local(self, tier: str) -> int:
        """A flush made through another replica, applied here: this process's L1 (tiers
        l1, all) and its L2 writes still waiting (l2, all), which must not land after it."""
        if tier in ("l2", "all"):
            self._writes.discard()
        return self.l1.clear() if tier in ("l1", "all") else 0

    def delete(self, key: str) -> tuple[bool, bool | None, str | None]:
        """One entry out of L1 and L2: (removed from L1, from L2 (None: no L2 or it failed), error)."""
        removed_l1 = self.l1.delete(key)
        removed_l2: bool | None = None
        error = None
        if self.l2 is not None:
            try:
                removed_l2 = self.l2.delete(key)
            except CacheUnavailableError as exc:
                error = str(exc)
        return removed_l1, removed_l2, error

    def state(self, l2_notice: str | None) -> dict[str, Any]:
        """Both tiers for cache_state: L1's size and evictions, L2's breaker and failures."""
        mem = self.l1.stats()
        state: dict[str, Any] = {
            "l1": {"entries": mem.entries, "bytes": mem.bytes, "max_bytes": mem.max_bytes,
                   "evictions": mem.evictions},
        }  # fmt: skip
        if self.l2 is None:
            state["l2"] = {"state": "disabled", "breaker": None, "notice": l2_notice}
        else:
            l2 = self.l2.stats()
            state["l2"] = {"state": l2.state, "breaker": l2.breaker, "failures": l2.failures,
                           "notice": l2_notice}  # fmt: skip
        return state

    def close(self) -> None:
        """Stop the write timer and send the L2 writes still waiting (before the store closes)."""
        self._write_timer.close()
        waiting = self._writes.take()
        if waiting:
            self.send_writes(waiting, self.budget())
