"""Store contract (memory and Redis), L1 byte budget and TTL, breaker, codec."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator

import msgpack
import pytest

from engine.cache.codec import (
    CachedAlias,
    CachedRejection,
    CachedResult,
    UndecodableValue,
    decode,
    encode,
)
from engine.models.base import Prediction
from storage.breaker import BreakerState, CircuitBreaker
from storage.errors import CacheUnavailableError
from storage.memory import MemoryStore
from storage.redis.embedded import EmbeddedRedis
from storage.redis.store import RedisStore, escape_glob, make_client


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


class MemoryAdapter:
    """Presents MemoryStore with the bytes-valued interface the contract test uses."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def get(self, key: str) -> bytes | None:
        return self.store.get(key)

    def set(self, key: str, value: bytes, *, ttl_s: int) -> None:
        self.store.set(key, value, size=len(value), ttl_s=ttl_s)

    def delete(self, key: str) -> bool:
        return self.store.delete(key)

    def clear(self) -> int:
        return self.store.clear()


@pytest.fixture
def redis_store(redis_server: EmbeddedRedis) -> Iterator[RedisStore]:
    client = make_client(redis_server.url, socket_timeout_s=0.5)
    store = RedisStore(client, prefix="contract", breaker=CircuitBreaker())
    yield store
    store.close()


@pytest.fixture(params=["memory", "redis"])
def any_store(request: pytest.FixtureRequest) -> object:
    if request.param == "memory":
        return MemoryAdapter(MemoryStore(max_bytes=1 << 20, default_ttl_s=60))
    return request.getfixturevalue("redis_store")


class TestStoreContract:
    """The same behaviour from every backend (cachetools' CacheTestMixin style)."""

    def test_get_missing_is_none(self, any_store) -> None:
        assert any_store.get("contract:nope") is None

    def test_set_then_get_round_trips_bytes(self, any_store) -> None:
        any_store.set("contract:a", b"\x00value\xff", ttl_s=60)
        assert any_store.get("contract:a") == b"\x00value\xff"

    def test_overwrite_replaces(self, any_store) -> None:
        any_store.set("contract:a", b"one", ttl_s=60)
        any_store.set("contract:a", b"two", ttl_s=60)
        assert any_store.get("contract:a") == b"two"

    def test_delete(self, any_store) -> None:
        any_store.set("contract:a", b"one", ttl_s=60)
        assert any_store.delete("contract:a") is True
        assert any_store.get("contract:a") is None
        assert any_store.delete("contract:a") is False

    def test_clear_counts_and_empties(self, any_store) -> None:
        for i in range(25):
            any_store.set(f"contract:k{i}", b"v", ttl_s=60)
        assert any_store.clear() == 25
        assert all(any_store.get(f"contract:k{i}") is None for i in range(25))
        assert any_store.clear() == 0


def test_redis_writes_carry_the_ttl(redis_store: RedisStore) -> None:
    redis_store.set("contract:t", b"v", ttl_s=120)
    assert 0 < redis_store.client.ttl("contract:t") <= 120
    with pytest.raises(ValueError):
        redis_store.set("contract:t", b"v", ttl_s=0)


def test_redis_set_many_writes_each_with_its_ttl(redis_store: RedisStore) -> None:
    redis_store.set_many([("contract:a", b"1", 60), ("contract:b", b"2", 300), ("contract:a", b"3", 60)])
    client = redis_store.client
    assert client.get("contract:a") == b"3"  # in order
    assert client.get("contract:b") == b"2"
    assert 0 < client.ttl("contract:a") <= 60 and 60 < client.ttl("contract:b") <= 300
    with pytest.raises(ValueError):
        redis_store.set_many([("contract:c", b"v", 60), ("contract:d", b"v", -1)])
    assert client.get("contract:c") is None  # refused as a whole, nothing written


def test_redis_clear_is_scoped_to_prefix_and_spares_kept_keys(redis_store: RedisStore) -> None:
    client = redis_store.client
    client.set("other-app:key", b"foreign")
    client.set("contractual:key", b"shares the first letters only")
    client.set("contract:meta:generation", b"7")
    for i in range(1200):  # several SCAN batches
        client.set(f"contract:k{i}", b"v", ex=60)
    assert redis_store.clear(keep_prefix="contract:meta:") == 1200
    assert client.get("other-app:key") == b"foreign"
    assert client.get("contractual:key") is not None
    assert client.get("contract:meta:generation") == b"7"


def test_escape_glob_matches_only_itself() -> None:
    assert escape_glob("a*b?[c]\\") == "a\\*b\\?\\[c\\]\\\\"


