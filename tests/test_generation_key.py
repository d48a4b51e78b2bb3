"""The generation key survives any eviction policy: a real redis-server under memory pressure
with `allkeys-lru` evicts it, and the replicas write it back instead of reading 0."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import redis

from engine.cache.generation import RedisGeneration, restore_generation_key
from storage.breaker import CircuitBreaker
from storage.redis.embedded import EmbeddedRedis
from storage.redis.fleet import FleetKeys, FleetRedis
from storage.redis.store import RedisStore, make_client

pytestmark = pytest.mark.redis

KEY = "infcache:meta:generation"


@pytest.fixture
def store(redis_server: EmbeddedRedis) -> Iterator[RedisStore]:
    client = make_client(redis_server.url, socket_timeout_s=2.0)
    store = RedisStore(client, prefix="infcache", breaker=CircuitBreaker(failure_threshold=5, reset_s=0.5))
    yield store
    store.close()


@pytest.fixture
def direct(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, socket_timeout=10.0)
    yield client
    client.close()


def _replica(store: RedisStore) -> RedisGeneration:
    # No watcher thread (never started): the test decides when each replica reads.
    return RedisGeneration(store, key=KEY, refresh_s=3600.0)


def _evict_under_pressure(direct: redis.Redis) -> int:
    """Fill Redis past maxmemory with allkeys-lru until it evicts the generation key;
    returns how many junk values it took."""
    direct.config_set("maxmemory-policy", "allkeys-lru")
    used = int(direct.info("memory")["used_memory"])
    direct.config_set("maxmemory", str(used + 2 * 1024 * 1024))
    junk = b"x" * 10_000
    written = 0
    try:
        while direct.exists(KEY) and written < 40_000:
            with direct.pipeline(transaction=False) as pipe:
                for i in range(200):
                    pipe.set(f"infcache:text:v:0:junk{written + i}", junk, ex=600)
                pipe.execute()
            written += 200
    finally:
        direct.config_set("maxmemory", "64mb")
    assert not direct.exists(KEY), f"the generation key survived {written} writes under allkeys-lru"
    assert int(direct.info("stats")["evicted_keys"]) > 0
    return written


def test_an_evicted_generation_key_is_written_back_and_never_read_as_zero(
    store: RedisStore, direct: redis.Redis
) -> None:
    old = _replica(store)
    direct.set(KEY, 3)  # three bumps ago, before this replica started
    assert old.refresh() == 3
    _evict_under_pressure(direct)
    assert direct.get(KEY) is None  # what a replica without protection would read as 0
    assert old.refresh() == 3  # not 0 ...
    assert direct.get(KEY) == b"3"  # ... and written back for the others
    newcomer = _replica(store)  # a replica started after the loss, with nothing remembered
    assert newcomer.refresh() == 3


def test_a_key_recreated_lower_is_lifted_back_and_a_bump_after_a_loss_moves_forward(
    store: RedisStore, direct: redis.Redis
) -> None:
    replica = _replica(store)
    direct.set(KEY, 5)
    assert replica.refresh() == 5
    direct.delete(KEY)
    direct.incr(KEY)  # an INCR on the vanished key (an older replica bumping) recreates it at 1
    assert replica.refresh() == 5
    assert direct.get(KEY) == b"5"
    direct.delete(KEY)
    assert replica.bump() == 6  # never 1


def test_restoring_is_idempotent_and_never_lowers_the_key(store: RedisStore, direct: redis.Redis) -> None:
    assert restore_generation_key(store, KEY, 4) == 4
    assert restore_generation_key(store, KEY, 4) == 4
    direct.set(KEY, 9)  # a bump elsewhere in the meantime
    assert restore_generation_key(store, KEY, 4) == 9
    assert direct.get(KEY) == b"9"


def test_a_first_start_on_an_empty_redis_begins_at_zero(store: RedisStore, direct: redis.Redis) -> None:
    with contextlib.suppress(redis.RedisError):
        direct.delete(KEY)
    assert _replica(store).refresh() == 0
    assert direct.get(KEY) == b"0"


def test_replicas_lifting_a_lost_key_at_once_agree_on_its_value(
    store: RedisStore, direct: redis.Redis
) -> None:
    """Two replicas' fleet members and a generation watcher that find the key gone at once
    (each read it as missing before any wrote it back) all write back the generation they saw,
    never more: a generation past the bumped one would retire every cached entry. The fleet
    epoch is lifted the same way."""
    fleet = FleetRedis(store, keys=FleetKeys("infcache"))
    assert fleet.keys.generation == KEY
    direct.set(KEY, 4)
    watcher = _replica(store)
    assert watcher.refresh() == 4
    direct.delete(KEY)
    assert fleet.read_counters()[0] == 0  # what both members read before either lifts it
    assert fleet.raise_counter(KEY, 4) == 4  # replica A's member
    assert fleet.raise_counter(KEY, 4) == 4  # replica B's, on its stale read
    assert watcher.refresh() == 4  # and the watcher
    assert direct.get(KEY) == b"4"
    direct.set(KEY, 6)  # a bump elsewhere meanwhile: never lowered
    assert fleet.raise_counter(KEY, 4) == 6 and direct.get(KEY) == b"6"
    direct.delete(fleet.keys.epoch)
    assert [fleet.raise_counter(fleet.keys.epoch, 9) for _ in range(2)] == [9, 9]
    assert fleet.read_counters() == (6, 9)
