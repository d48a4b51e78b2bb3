"""L2: a Redis store of bytes with TTLs, guarded by circuit breakers.

Knows nothing of models or Gradio: keys and values are opaque strings and bytes.
Every Redis failure becomes `CacheUnavailableError` so callers can fall back.
One node, a Sentinel-managed primary or a Redis Cluster (`storage/redis/cluster.py`):
each command goes to the primary that owns its key, and each primary has its own
breaker, so a dead cluster node costs only the keys in its slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisClusterException

from storage.breaker import BreakerState, CircuitBreaker
from storage.errors import CacheSkippedError, CacheUnavailableError
from storage.redis.clients import node_client
from storage.redis.cluster import TOPOLOGY_SHARD, ClusterNodes, OneNode

log = logging.getLogger(__name__)

T = TypeVar("T")

SCAN_BATCH = 500
# Atomically: the counter at KEYS[1] becomes at least ARGV[1]; returns its value. Idempotent,
# so replicas that notice a lost counter at once agree (an INCRBY each would overshoot, and a
# generation past the one operators bumped to retires every cached entry).
RAISE_TO_FLOOR_SCRIPT = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
local floor = tonumber(ARGV[1])
if current < floor then
  redis.call('SET', KEYS[1], ARGV[1])
  return floor
end
return current
"""
_BREAKER_ORDER = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


@dataclass(frozen=True)
class RedisStats:
    state: str  # "up" | "down" | "partial" (a cluster: some primaries skipped, others used)
    breaker: str  # the worst primary's breaker
    failures: int
    # (primary, its breaker state) for each primary met so far: one entry unless a cluster.
    nodes: tuple[tuple[str, str], ...] = ()


