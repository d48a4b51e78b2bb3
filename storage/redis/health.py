"""Redis memory and key churn, read from INFO on every primary (one node, or each primary of
a cluster): what the console's health panel and `/metrics` show, and what the alerts watch.

Knows nothing of the app above it: a list of plain values, one per primary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from storage.errors import CacheUnavailableError
from storage.redis.store import RedisStore

FIXED_MEMORY = ("used_memory_startup", "mem_clients_normal", "mem_clients_slaves", "used_memory_scripts",
                "mem_cluster_links")  # fmt: skip


@dataclass(frozen=True)
class NodeHealth:
    node: str  # "host:port" (or "redis" for one node reached by URL)
    up: bool
    used_memory: int | None = None
    maxmemory: int | None = None  # 0: no limit (Redis then never evicts; writes grow memory)
    policy: str | None = None  # maxmemory-policy, e.g. allkeys-lru
    evicted_keys: int | None = None
    expired_keys: int | None = None
    keys: int | None = None  # every key of the node's database 0, not only this app's
    # What Redis holds before any key, counted toward maxmemory: its memory at startup, its
    # clients' buffers, scripts, cluster links (the rest of a limit is what entries can use)
    fixed_memory: int | None = None

    @property
    def fill(self) -> float | None:
        """used / limit; None without a limit or an answer."""
        if not self.up or not self.maxmemory or self.used_memory is None:
            return None
        return self.used_memory / self.maxmemory


def _info(node: redis.Redis) -> dict[str, Any]:
    with node.pipeline(transaction=False) as pipe:
        pipe.info("memory")
        pipe.info("stats")
        pipe.info("keyspace")
        memory, stats, keyspace = pipe.execute()
    return {**memory, **stats, "keys": int((keyspace.get("db0") or {}).get("keys", 0))}


def read_health(store: RedisStore) -> list[NodeHealth]:
    """One entry per primary, in name order; a primary that does not answer is `up=False`.
    Empty when not even the list of primaries can be read (a cluster entirely down)."""
    try:
        primaries = sorted(store.primaries())
    except CacheUnavailableError:
        return []
    out = []
    for shard in primaries:
        try:
            info = store.on_primary(shard, _info)
        except CacheUnavailableError:
            out.append(NodeHealth(node=shard, up=False))
            continue
        out.append(NodeHealth(
            node=shard, up=True, used_memory=int(info.get("used_memory", 0)),
            maxmemory=int(info.get("maxmemory", 0)), policy=str(info.get("maxmemory_policy", "")),
            evicted_keys=int(info.get("evicted_keys", 0)), expired_keys=int(info.get("expired_keys", 0)),
            keys=int(info["keys"]), fixed_memory=sum(int(info.get(name, 0)) for name in FIXED_MEMORY),
        ))  # fmt: skip
    return out
