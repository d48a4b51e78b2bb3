"""Redis at scale: REDIS_URL's cluster and Sentinel forms, on real servers the suite starts.

A 3-primary Redis Cluster (`redis-server --cluster-enabled yes`, `redis-cli --cluster
create`) and a primary + replica + Sentinel are started once per module
(`testing/redis_servers.py`) and stopped after; the node-down test gets a cluster of its own.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.crc import key_slot

import tests.test_stores as store_contract
from admin.console.tab import stat_cards
from runtime import Runtime
from settings import REDIS_URL_FORMS, Settings, SettingsError, parse_redis_url
from storage.breaker import CircuitBreaker
from storage.errors import CacheUnavailableError
from storage.redis.clients import make_nodes
from storage.redis.cluster import TOPOLOGY_REFRESH_MIN_S
from storage.redis.store import RedisStore
from testing.redis_servers import LocalCluster, LocalSentinel
from tests.conftest import CountingTextModel

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def cluster(redis_binary: str) -> Iterator[LocalCluster]:
    with LocalCluster() as local:
        yield local


@pytest.fixture(scope="module")
def sentinel(redis_binary: str) -> Iterator[LocalSentinel]:
    with LocalSentinel() as local:
        yield local


def quick_breaker() -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=1, reset_s=0.2, max_reset_s=0.4)


def store_on(url: str, prefix: str = "contract") -> RedisStore:
    return RedisStore(
        make_nodes(url, socket_timeout_s=0.5),
        prefix=prefix,
        breaker=quick_breaker(),
        breaker_factory=quick_breaker,
    )


@pytest.fixture
def cluster_store(cluster: LocalCluster) -> Iterator[RedisStore]:
    store = store_on(cluster.url)
    store.clear()
    yield store
    store.clear()
    store.close()


@pytest.fixture
def sentinel_store(sentinel: LocalSentinel) -> Iterator[RedisStore]:
    store = store_on(sentinel.url)
    store.clear()
    yield store
    store.clear()
    store.close()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.05)


def keys_on_every_primary(store: RedisStore, prefix: str, count: int = 3) -> list[str]:
    """`count` keys under `prefix`, each owned by a different primary (by slot)."""
    found: dict[str, str] = {}
    i = 0
    while len(found) < count:
        key = f"{prefix}{i}"
        found.setdefault(store._shard(key), key)
        i += 1
    return list(found.values())


# --- REDIS_URL --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kind", "nodes", "service", "db", "tls"),
    [
        ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001", "cluster", (("10.0.0.1", 7000), ("10.0.0.2", 7001)),
         None, 0, False),
        ("rediss+cluster://:s3cret@[::1]:7000", "cluster", (("::1", 7000),), None, 0, True),
        ("redis+sentinel://s1:26379,s2/mymaster/2", "sentinel", (("s1", 26379), ("s2", 26379)), "mymaster", 2,
         False),
        ("rediss+sentinel://app:pw@s1:5000/cache", "sentinel", (("s1", 5000),), "cache", 0, True),
        ("redis://127.0.0.1:6379/3", "node", (), None, 0, False),
        ("unix:///run/redis.sock", "node", (), None, 0, False),
    ],
)  # fmt: skip
def test_redis_url_forms(url: str, kind: str, nodes: tuple, service: str | None, db: int, tls: bool) -> None:
    target = parse_redis_url(url)
    got = (target.kind, target.nodes, target.service, target.db, target.tls)
    assert got == (kind, nodes, service, db, tls)
    assert Settings.from_env({"REDIS_URL": url}).redis.url == url


def test_redis_url_credentials_are_decoded_and_never_shown() -> None:
    target = parse_redis_url("rediss+sentinel://app:p%40ss@s1:5000/cache")
    assert (target.username, target.password) == ("app", "p@ss")
    assert "p@ss" not in repr(target) and "p%40ss" not in repr(target)


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://",  # no node
        "redis+cluster://a:7000,b:port",  # a port that is not a number
        "redis+cluster://a:7000/1",  # a cluster has database 0 only
        "redis+sentinel://s1:26379",  # no service name
        "redis+sentinel://s1:26379/svc/x",  # a database that is not a number
        "redis+sentinel://s1:26379/svc/1/extra",
        "redis+sentinal://:topsecret@s1/svc",  # a misspelt scheme
        "redis://host:99999",
        "localhost:6379",
    ],
)
def test_malformed_redis_url_is_refused_at_start_up_with_the_accepted_forms(url: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({"REDIS_URL": url})
    message = str(refused.value)
    assert REDIS_URL_FORMS in message
    assert "redis+cluster://" in message and "redis+sentinel://" in message
    assert "topsecret" not in message  # credentials never go into the message


def test_app_refuses_a_malformed_url_before_serving(tmp_path) -> None:
    """`python app.py` with a bad REDIS_URL exits at once with the message, no traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "REDIS_URL": "redis+cluster://a:1/9", "DATA_DIR": str(tmp_path), "PORT": "1"}
    done = subprocess.run([sys.executable, "app.py"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert "Accepted forms" in done.stderr and "redis+sentinel://" in done.stderr
    assert "Traceback" not in done.stderr


# --- the store contract on a cluster and through Sentinel --------------------------------


class TestStoreContractOnClusterAndSentinel(store_contract.TestStoreContract):
    """The memory and single-node contract (tests/test_stores.py), on both new backends."""

    @pytest.fixture(params=["cluster", "sentinel"])
    def any_store(self, request: pytest.FixtureRequest) -> RedisStore:
        return request.getfixturevalue(f"{request.param}_store")


def test_cluster_keys_spread_over_every_primary_and_flush_keeps_meta(cluster_store: RedisStore) -> None:
    client = cluster_store.client
    client.set("contract:meta:generation", b"7")
    client.set("other-app:key", b"foreign")
    cluster_store.set_many([(f"contract:k{i}", b"v", 60) for i in range(300)])
    counts = cluster_store.key_counts()
    assert len(counts) == 3 and all(n and n > 50 for n in counts.values()), counts
    assert cluster_store.count_keys() == 301
    assert cluster_store.clear(keep_prefix="contract:meta:") == 300
    assert client.get("contract:meta:generation") == b"7"
    assert client.get("other-app:key") == b"foreign"
    assert cluster_store.count_keys() == 1
    client.delete("other-app:key")


def test_cluster_writes_across_slots_ride_with_the_read(cluster_store: RedisStore) -> None:
    a, b, c = keys_on_every_primary(cluster_store, "contract:x")
    assert len({key_slot(k.encode()) for k in (a, b, c)}) == 3
    cluster_store.set(c, b"cached", ttl_s=60)
    value, refused = cluster_store.get_after_writes([(a, b"result", 60), (b, b"alias", 300)], c)
    assert (value, refused) == (b"cached", 0)
    client = cluster_store.client
    assert client.get(a) == b"result" and client.get(b) == b"alias"
    assert 0 < client.ttl(a) <= 60 and 60 < client.ttl(b) <= 300
    # A write to the primary being read goes in the same pipeline, before the read.
    assert cluster_store.get_after_writes([(c, b"newer", 60), (a, b"again", 60)], c) == (b"newer", 0)


def test_a_hung_primary_costs_only_its_own_keys(cluster: LocalCluster) -> None:
    """A timeout on one primary marks the slot table stale; the re-read must ask another
    primary first, or every live key would wait a socket timeout on the hung one too. The
    timeout is long (1 s) so that what is measured is that wait, not a busy machine."""
    timeout_s = 1.0
    store = RedisStore(make_nodes(cluster.url, socket_timeout_s=timeout_s), prefix="hung",
                       breaker=quick_breaker(), breaker_factory=quick_breaker)  # fmt: skip
    pause_ms, paused_at = 3000, time.monotonic()
    try:
        hung = sorted(store.primaries())[0]  # the one a slot-table re-read would ask first by name
        keys = sorted(keys_on_every_primary(store, "hung:k"), key=lambda k: store._shard(k) != hung)
        store.set_many([(k, b"v", 60) for k in keys])
        time.sleep(TOPOLOGY_REFRESH_MIN_S + 0.05)  # the next failure re-reads the slot table
        node = redis.Redis(host="127.0.0.1", port=int(hung.rsplit(":", 1)[1]), socket_timeout=2)
        node.execute_command("CLIENT", "PAUSE", pause_ms, "ALL")
        paused_at = time.monotonic()
        node.close()
        with pytest.raises(CacheUnavailableError):
            store.get(keys[0])  # its own key: one timeout
        for key in keys[1:]:
            started = time.perf_counter()
            assert store.get(key) == b"v"
            assert time.perf_counter() - started < timeout_s / 2, "a live key waited on the hung primary"
        assert store.stats().state == "partial"
    finally:
        time.sleep(max(0.0, pause_ms / 1000 - (time.monotonic() - paused_at) + 0.1))
        store.close()


def test_plain_client_works_on_a_cluster_for_leases_and_pub_sub(cluster_store: RedisStore) -> None:
    """What other storage modules use (`store.client`, `store.call(..., key=)`)."""
    client = cluster_store.client
    lease = "contract:lease:abc"
    assert cluster_store.call(lambda: client.set(lease, "me", nx=True, px=5000), key=lease) is True
    assert cluster_store.call(lambda: client.set(lease, "you", nx=True, px=5000), key=lease) is None
    with client.pipeline(transaction=False) as pipe:  # keys on several primaries
        for key in keys_on_every_primary(cluster_store, "contract:p"):
            pipe.set(key, b"1", ex=30)
        assert pipe.execute() == [True, True, True]
    pubsub = client.pubsub()
    try:
        pubsub.subscribe("contract-channel")
        deadline = time.monotonic() + 5
        message = None
        while message is None and time.monotonic() < deadline:
            client.publish("contract-channel", b"flush")
            message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        assert message is not None and message["data"] == b"flush"
    finally:
        pubsub.close()


def test_cluster_down_at_start_up_fails_calls_not_the_app(make_runtime: Callable[..., Runtime]) -> None:
    from testing.redis_servers import free_ports

    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    runtime = make_runtime(redis__url=url, redis__socket_timeout_s=0.2)  # nothing listens there
    store = runtime.engine.l2_store()
    assert store is not None
    with pytest.raises(CacheUnavailableError):
        store.get("infcache:any")
    with pytest.raises(redis.ConnectionError):
        store.client.set("infcache:any", b"x")
    assert runtime.engine.classify("text", "hello there").tier == "miss"  # served by the model
    assert runtime.wait_for_l2(0.3, poll_s=0.1) is False


# --- the engine on a cluster ------------------------------------------------------------


def test_engine_on_a_cluster_shares_answers_generation_flush_and_node_counts(
    make_runtime: Callable[..., Runtime], cluster: LocalCluster
) -> None:
    models = [CountingTextModel(cheap=False), CountingTextModel(cheap=False)]  # aliases go to L2 too
    first, second = (make_runtime(models={"text": m}, redis__url=cluster.url) for m in models)
    first.engine.flush("all")
    texts = [f"where is parcel {i}?" for i in range(12)]
    assert {first.engine.classify("text", t).tier for t in texts} == {"miss"}
    assert {second.engine.classify("text", f"  {t}  ").tier for t in texts} == {"l2"}  # via the alias
    assert models[1].calls == 0
    state = first.admin.cache_state()["l2"]
    nodes = state["nodes"]
    assert [n["node"] for n in nodes] == sorted(f"127.0.0.1:{p}" for p in cluster.ports)
    assert all(n["keys"] > 0 and n["breaker"] == "closed" for n in nodes), nodes
    # results, aliases, the generation key
    assert state["keys"] == sum(n["keys"] for n in nodes) >= 2 * len(texts) + 1
    cards = stat_cards(first.admin.stats())  # the console's L2 card names each primary's count
    assert all(re.search(rf"{re.escape(n['node'])}: [0-9,]+", cards) for n in nodes), cards
    before = second.engine.generation
    assert first.engine.bump_generation() == before + 1
    wait_for(lambda: second.engine.generation == before + 1, "the other engine to read the new generation")
    assert second.engine.classify("text", texts[0]).tier == "miss"
    flushed = first.engine.flush("l2")
    assert flushed.l2_error is None and flushed.l2_removed and flushed.l2_removed > 2 * len(texts)
    left = sorted(first.engine.l2_store().client.scan_iter(match="infcache:*"))
    assert b"infcache:meta:generation" in left
    assert all(key.startswith(b"infcache:meta:") for key in left), left  # meta keys only
    assert second.engine.generation == before + 1


def test_a_dead_primary_costs_only_its_slots(make_runtime: Callable[..., Runtime], redis_binary: str) -> None:
    with LocalCluster() as local:
        store = store_on(local.url, prefix="down")
        try:
            keys = [f"down:k{i}" for i in range(60)]
            store.set_many([(k, b"v", 60) for k in keys])
            victim = store._shard(keys[0])
            local.kill(int(victim.rsplit(":", 1)[1]))
            started = time.monotonic()
            served, skipped = [], []
            for key in keys:
                try:
                    assert store.get(key) == b"v"
                    served.append(key)
                except CacheUnavailableError:
                    skipped.append(key)
            assert time.monotonic() - started < 2.0
            assert skipped and served and all(store._shard(k) == victim for k in skipped)
            assert all(store._shard(k) != victim for k in served)
            stats = store.stats()
            assert stats.state == "partial" and dict(stats.nodes)[victim] != "closed"
            with pytest.raises(CacheUnavailableError, match=victim):
                store.clear()  # the others are cleared all the same
            assert sum(n or 0 for n in store.key_counts().values()) == 0
            # An engine on the same cluster answers everything; keys of live primaries from L2.
            runtime = make_runtime(models={"text": CountingTextModel()}, redis__url=local.url)
            tiers = [runtime.engine.classify("text", f"message {i}").tier for i in range(20)]
            assert tiers.count("miss") == 20
            runtime.engine.flush("l1")
            again = [runtime.engine.classify("text", f"message {i}") for i in range(20)]
            on_victim = [r for r in again if runtime.engine.l2_store()._shard(r.key) == victim]
            assert {r.tier for r in again if r not in on_victim} == {"l2"}
            assert {r.tier for r in on_victim} <= {"miss"}
            local.restart(int(victim.rsplit(":", 1)[1]))
            deadline = time.monotonic() + 10
            while True:  # the breaker's probe finds the node again; no restart of ours
                try:
                    store.set(keys[0], b"back", ttl_s=60)
                    break
                except CacheUnavailableError:
                    assert time.monotonic() < deadline, "the restarted primary was not used again"
                    time.sleep(0.1)
            assert store.get(keys[0]) == b"back" and store.stats().state == "up"
        finally:
            store.close()


@pytest.mark.parametrize("topology", ["cluster", "sentinel"])
def test_the_fleet_works_on_a_cluster_and_through_sentinel(
    make_runtime: Callable[..., Runtime], request: pytest.FixtureRequest, topology: str
) -> None:
    """One fleet's registry, acknowledged flush and bump, and cross-replica single flight
    (engine/fleet/member.py, storage/redis/fleet.py) through `store.client` on both new forms."""
    url = request.getfixturevalue(topology).url
    # Heartbeats fast enough for a short test, slow enough for a busy 2-CPU machine.
    fast = {"fleet__generation_refresh_s": 0.1, "fleet__heartbeat_s": 0.4, "fleet__generation_confirm_s": 2.0}
    models = {name: CountingTextModel() for name in ("a", "b")}
    first, second = (
        make_runtime(models={"text": models[name]}, redis__url=url, server__replica_id=f"{topology}-{name}",
                     **fast)
        for name in ("a", "b")
    )
    ids = {f"{topology}-a", f"{topology}-b"}
    wait_for(lambda: ids <= {r["id"] for r in first.admin.replicas()}, "both replicas in the registry")
    first.admin.flush("all", actor="test")
    assert second.engine.classify("text", "a fleet message").tier == "miss"
    assert first.engine.classify("text", "a fleet message").tier == "l2"
    flushed = first.admin.flush("all", actor="test")
    assert flushed["fleet"]["complete"] and ids <= set(flushed["fleet"]["confirmed"]), flushed
    assert second.engine.classify("text", "a fleet message").tier == "miss"  # its L1 was dropped too
    bumped = first.admin.bump_version(actor="test")
    assert bumped["ok"] and bumped["fleet"]["complete"], bumped
    assert second.engine.generation == bumped["generation"]


# --- Sentinel ---------------------------------------------------------------------------


def test_a_sentinel_connection_that_timed_out_never_serves_its_late_reply(sentinel: LocalSentinel) -> None:
    """redis-py's Sentinel connections keep a connection whose read timed out; the next
    command on it would read the late reply as its own (storage/redis/clients.py)."""
    sentinel_store = RedisStore(make_nodes(sentinel.url, socket_timeout_s=0.25), prefix="contract",
                                breaker=quick_breaker())  # fmt: skip
    client = sentinel_store.client
    client.set("contract:a", b"value of a")
    client.set("contract:b", b"value of b")
    host, port = client.connection_pool.get_master_address()
    pauser = redis.Redis(host=host, port=port, socket_timeout=2)
    try:
        for _ in range(3):
            pauser.execute_command("CLIENT", "PAUSE", 400, "ALL")  # longer than one timeout, not two
            with pytest.raises(CacheUnavailableError):
                sentinel_store.get("contract:a")  # times out at 0.25 s, its reply comes at 0.4 s
            for _attempt in range(4):  # sent at once, on the same pool (a busy machine may time out)
                try:
                    value = client.get("contract:b")
                    break
                except redis.TimeoutError:
                    continue
            assert value == b"value of b", f"GET contract:b answered {value!r}"
            time.sleep(0.3)
    finally:
        pauser.close()
        sentinel_store.close()


def test_sentinel_failover_is_followed_without_a_restart(
    make_runtime: Callable[..., Runtime], sentinel: LocalSentinel, base_settings: Settings
) -> None:
    models = [CountingTextModel(), CountingTextModel()]
    first, second = (make_runtime(models={"text": m}, redis__url=sentinel.url) for m in models)
    first.engine.flush("all")
    assert first.engine.classify("text", "before the failover").tier == "miss"
    assert second.engine.classify("text", "before the failover").tier == "l2"
    old, new = sentinel.failover()
    assert old != new
    primary = redis.Redis(host="127.0.0.1", port=new, socket_timeout=1)
    try:
        deadline = time.monotonic() + 15
        for i in itertools.count():
            # Shared again through the new primary: an answer A computed, B reads from L2,
            # and it is on the new primary (found by the Sentinel watcher, or a breaker probe).
            text = f"after the failover {i}"
            first.engine.classify("text", text)
            shared = second.engine.classify("text", text)
            on_new = bool(primary.exists(shared.key))
            if shared.tier == "l2" and on_new:
                break
            assert time.monotonic() < deadline, (
                f"L2 not shared through the new primary within 15 s: last answer {shared.tier}, on the new "
                f"primary {on_new}, stores {[rt.engine.l2_store().stats() for rt in (first, second)]}"
            )
            time.sleep(0.1)
        generation = first.engine.bump_generation()
        # At least the bump (a replica may lift a value the old primary lost, never lower it).
        assert int(primary.get(f"{base_settings.cache.prefix}:meta:generation") or 0) >= generation
    finally:
        primary.close()
    wait_for(lambda: second.engine.generation >= generation, "the other engine to read the new generation")


def test_settings_object_keeps_the_url_as_given(cluster: LocalCluster) -> None:
    settings = Settings.from_env({"REDIS_URL": cluster.url})
    assert settings.redis.url == cluster.url and not settings.redis.l2_disabled