def escape_glob(text: str) -> str:
    """Escape Redis glob metacharacters so a prefix matches only itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def make_client(url: str, *, socket_timeout_s: float, max_connections: int = 64) -> redis.Redis:
    """A client of one node (redis://, rediss://, unix://). For any REDIS_URL form, clusters
    and Sentinel included, use `storage.redis.clients.make_nodes`."""
    return node_client(url, socket_timeout_s=socket_timeout_s, max_connections=max_connections)


def _require_ttls(items: Sequence[tuple[str, bytes, int]]) -> None:
    if any(ttl_s <= 0 for _, _, ttl_s in items):
        raise ValueError("every L2 write needs a positive TTL")


def _queue_sets(pipe: Any, items: Sequence[tuple[str, bytes, int]]) -> None:
    for key, value, ttl_s in items:
        pipe.set(key, value, ex=ttl_s)


class RedisStore:
    """get/set/delete/clear over one Redis, a Sentinel-managed primary or a cluster, scoped
    to `prefix`.

    `nodes`: a `redis.Redis` (one node), or what `storage.redis.clients.make_nodes` builds.
    `breaker` guards the first primary; on a cluster `breaker_factory` makes one for each
    further primary (without it they share `breaker`).
    """

    def __init__(
        self,
        nodes: redis.Redis | OneNode | ClusterNodes,
        *,
        prefix: str,
        breaker: CircuitBreaker,
        breaker_factory: Callable[[], CircuitBreaker] | None = None,
    ) -> None:
        if isinstance(nodes, redis.Redis):
            nodes = OneNode(nodes, name="redis")
        self._nodes: OneNode | ClusterNodes = nodes
        self._prefix = prefix
        self._breaker = breaker
        self._breaker_factory = breaker_factory
        self._breakers: dict[str, CircuitBreaker] = {}
        self._closed = False

    @property
    def client(self) -> Any:
        """The redis-py client for plain commands: `redis.Redis` (one node, or the primary a
        Sentinel names, followed across failovers), or on a cluster a `RedisCluster` (built
        at its first use). Route calls through `call(..., key=...)` to share the breakers."""
        return self._nodes.client

    @property
    def is_cluster(self) -> bool:
        return self._nodes.is_cluster

    def _breaker_for(self, shard: str) -> CircuitBreaker:
        breaker = self._breakers.get(shard)
        if breaker is None:
            fresh = self._breaker if not self._breakers or self._breaker_factory is None else None
            breaker = self._breakers.setdefault(shard, fresh or self._breaker_factory())  # type: ignore[misc]
        return breaker

    def _call(self, operation: Callable[[], T], shard: str | None = None) -> T:
        """`operation` under the breaker of primary `shard` (None: the first primary's)."""
        if self._closed:
            raise CacheUnavailableError("the Redis store is closed")
        breaker = self._breaker if shard is None else self._breaker_for(shard)
        if not breaker.allow():
            # On a cluster, other primaries may still answer this request (engine's budget).
            skipped = CacheSkippedError if self._nodes.is_cluster else CacheUnavailableError
            raise skipped("Redis is skipped while the circuit breaker is open")
        try:
            result = operation()
        except (redis.RedisError, RedisClusterException) as exc:
            breaker.record_failure()
            self._nodes.note_error(exc, shard)
            raise CacheUnavailableError(f"Redis call failed: {exc.__class__.__name__}") from exc
        except BaseException:
            # Not Redis's fault (e.g. interrupted): release a half-open probe slot.
            breaker.record_success()
            raise
        breaker.record_success()
        return result

    def call(self, operation: Callable[[], T], *, key: str | None = None) -> T:
        """One command of another storage module that keeps keys in this Redis (the fleet's
        leases), through the same breakers and error mapping as the store's own calls: the
        breaker of the primary that owns `key` (give it on a cluster), else the first's."""
        return self._call(operation, None if key is None else self._shard(key))

    def _shard(self, key: str) -> str:
        """The primary that owns `key` (reading a cluster's slot table when needed)."""
        if not self._nodes.is_cluster:
            return self._nodes.shard_of(key)
        return self._call(lambda: self._nodes.shard_of(key), TOPOLOGY_SHARD)

    def _on(self, key: str, command: Callable[[redis.Redis], T]) -> T:
        shard = self._shard(key)
        return self._call(lambda: command(self._nodes.node(shard)), shard)

    def _groups(self, keys: Sequence[str]) -> dict[str, list[int]]:
        """Indexes of `keys` by the primary that owns each, in order."""
        groups: dict[str, list[int]] = {}
        for index, key in enumerate(keys):
            groups.setdefault(self._shard(key), []).append(index)
        return groups

    def get(self, key: str) -> bytes | None:
        return self._on(key, lambda node: node.get(key))

    def set(self, key: str, value: bytes, *, ttl_s: int) -> None:
        self.set_many([(key, value, ttl_s)])

    def set_many(self, items: Sequence[tuple[str, bytes, int]]) -> None:
        """Several (key, value, ttl_s) writes, in order (not atomic): one pipeline per primary
        they go to (one round trip on one node). Every reachable primary gets its writes;
        CacheUnavailableError afterwards if any could not."""
        _require_ttls(items)
        if len(items) == 1:
            key, value, ttl_s = items[0]
            self._on(key, lambda node: node.set(key, value, ex=ttl_s))
            return
        failure: CacheUnavailableError | None = None
        for shard, indexes in self._groups([key for key, _, _ in items]).items():
            try:
                self._pipeline(shard, [items[i] for i in indexes], read=None, raise_on_error=True)
            except CacheUnavailableError as exc:  # a real failure outranks a skip
                failure = exc if failure is None or isinstance(failure, CacheSkippedError) else failure
        if failure is not None:
            raise failure

    def get_after_writes(
        self, writes: Sequence[tuple[str, bytes, int]], key: str
    ) -> tuple[bytes | None, int]:
        """Send `writes` (key, value, ttl_s), in order, then GET `key`: one round trip on
        one node; on a cluster one pipeline per primary, the read riding with its primary's.

        Returns (the value or None, how many writes Redis refused). A refused write (say,
        out of memory under noeviction, or its primary down) is dropped and does not fail
        the read.
        """
        if not writes:
            return self.get(key), 0
        _require_ttls(writes)
        read_shard = self._shard(key)
        own: list[tuple[str, bytes, int]] = []
        refused = 0
        for shard, indexes in self._groups([k for k, _, _ in writes]).items():
            group = [writes[i] for i in indexes]
            if shard == read_shard:
                own = group
                continue
            try:
                refused += self._refusals(shard, self._pipeline(shard, group, read=None))
            except CacheUnavailableError:
                refused += len(group)
        replies = self._pipeline(read_shard, own, read=key)
        refused += self._refusals(read_shard, replies[:-1])
        value = replies[-1]
        if isinstance(value, Exception):
            self._breaker_for(read_shard).record_failure()
            self._nodes.note_error(value, read_shard)
            raise CacheUnavailableError(f"Redis call failed: {value.__class__.__name__}")
        return value, refused

    def _pipeline(
        self, shard: str, writes: Sequence[tuple[str, bytes, int]], *, read: str | None,
        raise_on_error: bool = False,
    ) -> list[Any]:  # fmt: skip
        def pipelined() -> list[Any]:
            with self._nodes.node(shard).pipeline(transaction=False) as pipe:
                _queue_sets(pipe, writes)
                if read is not None:
                    pipe.get(read)
                return pipe.execute(raise_on_error=raise_on_error)

        return self._call(pipelined, shard)

    def _refusals(self, shard: str, replies: Sequence[Any]) -> int:
        refused = [reply for reply in replies if isinstance(reply, Exception)]
        if refused:
            self._breaker_for(shard).record_failure()  # as a refused write on its own would
            self._nodes.note_error(refused[0], shard)
        return len(refused)

    def delete(self, key: str) -> bool:
        return bool(self._on(key, lambda node: node.unlink(key)))

    def get_with_ttl(self, key: str) -> tuple[bytes | None, float | None]:
        """The value and the seconds before it expires (None: absent, or no TTL), one round trip."""

        def pipelined(node: redis.Redis) -> list[Any]:
            with node.pipeline(transaction=False) as pipe:
                pipe.get(key)
                pipe.pttl(key)
                return pipe.execute()

        value, pttl = self._on(key, pipelined)
        return value, (int(pttl) / 1000.0 if value is not None and int(pttl) >= 0 else None)

    def ping(self) -> bool:
        """True when every primary answers; CacheUnavailableError names those that do not."""
        down = []
        for shard in self.primaries():
            try:
                self._call(lambda s=shard: self._nodes.node(s).ping(), shard)
            except CacheUnavailableError:
                down.append(shard)
        if down:
            raise CacheUnavailableError(f"Redis did not answer: {', '.join(down)}")
        return True

    def get_int(self, key: str) -> int:
        raw = self._on(key, lambda node: node.get(key))
        return int(raw) if raw is not None else 0

    def incr(self, key: str, amount: int = 1) -> int:
        return int(self._on(key, lambda node: node.incr(key, amount)))

    def primaries(self) -> list[str]:
        """The primaries' names ("host:port"; one entry unless a cluster)."""
        if not self._nodes.is_cluster:
            return self._nodes.primaries()
        return self._call(self._nodes.primaries, TOPOLOGY_SHARD)

    def on_primary(self, shard: str, command: Callable[[redis.Redis], T]) -> T:
        """`command(client)` on one primary (a name from `primaries()`), under its breaker:
        per-node reads such as INFO (storage.redis.health)."""
        return self._call(lambda: command(self._nodes.node(shard)), shard)

    def _scan(self, shard: str, match: str) -> Iterator[list[bytes]]:
        cursor: Any = 0
        while True:
            cursor, keys = self._call(
                lambda c=cursor: self._nodes.node(shard).scan(cursor=c, match=match, count=SCAN_BATCH), shard
            )
            if keys:
                yield keys
            if int(cursor) == 0:
                return

    def _each_primary(self, work: Callable[[str], int]) -> dict[str, int | None]:
        """`work(primary)` on every primary; None for one that could not be reached."""
        done: dict[str, int | None] = {}
        for shard in self.primaries():
            try:
                done[shard] = work(shard)
            except CacheUnavailableError:
                done[shard] = None
        return done

    def clear(self, *, keep_prefix: str | None = None) -> int:
        """UNLINK every key under this store's prefix on every primary (SCAN in batches,
        never KEYS/FLUSH*). Keys starting with `keep_prefix` (e.g. the generation counter)
        survive. CacheUnavailableError, after clearing the others, if a primary could not
        be reached."""
        keep = keep_prefix.encode() if keep_prefix else None

        def clear_one(shard: str) -> int:
            removed = 0
            for batch in self._scan(shard, escape_glob(self._prefix) + ":*"):
                doomed = [k for k in batch if keep is None or not k.startswith(keep)]
                # On a cluster one UNLINK may name keys of one slot only: one per slot,
                # all in one pipeline.
                groups = self._nodes.unlink_groups(doomed) if doomed else []

                def unlink(groups: list[Sequence[bytes]] = groups) -> int:
                    with self._nodes.node(shard).pipeline(transaction=False) as pipe:
                        for group in groups:
                            pipe.unlink(*group)
                        return sum(int(n) for n in pipe.execute())

                if groups:
                    removed += self._call(unlink, shard)
            return removed

        done = self._each_primary(clear_one)
        removed = sum(n or 0 for n in done.values())
        missed = [shard for shard, n in done.items() if n is None]
        if missed:
            raise CacheUnavailableError(
                f"flushed {removed} keys, but Redis did not answer: {', '.join(missed)}"
            )
        return removed

    def scan_prefix(self, shard: str, *, count: int = SCAN_BATCH) -> Iterator[list[bytes]]:
        """Batches of the keys under this store's prefix on one primary (SCAN, never KEYS):
        for background work that goes at its own pace (engine.lifecycle.cleanup)."""
        cursor: Any = 0
        match = escape_glob(self._prefix) + ":*"
        while True:
            cursor, keys = self._call(
                lambda c=cursor: self._nodes.node(shard).scan(cursor=c, match=match, count=count), shard
            )
            if keys:
                yield keys
            if int(cursor) == 0:
                return

    def sample_keys(self, shard: str, *, max_scanned: int) -> tuple[list[bytes], int, bool, int]:
        """A sample of one primary's keys: (keys under this prefix, keys scanned, whether the
        scan covered the whole keyspace, DBSIZE). SCAN walks the hash table in an order
        unrelated to key names, so the first keys scanned are close to a random sample."""
        node = self._nodes.node(shard)
        total = int(self._call(node.dbsize, shard))
        prefix = self._prefix.encode() + b":"
        cursor: Any = 0
        scanned, found = 0, []
        while True:
            cursor, keys = self._call(lambda c=cursor: node.scan(cursor=c, count=SCAN_BATCH), shard)
            scanned += len(keys)
            found.extend(k for k in keys if k.startswith(prefix))
            if int(cursor) == 0:
                return found, scanned, True, total
            if scanned >= max_scanned:
                return found, scanned, False, total

    def unlink_keys(self, shard: str, keys: Sequence[bytes]) -> int:
        """UNLINK keys that live on one primary (from `scan_prefix`); how many were removed."""
        groups = self._nodes.unlink_groups(keys) if keys else []

        def unlink() -> int:
            with self._nodes.node(shard).pipeline(transaction=False) as pipe:
                for group in groups:
                    pipe.unlink(*group)
                return sum(int(n) for n in pipe.execute())

        return self._call(unlink, shard) if groups else 0

    def key_counts(self) -> dict[str, int | None]:
        """Keys under this store's prefix on each primary (None: it did not answer)."""
        match = escape_glob(self._prefix) + ":*"
        return self._each_primary(lambda shard: sum(len(batch) for batch in self._scan(shard, match)))

    def count_keys(self) -> int:
        return _total(self.key_counts())

    def memory_used_bytes(self) -> int:
        def used(shard: str) -> int:
            return int(
                self._call(lambda: self._nodes.node(shard).info("memory"), shard).get("used_memory", 0)
            )

        return _total(self._each_primary(used))

    def stats(self) -> RedisStats:
        shards = {s: b for s, b in self._breakers.items() if s != TOPOLOGY_SHARD}
        states = {s: b.state for s, b in shards.items()} or {"": self._breaker.state}
        worst = max(states.values(), key=_BREAKER_ORDER.__getitem__)
        closed = sum(state is BreakerState.CLOSED for state in states.values())
        topology = self._breakers.get(TOPOLOGY_SHARD)
        if topology is not None and topology.state is not BreakerState.CLOSED:
            closed, worst = 0, max(worst, topology.state, key=_BREAKER_ORDER.__getitem__)
        breakers = {id(b): b for b in (self._breaker, *self._breakers.values())}.values()
        return RedisStats(
            state="up" if closed == len(states) else ("down" if closed == 0 else "partial"),
            breaker=worst.value,
            failures=sum(b.total_failures for b in breakers),
            nodes=tuple(sorted((s, state.value) for s, state in states.items() if s)),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._nodes.close()


def _total(counts: dict[str, int | None]) -> int:
    if counts and all(n is None for n in counts.values()):
        raise CacheUnavailableError("no Redis primary answered")
    return sum(n or 0 for n in counts.values())