class TestMemoryStore:
    def test_stays_within_byte_budget_and_evicts_lru(self) -> None:
        store = MemoryStore(max_bytes=10_000, default_ttl_s=60)
        for i in range(1000):
            store.set(f"k{i}", i, size=100)
            assert store.stats().bytes <= 10_000
        stats = store.stats()
        assert stats.entries == 100
        assert stats.evictions == 900
        assert store.get("k0") is None and store.get("k999") == 999

    def test_recently_read_entry_survives_eviction(self) -> None:
        store = MemoryStore(max_bytes=300, default_ttl_s=60)
        store.set("a", "a", size=100)
        store.set("b", "b", size=100)
        store.set("c", "c", size=100)
        assert store.get("a") == "a"  # a becomes most recently used
        store.set("d", "d", size=100)
        assert store.get("b") is None
        assert store.get("a") == "a"

    def test_entry_larger_than_budget_is_refused(self) -> None:
        store = MemoryStore(max_bytes=100, default_ttl_s=60)
        assert store.set("big", "x", size=101) is False
        assert store.get("big") is None

    def test_per_entry_ttl_with_injected_clock(self) -> None:
        clock = FakeClock()
        store = MemoryStore(max_bytes=1000, default_ttl_s=60, timer=clock)
        store.set("short", 1, size=1, ttl_s=5)
        store.set("long", 2, size=1)
        clock.tick(4.9)
        assert store.get("short") == 1
        clock.tick(0.2)
        assert store.get("short") is None
        assert store.get("long") == 2
        clock.tick(60)
        assert store.get("long") is None
        assert store.stats().entries == 0

    def test_counts_hits_and_misses(self) -> None:
        store = MemoryStore(max_bytes=1000, default_ttl_s=60)
        store.set("a", 1, size=1)
        store.get("a")
        store.get("b")
        stats = store.stats()
        assert (stats.hits, stats.misses) == (1, 1)

    def test_matches_a_plain_model_over_random_operations(self) -> None:
        """Reads, writes, overwrites, deletes and expiry under byte pressure, against a model
        written for clarity: live entries in recency order, expired ones dropped before the
        least recently used make room."""
        rng = random.Random(7)
        clock = FakeClock()
        store = MemoryStore(max_bytes=500, default_ttl_s=30, timer=clock)
        model: dict[str, tuple[int, int, float]] = {}  # key -> (value, size, expires), oldest use first
        evictions = 0

        def live(key: str) -> bool:
            return key in model and clock.now < model[key][2]

        for step in range(5000):
            key, op = f"k{rng.randrange(40)}", rng.random()
            if op < 0.45:
                expected = model[key][0] if live(key) else None
                if live(key):
                    model[key] = model.pop(key)
                else:
                    model.pop(key, None)
                assert store.get(key) == expected, step
            elif op < 0.85:
                size, ttl = rng.randrange(1, 120), rng.choice([None, 1, 5, 60])
                model.pop(key, None)
                if sum(item[1] for item in model.values()) + size > 500:
                    for k in [k for k in model if not live(k)]:
                        del model[k]
                    while sum(item[1] for item in model.values()) + size > 500:
                        del model[next(iter(model))]
                        evictions += 1
                model[key] = (step, size, clock.now + (30 if ttl is None else ttl))
                assert store.set(key, step, size=size, ttl_s=ttl)
            elif op < 0.9:
                assert store.delete(key) == live(key), step
                model.pop(key, None)
            elif op < 0.95:
                assert store.peek(key) == (model[key][0] if live(key) else None), step
            else:
                clock.tick(rng.choice([0.5, 2, 10]))
            if step % 50 == 0:
                for k in [k for k in model if not live(k)]:
                    del model[k]
                stats = store.stats()
                assert (stats.entries, stats.bytes, stats.evictions) == (
                    len(model), sum(item[1] for item in model.values()), evictions), step

    def test_clear_is_not_counted_as_eviction(self) -> None:
        store = MemoryStore(max_bytes=1000, default_ttl_s=60)
        for i in range(5):
            store.set(str(i), i, size=1)
        assert store.clear() == 5
        assert store.stats().evictions == 0


class TestCircuitBreaker:
    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def breaker(self, clock: FakeClock) -> CircuitBreaker:
        return CircuitBreaker(failure_threshold=3, reset_s=2.0, max_reset_s=5.0, clock=clock,
                              rng=random.Random(1))  # fmt: skip

    def test_opens_after_threshold_then_probes_once(self, breaker: CircuitBreaker, clock: FakeClock) -> None:
        for _ in range(2):
            breaker.record_failure()
        assert breaker.allow() and breaker.state is BreakerState.CLOSED
        breaker.record_failure()
        assert breaker.state is BreakerState.OPEN
        assert not breaker.allow()
        clock.tick(2.0)
        assert breaker.allow()  # the probe
        assert not breaker.allow()  # only one probe at a time
        breaker.record_success()
        assert breaker.state is BreakerState.CLOSED and breaker.allow()

    def test_failed_probe_reopens_with_capped_backoff(
        self, breaker: CircuitBreaker, clock: FakeClock
    ) -> None:
        for _ in range(3):
            breaker.record_failure()
        for _ in range(10):
            clock.tick(5.0)  # the cap: never wait longer than max_reset_s
            assert breaker.allow()
            breaker.record_failure()
            assert breaker.state is BreakerState.OPEN
        assert breaker.times_opened == 1

    def test_success_resets_the_count(self, breaker: CircuitBreaker) -> None:
        breaker.record_failure()
        breaker.record_failure()
        breaker.record_success()
        breaker.record_failure()
        assert breaker.state is BreakerState.CLOSED


