"""Redis clients for each REDIS_URL form: one node, a Redis Cluster, a Sentinel-managed primary.

Every client gets the same socket timeout, bounded pool and retry (one quick retry on a
dropped connection, never on a timeout, so a slow Redis costs at most one socket timeout
per call). Nothing connects here: the first command does, so the app starts while Redis
is down.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from common.background import BackgroundThread
from settings import RedisTarget, parse_redis_url
from storage.redis.cluster import ClusterNodes, OneNode

RETRY_BACKOFF_BASE_S = 0.005
RETRY_BACKOFF_CAP_S = 0.05
RETRIES = 1
MAX_CONNECTIONS = 64  # per node
SENTINEL_CHECK_S = 1.0  # how often the Sentinels are asked where the primary is

log = logging.getLogger(__name__)


def _retry() -> Retry:
    return Retry(
        ExponentialWithJitterBackoff(cap=RETRY_BACKOFF_CAP_S, base=RETRY_BACKOFF_BASE_S),
        RETRIES,
        supported_errors=(redis.ConnectionError,),
    )


def _timeouts(socket_timeout_s: float) -> dict[str, Any]:
    return {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s, "retry": _retry()}


def _credentials(target: RedisTarget) -> dict[str, Any]:
    return {"username": target.username, "password": target.password}


def node_client(url: str, *, socket_timeout_s: float, max_connections: int = MAX_CONNECTIONS) -> redis.Redis:
    """One node from a redis://, rediss:// or unix:// URL."""
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=socket_timeout_s,  # wait for a free pooled connection at most this long
        **_timeouts(socket_timeout_s),
    )
    return redis.Redis(connection_pool=pool)


def cluster_nodes(target: RedisTarget, *, socket_timeout_s: float, max_connections: int) -> ClusterNodes:
    """A cluster's primaries, each through its own bounded pool, and redis-py's RedisCluster
    (built when first asked for) for plain commands."""

    def node(host: str, port: int) -> redis.Redis:
        pool_class = redis.BlockingConnectionPool
        kwargs: dict[str, Any] = {
            "host": host,
            "port": port,
            **_credentials(target),
            **_timeouts(socket_timeout_s),
        }
        if target.tls:
            kwargs["connection_class"] = redis.SSLConnection
        pool = pool_class(max_connections=max_connections, timeout=socket_timeout_s, **kwargs)
        return redis.Redis(connection_pool=pool)

    def cluster() -> RedisCluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            ssl=target.tls,
            max_connections=max_connections,
            require_full_coverage=False,
            **_credentials(target),
            **_timeouts(socket_timeout_s),
        )

    return ClusterNodes(target.nodes, node_factory=node, cluster_factory=cluster)


class _SentinelConnection(SentinelManagedConnection):
    """redis-py's SentinelManagedConnection keeps a connection whose read failed: its
    `read_response` defaults to `disconnect_on_error=False`. After a socket timeout the late
    reply then stays on the pooled connection and the next command reads it as its own (a
    GET answered with another key's value, an HGETALL with an integer; seen under load).
    Dropped on error like every other connection, it cannot."""

    def read_response(self, disable_decoding: bool = False, **kwargs: Any) -> Any:
        kwargs.setdefault("disconnect_on_error", True)
        return super().read_response(disable_decoding, **kwargs)


class _SentinelSSLConnection(_SentinelConnection, redis.SSLConnection):
    pass


def sentinel_primary(target: RedisTarget, *, socket_timeout_s: float) -> tuple[redis.Redis, Sentinel]:
    """The primary these Sentinels name, followed across failovers: each new connection asks
    them where the primary is, and a connection to a demoted primary fails (READONLY ->
    ConnectionError), so the breaker's next probe lands on the new one."""
    timeouts = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s}
    sentinel = Sentinel(
        list(target.nodes),
        sentinel_kwargs={**timeouts, "ssl": target.tls},
        **timeouts,
    )
    assert target.service is not None
    primary = sentinel.master_for(
        target.service, db=target.db, ssl=target.tls, retry=_retry(), **_credentials(target), **timeouts,
        connection_class=_SentinelSSLConnection if target.tls else _SentinelConnection,
    )  # fmt: skip
    return primary, sentinel


def make_nodes(
    url: str, *, socket_timeout_s: float, max_connections: int = MAX_CONNECTIONS
) -> OneNode | ClusterNodes:
    """What `RedisStore` talks to, for any accepted REDIS_URL (settings.REDIS_URL_FORMS)."""
    target = parse_redis_url(url)
    if target.kind == "cluster":
        return cluster_nodes(target, socket_timeout_s=socket_timeout_s, max_connections=max_connections)
    if target.kind == "sentinel":
        primary, sentinel = sentinel_primary(target, socket_timeout_s=socket_timeout_s)
        return SentinelPrimary(primary, sentinel, name=f"primary of {target.service}")
    client = node_client(url, socket_timeout_s=socket_timeout_s, max_connections=max_connections)
    kwargs = client.connection_pool.connection_kwargs
    name = str(kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}")
    return OneNode(client, name=name)


class SentinelPrimary(OneNode):
    """One shard whose address the Sentinels decide; owns their clients and a watcher.

    After `SENTINEL FAILOVER` the old primary stays writable for seconds before the
    Sentinel turns it into a replica (and its new writes are then lost), so waiting for a
    failed call is not enough: a watcher thread asks the Sentinels every
    `SENTINEL_CHECK_S` and, when they name another primary, drops the idle connections to
    the old one (connections in use are dropped when returned), so the next command goes
    to the new primary."""

    def __init__(self, client: redis.Redis, sentinel: Sentinel, *, name: str) -> None:
        super().__init__(client, name=name)
        self._sentinel = sentinel
        # redis.RedisError: Sentinels unreachable; keep the current primary, its breaker judges it.
        self._watcher = BackgroundThread("sentinel-watcher", self._check, period_s=SENTINEL_CHECK_S, join_s=5,
                                         expected=(redis.RedisError,), logger=log,
                                         what="Sentinel watcher").start()  # fmt: skip

    def _check(self) -> None:
        pool = self._client.connection_pool
        before = pool.master_address  # type: ignore[attr-defined]
        now = pool.get_master_address()  # type: ignore[attr-defined]
        if before is not None and now != before:
            log.warning("Sentinel: the %s moved from %s to %s", self.name, before, now)

    def close(self) -> None:
        self._watcher.close()
        super().close()
        for client in self._sentinel.sentinels:
            client.close()
            client.connection_pool.disconnect()
