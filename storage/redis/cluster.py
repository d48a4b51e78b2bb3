"""Where each key lives: one node, a Sentinel-managed primary, or the primaries of a cluster.

`RedisStore` sends every command of its own to the primary that owns the key, through a
plain `redis.Redis` per primary (our socket timeout and one quick retry), so each primary
has its own circuit breaker and a dead node costs only the keys in its slots. For a
cluster the slot table comes from `CLUSTER SLOTS` and is re-read (at most once a second)
after a MOVED/ASK/CLUSTERDOWN reply or a failed node.

`client` is the redis-py client for plain commands elsewhere (leases, pub/sub, the
replica registry): `redis.Redis` for one node or Sentinel, `redis.cluster.RedisCluster`
for a cluster (built on first use, so the app starts while the cluster is down).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import RedisClusterException

log = logging.getLogger(__name__)

NodeFactory = Callable[[str, int], redis.Redis]
TOPOLOGY_REFRESH_MIN_S = 1.0  # re-read CLUSTER SLOTS at most this often
SUSPECT_S = 30.0  # a primary whose call failed is asked for the slot table last for this long
TOPOLOGY_SHARD = "cluster-topology"  # the breaker that guards reading the slot table
# Replies that say the slot table we hold is out of date.
_STALE_REPLIES = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


def _encode(key: str | bytes) -> bytes:
    return key if isinstance(key, bytes) else key.encode()


class OneNode:
    """One Redis (a node, or the primary a Sentinel names): every key in one shard."""

    is_cluster = False

    def __init__(self, client: redis.Redis, *, name: str) -> None:
        self._client = client
        self.name = name

    @property
    def client(self) -> redis.Redis:
        return self._client

    def shard_of(self, key: str | bytes) -> str:
        return self.name

    def node(self, shard: str) -> redis.Redis:
        return self._client

    def primaries(self) -> list[str]:
        return [self.name]

    def unlink_groups(self, keys: Sequence[bytes]) -> list[Sequence[bytes]]:
        return [keys]

    def note_error(self, exc: BaseException, shard: str | None = None) -> None:
        pass

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()


class ClusterNodes:
    """A Redis Cluster as its primaries: the slot table and a plain client per primary."""

    is_cluster = True

    def __init__(
        self,
        seeds: Iterable[tuple[str, int]],
        *,
        node_factory: NodeFactory,
        cluster_factory: Callable[[], RedisCluster],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._seeds = [f"{host}:{port}" for host, port in seeds]
        self._node_factory = node_factory
        self._cluster_factory = cluster_factory
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, redis.Redis] = {}
        self._slots: list[str] | None = None  # slot -> "host:port" of its primary
        self._stale = True
        self._loaded_at = float("-inf")
        self._cluster: RedisCluster | None = None
        self._closed = False
        self._suspects: dict[str, float] = {}  # primary -> when a call to it last failed

    @property
    def client(self) -> Any:
        """redis-py's `RedisCluster` for plain commands, behind a stand-in that builds it at
        its first use: building connects, and the app must start while the cluster is down.
        Until a node answers, every use raises redis.ConnectionError."""
        return _LazyCluster(self._cluster_client)

    def _cluster_client(self) -> RedisCluster:
        with self._lock:
            if self._closed:
                raise redis.ConnectionError("the cluster client is closed")
            if self._cluster is None:
                try:
                    self._cluster = self._cluster_factory()
                except RedisClusterException as exc:  # not a RedisError: callers catch those
                    raise redis.ConnectionError(str(exc)) from exc
            return self._cluster

    def node(self, shard: str) -> redis.Redis:
        with self._lock:
            client = self._nodes.get(shard)
            if client is None:
                if self._closed:
                    raise redis.ConnectionError("the cluster client is closed")
                host, _, port = shard.rpartition(":")
                client = self._nodes[shard] = self._node_factory(host, int(port))
            return client

    def shard_of(self, key: str | bytes) -> str:
        """The primary ("host:port") that owns `key`'s slot; reads the slot table first
        when it is unknown or stale (raises redis.RedisError when no node answers)."""
        slots = self._table()
        return slots[key_slot(_encode(key))]

    def primaries(self) -> list[str]:
        return sorted(set(self._table()))

    def unlink_groups(self, keys: Sequence[bytes]) -> list[Sequence[bytes]]:
        """A multi-key UNLINK must stay within one slot on a cluster."""
        by_slot: dict[int, list[bytes]] = {}
        for key in keys:
            by_slot.setdefault(key_slot(key), []).append(key)
        return list(by_slot.values())

    def note_error(self, exc: BaseException, shard: str | None = None) -> None:
        """A failed call (on primary `shard`): the slot table may be out of date (a failover,
        a moved slot), and `shard` is asked for it last for a while."""
        if shard is not None and isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            self._suspects[shard] = self._clock()
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) or str(exc).startswith(
            _STALE_REPLIES
        ):
            self._stale = True

    def _table(self) -> list[str]:
        slots = self._slots
        if slots is not None and (
            not self._stale or self._clock() - self._loaded_at < TOPOLOGY_REFRESH_MIN_S
        ):
            return slots
        return self._load(slots)

    def _load(self, previous: list[str] | None) -> list[str]:
        self._loaded_at = self._clock()  # also throttles failed attempts
        # Known primaries, then the seeds from the URL; a node that failed within the last
        # SUSPECT_S last, so a hung node costs a refresh a socket timeout only if no other answers.
        now = self._clock()
        recent = {name for name, at in self._suspects.items() if now - at < SUSPECT_S}
        ordered = list(dict.fromkeys([*sorted(set(previous or ())), *self._seeds]))
        candidates = [n for n in ordered if n not in recent] + [n for n in ordered if n in recent]
        last_error: Exception | None = None
        for name in candidates:
            try:
                reply = self.node(name).execute_command("CLUSTER", "SLOTS")
                table = _slot_table(reply)
            except (redis.RedisError, ValueError) as exc:
                last_error = exc
                continue
            if previous != table:
                log.info("Redis Cluster: %d primaries %s", len(set(table)), sorted(set(table)))
            self._slots, self._stale = table, False
            return table
        if previous is not None:
            return previous  # keep routing by what we knew; the breakers judge each node
        raise redis.ConnectionError(f"no cluster node answered CLUSTER SLOTS: {last_error}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            nodes, self._nodes = list(self._nodes.values()), {}
            cluster, self._cluster = self._cluster, None
        for client in nodes:
            client.close()
            client.connection_pool.disconnect()
        if cluster is not None:
            cluster.close()


class _LazyCluster:
    """Stands for a `RedisCluster` that `build` makes on first use (and its owner closes)."""

    __slots__ = ("_build",)

    def __init__(self, build: Callable[[], RedisCluster]) -> None:
        self._build = build

    def __getattr__(self, name: str) -> Any:
        return getattr(self._build(), name)

    def pubsub(self, **kwargs: Any) -> Any:
        """As `redis.Redis.pubsub()`: returns at once; the first use connects (and raises
        redis.ConnectionError while no node answers)."""
        return _LazyPubSub(lambda: self._build().pubsub(**kwargs))


class _LazyPubSub:
    """A `ClusterPubSub` made at its first use (subscribe, get_message, close...)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._pubsub: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._pubsub is None:
            if name == "close":
                return lambda: None  # never connected: nothing to close
            self._pubsub = self._make()
        return getattr(self._pubsub, name)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _slot_table(reply: Any) -> list[str]:
    """CLUSTER SLOTS -> a list of 16384 primary names ("host:port"); ValueError when a slot
    has no primary (the cluster is still being created)."""
    table: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    for entry in reply:
        start, end, primary = int(entry[0]), int(entry[1]), entry[2]
        name = f"{_text(primary[0])}:{int(primary[1])}"
        table[start : end + 1] = [name] * (end - start + 1)
    if any(name is None for name in table):
        raise ValueError("the cluster does not cover every slot yet")
    return table  # type: ignore[return-value]