def test_store_on_dead_redis_raises_cache_unavailable_then_skips(redis_server: EmbeddedRedis) -> None:
    client = make_client(redis_server.url, socket_timeout_s=0.2)
    store = RedisStore(client, prefix="dead", breaker=CircuitBreaker(failure_threshold=2, reset_s=60))
    try:
        redis_server.kill()
        for _ in range(2):
            with pytest.raises(CacheUnavailableError):
                store.get("dead:x")
        assert store.stats().state == "down"
        with pytest.raises(CacheUnavailableError, match="circuit breaker"):
            store.get("dead:x")
    finally:
        store.close()


class TestCodec:
    PREDICTION = Prediction((("tabby", 0.4239762723445892), ("tiger cat", 0.21558175981044769)))

    @pytest.mark.parametrize(
        "value",
        [
            CachedResult(PREDICTION, "abc123", 1_700_000_000.25),
            CachedAlias("c106630a79857486cb5d8a22c12fc898"),
            CachedRejection("empty_file", "The uploaded file is empty (0 bytes).", 1.5),
        ],
    )
    def test_round_trip_is_exact(self, value) -> None:
        assert decode(encode(value, key="k:1"), key="k:1") == value

    def test_a_value_moved_to_another_key_or_bit_flipped_is_refused(self) -> None:
        blob = encode(CachedResult(self.PREDICTION, "v", 1.0), key="k:1")
        with pytest.raises(UndecodableValue, match="checksum"):
            decode(blob, key="k:2")
        label_at = blob.index(b"tabby")
        flipped = blob[:label_at] + bytes([blob[label_at] ^ 0x02]) + blob[label_at + 1 :]
        with pytest.raises(UndecodableValue, match="checksum"):
            decode(flipped, key="k:1")

    def test_value_is_msgpack_with_schema_tag_not_pickle(self) -> None:
        blob = encode(CachedResult(self.PREDICTION, "v", 1.0), key="k")
        assert msgpack.unpackb(blob[:-8])["s"] == "infcache.result/1"
        assert not blob.startswith(b"\x80")  # pickle protocol 2+ header

    @pytest.mark.parametrize(
        "blob",
        [
            b"",
            b"garbage\xff\xfe",
            pickle.dumps({"s": "infcache.result/1"}),
            msgpack.packb({"s": "infcache.result/999", "p": [], "v": "x", "t": 1.0}),
            msgpack.packb({"s": "infcache.result/1", "p": [["a", "not-a-float"]], "v": "x", "t": 1.0}),
            msgpack.packb({"s": "infcache.alias/1", "d": "../../etc"}),
            msgpack.packb([1, 2, 3]),
        ],
    )
    def test_corrupt_or_foreign_values_are_refused(self, blob: bytes) -> None:
        with pytest.raises(UndecodableValue):
            decode(blob, key="k")


def test_redis_get_after_writes_sends_them_first_in_one_call(redis_store: RedisStore) -> None:
    client = redis_store.client
    client.set("contract:read", b"r")
    value, refused = redis_store.get_after_writes(
        [("contract:a", b"1", 60), ("contract:a", b"2", 300), ("contract:read", b"new", 60)], "contract:read"
    )
    assert (value, refused) == (b"new", 0)  # the writes went first, in order
    assert client.get("contract:a") == b"2" and 60 < client.ttl("contract:a") <= 300
    assert redis_store.get_after_writes([], "contract:missing") == (None, 0)
    with pytest.raises(ValueError):
        redis_store.get_after_writes([("contract:c", b"v", 0)], "contract:read")
    assert client.get("contract:c") is None


def test_redis_get_after_writes_reads_even_when_a_write_is_refused(redis_store: RedisStore) -> None:
    client = redis_store.client
    client.set("contract:read", b"r")
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)  # every write now fails with OOM; reads still work
    value, refused = redis_store.get_after_writes(
        [("contract:big", b"x" * 10_000, 60), ("contract:big2", b"y", 60)], "contract:read"
    )
    assert (value, refused) == (b"r", 2)
    assert client.get("contract:big") is None
