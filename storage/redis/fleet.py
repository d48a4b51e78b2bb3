"""The fleet's keys in the shared Redis: the replica registry, the operation epoch, the
fleet channel and per-key leases. Knows nothing of engines or models: records are JSON
objects, cache keys opaque strings.

Every command is a plain single-key command (or a pipeline of them, or PUBLISH), so it works
the same on one node and on a cluster. Two kinds of call:

- background ones (heartbeats, polls, acknowledgements) go to the client directly: they are
  off the request path, so a slow Redis costs them time rather than a request, and they must
  keep working while the breaker keeps requests away from Redis (they tell whether Redis is
  back);
- request-path ones (leases) go through `RedisStore.call`: the breaker skips them while
  Redis is down, and every failure becomes `CacheUnavailableError`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisClusterException

from storage.errors import CacheUnavailableError
from storage.redis.store import RAISE_TO_FLOOR_SCRIPT, RedisStore

log = logging.getLogger(__name__)

T = TypeVar("T")

INDEX_TTL_MS = 3_600_000

# Deletes a lease only while it is still ours (a lease that expired and was taken by
# another replica must survive). One key: runs as it is on a cluster.
_RELEASE_SCRIPT = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


@dataclass(frozen=True)
class FleetKeys:
    """Where the fleet's state lives. Everything but the leases sits under `{prefix}:meta:`,
    which an operator's flush never removes."""

    prefix: str

    @property
    def generation(self) -> str:
        return f"{self.prefix}:meta:generation"

    @property
    def epoch(self) -> str:
        """Counts fleet-wide L1 operations (flushes, evictions): a replica that missed one
        sees the count move and drops its L1 as a whole. Like the generation, a counter
        without a TTL (a `volatile-*` eviction policy never evicts it)."""
        return f"{self.prefix}:meta:fleet_epoch"

    @property
    def index(self) -> str:
        """HASH replica id -> its last record (kept after it stops, until forgotten)."""
        return f"{self.prefix}:meta:replicas"

    def record(self, replica_id: str) -> str:
        """The live record: expires unless the replica heartbeats."""
        return f"{self.prefix}:meta:replica:{replica_id}"

    @property
    def channel(self) -> str:
        return f"{self.prefix}:fleet"

    def lease(self, cache_key: str) -> str:
        return f"{self.prefix}:lease:{cache_key.removeprefix(self.prefix + ':')}"


@dataclass(frozen=True)
class ReplicaEntry:
    record: dict[str, Any]
    live: bool  # its live record has not expired


class FleetRedis:
    def __init__(self, store: RedisStore, *, keys: FleetKeys) -> None:
        self._store = store
        self.keys = keys

    @property
    def _client(self) -> Any:
        # Asked each time: on a cluster the store builds its client at first use.
        return self._store.client

    # ---- background calls: the client directly, never the breaker -------------------

    def _direct(self, operation: Callable[[], T]) -> T:
        try:
            return operation()
        except (redis.RedisError, RedisClusterException) as exc:
            raise CacheUnavailableError(f"Redis call failed: {exc.__class__.__name__}") from exc

    def write_record(self, replica_id: str, record: dict[str, Any], *, ttl_ms: int) -> None:
        blob = json.dumps(record, separators=(",", ":"))

        def pipelined() -> None:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.set(self.keys.record(replica_id), blob, px=ttl_ms)
                pipe.hset(self.keys.index, replica_id, blob)
                # Like every key but the two counters, the index expires: after the last replica
                # stopped heartbeating, once nothing in it is worth listing any more.
                pipe.pexpire(self.keys.index, INDEX_TTL_MS)
                pipe.execute()

        self._direct(pipelined)

    def mark_stopped(self, replica_id: str, record: dict[str, Any]) -> None:
        """A clean stop: the live record goes, the index keeps the last one marked stopped."""
        blob = json.dumps({**record, "stopped": True}, separators=(",", ":"))

        def pipelined() -> None:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.delete(self.keys.record(replica_id))
                pipe.hset(self.keys.index, replica_id, blob)
                pipe.execute()

        self._direct(pipelined)

    def read_records(self) -> list[ReplicaEntry]:
        """Every replica the index knows, each with whether its live record is still there."""
        raw_index = self._direct(lambda: self._client.hgetall(self.keys.index))
        if not raw_index:
            return []
        index = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw_index.items()}
        ids = sorted(index)

        def pipelined() -> list[Any]:
            with self._client.pipeline(transaction=False) as pipe:
                for replica_id in ids:
                    pipe.get(self.keys.record(replica_id))
                return pipe.execute()

        live_blobs = self._direct(pipelined)
        entries = []
        for replica_id, live_blob in zip(ids, live_blobs, strict=True):
            blob = live_blob if live_blob is not None else index[replica_id]
            try:
                record = json.loads(blob)
            except (TypeError, ValueError):
                log.warning("unreadable registry record for %r: ignored", replica_id)
                continue
            if isinstance(record, dict):
                entries.append(ReplicaEntry({**record, "id": replica_id}, live_blob is not None))
        return entries

    def forget(self, replica_ids: list[str]) -> None:
        if replica_ids:
            self._direct(lambda: self._client.hdel(self.keys.index, *replica_ids))

    def read_counters(self) -> tuple[int, int]:
        """(generation, epoch); a missing key reads 0."""

        def pipelined() -> list[Any]:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.get(self.keys.generation)
                pipe.get(self.keys.epoch)
                return pipe.execute()

        generation, epoch = self._direct(pipelined)
        return int(generation or 0), int(epoch or 0)

    def raise_counter(self, key: str, floor: int) -> int:
        """Lift a counter that went back (evicted, a Redis restarted without its data) to
        `floor`, what this replica already saw; one that is there already is left as it is.
        Idempotent: replicas lifting it at once (and the generation watcher,
        engine.cache.generation) agree on the value, never overshoot it. Returns its value."""
        return int(self._direct(lambda: self._client.eval(RAISE_TO_FLOOR_SCRIPT, 1, key, floor)))

    def next_epoch(self) -> int:
        return int(self._direct(lambda: self._client.incr(self.keys.epoch)))

    def publish(self, message: dict[str, Any]) -> int:
        """Returns how many subscribers got it."""
        blob = json.dumps(message, separators=(",", ":"))
        return int(self._direct(lambda: self._client.publish(self.keys.channel, blob)))

    def subscribe(self) -> Any:
        """A PubSub on the fleet channel (its own connection); the caller closes it."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            self._direct(lambda: pubsub.subscribe(self.keys.channel))
        except BaseException:
            pubsub.close()
            raise
        return pubsub

    # ---- request-path calls: through the store's breaker -------------------------------

    def take_lease(self, cache_key: str, token: str, *, ttl_ms: int) -> bool:
        lease = self.keys.lease(cache_key)
        return bool(
            self._store.call(lambda: self._client.set(lease, token, nx=True, px=max(1, ttl_ms)), key=lease)
        )

    def lease_held(self, cache_key: str) -> bool:
        lease = self.keys.lease(cache_key)
        return bool(self._store.call(lambda: self._client.exists(lease), key=lease))

    def release_lease(self, cache_key: str, token: str) -> bool:
        lease = self.keys.lease(cache_key)
        return bool(self._store.call(lambda: self._client.eval(_RELEASE_SCRIPT, 1, lease, token), key=lease))
