"""Token buckets, one per client: in Redis for the fleet, in memory as the fallback.

`take(key, rate, burst)` spends one token when the bucket holds one and answers `0.0`, or
spends nothing and answers how many seconds until a token will be there. A bucket starts
full (`burst` tokens) and refills at `rate` tokens a second, up to `burst`.

In Redis one script reads, refills, spends and writes the bucket atomically, on Redis's own
clock (`TIME`), so every replica spends from one bucket per client and their clocks do not
matter. A bucket's key expires once it would be full again: an idle client costs nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cachetools import LRUCache

from storage.redis.store import RedisStore

# Returns {1, "0"} when a token was spent, else {0, "<seconds until one>"} (a string: Lua
# numbers come back from Redis as integers).
_TAKE_SCRIPT = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1])
local at = tonumber(state[2])
if tokens == nil or at == nil then
  tokens = burst
  at = now
end
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local spent = 0
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  spent = 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {spent, tostring(wait)}
"""

# Clients whose buckets one process keeps while Redis is away (the least recent go first).
LOCAL_BUCKETS = 100_000


class RedisBuckets:
    """Buckets under `prefix` in the store's Redis, through its breakers (raises
    CacheUnavailableError when Redis cannot answer)."""

    def __init__(self, store: RedisStore, *, prefix: str) -> None:
        self._store = store
        self._prefix = prefix

    def take(self, key: str, rate: float, burst: int) -> float:
        name = self._prefix + key
        reply = self._store.call(
            lambda: self._store.client.eval(_TAKE_SCRIPT, 1, name, repr(rate), str(burst)), key=name
        )
        spent, wait = reply
        return 0.0 if int(spent) else max(0.0, float(wait))


class LocalBuckets:
    """The same buckets in this process's memory (bounded; thread-safe; `clock` injectable)."""

    def __init__(self, *, capacity: int = LOCAL_BUCKETS, clock: Callable[[], float] = time.monotonic) -> None:
        self._buckets: LRUCache[str, tuple[float, float]] = LRUCache(maxsize=capacity)
        self._lock = threading.Lock()
        self._clock = clock

    def take(self, key: str, rate: float, burst: int) -> float:
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (float(burst), now))
            tokens = min(float(burst), tokens + max(0.0, now - at) * rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / rate
