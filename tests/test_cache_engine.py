"""The tiered cache through `InferenceEngine.classify`, against a real redis-server."""

from __future__ import annotations

import io
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest
import redis
from PIL import Image

from engine.cache.keys import DIGEST_PATTERN
from engine.cache.tiers import L2_WRITE_DELAY_S
from engine.errors import InvalidInputError, ModelError
from engine.pipeline.service import ProbeMiss
from runtime import Runtime
from storage.redis.embedded import EmbeddedRedis
from tests.conftest import CountingTextModel, FailingModel

pytestmark = pytest.mark.redis


def engine_pair(
    make_runtime: Callable[..., Runtime], url: str, model: Any = None
) -> tuple[Runtime, Runtime, CountingTextModel, CountingTextModel]:
    first_model = model or CountingTextModel()
    second_model = CountingTextModel(version=first_model.version, cheap=first_model.cheap_canonicalize)
    first = make_runtime(models={"text": first_model}, redis__url=url)
    second = make_runtime(models={"text": second_model}, redis__url=url)
    return first, second, first_model, second_model


def all_keys(url: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(match="*", count=1000))
    finally:
        client.close()


class TestTiers:
    def test_miss_then_l1_then_l2_from_a_second_engine(self, make_runtime, redis_server) -> None:
        first, second, first_model, second_model = engine_pair(make_runtime, redis_server.url)
        miss = first.engine.classify("text", "Where is my parcel?")
        hit = first.engine.classify("text", "Where is my parcel?")
        shared = second.engine.classify("text", "Where is my parcel?")
        promoted = second.engine.classify("text", "Where is my parcel?")
        assert [r.tier for r in (miss, hit, shared, promoted)] == ["miss", "l1", "l2", "l1"]
        assert first_model.calls == 1 and second_model.calls == 0
        # byte-identical answers whichever tier served them
        assert miss.prediction == hit.prediction == shared.prediction == promoted.prediction
        assert repr(miss.prediction) == repr(shared.prediction)
        assert miss.key == hit.key == shared.key
        assert miss.age_s == 0.0 and shared.age_s >= 0.0

    def test_cache_info_has_the_contract_fields(self, make_runtime, redis_server) -> None:
        runtime = make_runtime(redis__url=redis_server.url)
        info = runtime.engine.classify("text", "hello").cache_info()
        assert set(info) >= {"tier", "key", "model", "model_version", "generation", "latency_ms",
                             "device", "age_s"}  # fmt: skip
        prefix, task, version, generation, digest = info["key"].split(":")
        assert (prefix, task, version, int(generation)) == ("infcache", "text", "standin-v1", 0)
        assert DIGEST_PATTERN.match(digest) and info["latency_ms"] > 0

    def test_whitespace_variants_share_one_entry(self, make_runtime, redis_server) -> None:
        model = CountingTextModel()
        runtime = make_runtime(models={"text": model}, redis__url=redis_server.url)
        variants = ("refund please", "  refund   please ", "refund\tplease\n", "refund\u00a0please")
        results = [runtime.engine.classify("text", text) for text in variants]
        assert len({r.key for r in results}) == 1
        assert [r.tier for r in results] == ["miss", "l1", "l1", "l1"]
        assert model.calls == 1

    def test_model_version_is_part_of_the_key(self, make_runtime, redis_server) -> None:
        old = make_runtime(models={"text": CountingTextModel("v1")}, redis__url=redis_server.url)
        new_model = CountingTextModel("v2")
        new = make_runtime(models={"text": new_model}, redis__url=redis_server.url)
        old.engine.classify("text", "cancel my order")
        result = new.engine.classify("text", "cancel my order")
        assert result.tier == "miss" and new_model.calls == 1
        assert result.model_version == "v2" and ":v2:" in result.key

    def test_l2_disabled_runs_l1_only(self, make_runtime) -> None:
        runtime = make_runtime(redis__url="off")
        assert runtime.engine.classify("text", "hi").tier == "miss"
        assert runtime.engine.classify("text", "hi").tier == "l1"
        assert runtime.engine.cache_state()["l2"]["state"] == "disabled"


class TestRedisValues:
    def test_every_key_has_a_ttl_except_the_generation(self, make_runtime, redis_server) -> None:
        # cheap=False: aliases and remembered rejections are written to Redis too.
        runtime = make_runtime(models={"text": CountingTextModel(cheap=False)}, redis__url=redis_server.url)
        for text in ("a question", "another question"):
            runtime.engine.classify("text", text)
        with pytest.raises(InvalidInputError):  # remembered as a negative entry, in Redis too
            runtime.engine.classify("text", "")
        runtime.engine.bump_generation()
        runtime.engine.classify("text", "after the bump")
        client = redis.Redis.from_url(redis_server.url)
        keys = all_keys(redis_server.url)
        assert len(keys) >= 5
        for key in keys:
            ttl = client.ttl(key)
            if key in (b"infcache:meta:generation", b"infcache:meta:fleet_epoch"):  # counters
                assert ttl == -1
            else:
                assert ttl > 0, key
        client.close()

    def test_no_value_is_a_pickle(self, make_runtime, redis_server) -> None:
        runtime = make_runtime(redis__url=redis_server.url)
        runtime.engine.classify("text", "where is my order")
        client = redis.Redis.from_url(redis_server.url)
        for key in all_keys(redis_server.url):
            if b":meta:" in key:  # bookkeeping: two counters and the replica registry's JSON
                continue
            value = client.get(key)
            assert not value.startswith(b"\x80"), "pickle header found"
            assert msgpack.unpackb(value[:-8])["s"].startswith("infcache.")
        client.close()

    @pytest.mark.parametrize(
        "planted",
        [
            b"\x00\x01 not msgpack",
            msgpack.packb({"s": "infcache.result/99", "p": [["evil", 1.0]], "v": "x", "t": 1.0}),
            pickle.dumps({"s": "infcache.result/1", "p": [["evil", 1.0]]}),
        ],
        ids=["corrupt", "unknown-schema", "pickle"],
    )
    def test_bad_value_is_deleted_and_recomputed(self, make_runtime, redis_server, planted) -> None:
        first, second, _, second_model = engine_pair(make_runtime, redis_server.url)
        good = first.engine.classify("text", "my card was declined")
        client = redis.Redis.from_url(redis_server.url)
        client.set(good.key, planted, ex=60)
        again = second.engine.classify("text", "my card was declined")
        assert again.tier == "miss" and second_model.calls == 1
        assert again.prediction == good.prediction
        assert "evil" not in dict(again.prediction.labels)
        assert second.engine.counters().corrupt_values == 1
        assert client.get(good.key) != planted  # replaced by the recomputed value
        client.close()


class TestSingleFlight:
    def test_sixteen_threads_one_model_call(self, make_runtime, redis_server) -> None:
        model = CountingTextModel(delay_s=0.3)
        runtime = make_runtime(models={"text": model}, redis__url=redis_server.url)
        barrier = threading.Barrier(16)
        results: list[Any] = []

        def ask() -> None:
            barrier.wait()
            results.append(runtime.engine.classify("text", "talk to a human"))

        threads = [threading.Thread(target=ask) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert model.calls == 1
        tiers = sorted(r.tier for r in results)
        assert tiers.count("miss") == 1 and len(results) == 16
        assert set(tiers) <= {"miss", "coalesced", "l1"} and "coalesced" in tiers
        assert len({r.prediction for r in results}) == 1

    def test_waiters_get_the_leaders_error_and_it_is_not_cached(self, make_runtime) -> None:
        model = FailingModel(delay_s=0.0)
        runtime = make_runtime(models={"text": model})
        errors: list[BaseException] = []
        barrier = threading.Barrier(6)

        def ask() -> None:
            barrier.wait()
            try:
                runtime.engine.classify("text", "boom")
            except ModelError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(errors) == 6
        calls = model.calls
        with pytest.raises(ModelError):
            runtime.engine.classify("text", "boom")
        assert model.calls == calls + 1  # failures are never cached


class TestNegativeEntries:
    def test_rejection_is_remembered_in_l1_and_l2(self, make_runtime, redis_server) -> None:
        # A model whose canonicalization is real work (like decoding an image).
        first, second, _, _ = engine_pair(make_runtime, redis_server.url, CountingTextModel(cheap=False))
        with pytest.raises(InvalidInputError) as first_error:
            first.engine.classify("text", "   \t  ")
        with pytest.raises(InvalidInputError) as again:
            first.engine.classify("text", "   \t  ")
        with pytest.raises(InvalidInputError) as elsewhere:
            second.engine.classify("text", "   \t  ")
        assert first_error.value == again.value == elsewhere.value
        assert first.engine.counters().negative_hits == 1
        assert second.engine.counters().negative_hits == 1
        negative_keys = [k for k in all_keys(redis_server.url) if b":text-raw:" in k]
        client = redis.Redis.from_url(redis_server.url)
        assert negative_keys and all(0 < client.ttl(k) <= 60 for k in negative_keys)
        client.close()

    def test_model_failure_is_not_remembered(self, make_runtime) -> None:
        model = CountingTextModel()
        runtime = make_runtime(models={"text": model})
        model.fail_next = True
        with pytest.raises(ModelError):
            runtime.engine.classify("text", "flaky")
        assert runtime.engine.classify("text", "flaky").tier == "miss"
        assert model.calls == 2


class TestGeneration:
    def test_bump_makes_next_request_a_miss_everywhere(self, make_runtime, redis_server) -> None:
        first, second, _, _ = engine_pair(make_runtime, redis_server.url)
        first.engine.classify("text", "refund")
        assert second.engine.classify("text", "refund").tier == "l2"
        assert second.engine.classify("text", "refund").tier == "l1"
        new_generation = first.engine.bump_generation()
        assert new_generation == 1
        assert first.engine.classify("text", "refund").tier == "miss"
        deadline = time.monotonic() + 1.0
        while second.engine.generation != new_generation and time.monotonic() < deadline:
            time.sleep(0.02)
        assert second.engine.generation == new_generation, "bump not seen within one second"
        result = second.engine.classify("text", "refund")
        assert result.generation == 1 and result.tier == "l2"  # first engine recomputed it
        assert second.engine.cache_state()["l1"]["entries"] <= 2  # old generation dropped from L1

    def test_local_generation_without_redis(self, make_runtime) -> None:
        runtime = make_runtime(redis__url="off")
        runtime.engine.classify("text", "hi")
        assert runtime.engine.bump_generation() == 1
        assert runtime.engine.classify("text", "hi").tier == "miss"


class TestFlush:
    def test_flush_by_tier_counts_and_scopes(self, make_runtime, redis_server) -> None:
        runtime = make_runtime(redis__url=redis_server.url)
        client = redis.Redis.from_url(redis_server.url)
        client.set("someone-else:key", b"keep me")
        for i in range(5):
            runtime.engine.classify("text", f"question {i}")
        l1 = runtime.engine.flush("l1")
        assert l1.l1_removed == 10 and l1.l2_removed is None  # 5 results + 5 aliases
        assert runtime.engine.classify("text", "question 0").tier == "l2"
        both = runtime.engine.flush("all")
        assert both.l2_removed == 5 and both.l2_error is None  # results only: text aliases stay in L1
        assert client.get("someone-else:key") == b"keep me"
        assert runtime.engine.classify("text", "question 0").tier == "miss"
        with pytest.raises(InvalidInputError):
            runtime.engine.flush("everything")
        client.close()


class TestProbe:
    def test_probe_answers_hits_and_refuses_misses(self, make_runtime) -> None:
        model = CountingTextModel()
        runtime = make_runtime(models={"text": model})
        with pytest.raises(ProbeMiss):
            runtime.engine.classify("text", "new question", probe=True)
        assert model.calls == 0
        runtime.engine.classify("text", "new question")
        assert runtime.engine.classify("text", "new question", probe=True).tier == "l1"


class TestRealModels:
    """Where the model matters: canonical images share entries, tiers agree byte for byte."""

    @staticmethod
    def encode(photo: bytes, fmt: str, **options: Any) -> bytes:
        buffer = io.BytesIO()
        Image.open(io.BytesIO(photo)).convert("RGB").save(buffer, format=fmt, **options)
        return buffer.getvalue()

    def test_png_bmp_webp_share_one_entry_and_tiers_agree(
        self, make_runtime, redis_server: EmbeddedRedis, real_models, photo_bytes
    ) -> None:
        first = make_runtime(models=real_models, redis__url=redis_server.url)
        second = make_runtime(models=real_models, redis__url=redis_server.url)
        photo = photo_bytes("coffee.png")
        png, bmp, webp = (self.encode(photo, "PNG"), self.encode(photo, "BMP"),
                          self.encode(photo, "WEBP", lossless=True))  # fmt: skip
        miss = first.engine.classify("image", png)
        by_bmp = first.engine.classify("image", bmp)
        by_webp = second.engine.classify("image", webp)
        again = first.engine.classify("image", png)
        assert [r.tier for r in (miss, by_bmp, by_webp, again)] == ["miss", "l1", "l2", "l1"]
        assert miss.key == by_bmp.key == by_webp.key == again.key
        assert miss.prediction == by_bmp.prediction == by_webp.prediction
        assert miss.prediction.top_label == "espresso"
        assert first.engine.counters().model_calls["image"] == 1

    def test_bad_upload_is_remembered_without_decoding_again(
        self, make_runtime, real_models, photo_bytes
    ) -> None:
        runtime = make_runtime(models=real_models)
        truncated = photo_bytes("chelsea.png")[:5000]
        for _ in range(3):
            with pytest.raises(InvalidInputError) as error:
                runtime.engine.classify("image", truncated)
        assert error.value.code in ("corrupt_image", "not_an_image")
        assert runtime.engine.counters().negative_hits == 2


def test_l1_stays_within_its_byte_budget_under_many_distinct_inputs(make_runtime) -> None:
    budget = 32 * 1024
    runtime = make_runtime(redis__url="off", cache__l1_max_bytes=budget)
    for i in range(3000):
        runtime.engine.classify("text", f"distinct question number {i}")
        if i % 100 == 0:
            assert runtime.engine.cache_state()["l1"]["bytes"] <= budget
    state = runtime.engine.cache_state()["l1"]
    assert state["bytes"] <= budget and state["evictions"] > 0
    assert state["entries"] < 3000 * 2  # results and aliases were evicted, not kept forever
    assert runtime.engine.classify("text", "distinct question number 2999").tier == "l1"


def test_an_l2_hit_through_the_raw_alias_does_not_decode_again(make_runtime, redis_server) -> None:
    model = CountingTextModel(cheap=False)
    decodes = []
    original = model.canonicalize
    model.canonicalize = lambda raw: decodes.append(raw) or original(raw)  # type: ignore[method-assign]
    runtime = make_runtime(models={"text": model}, redis__url=redis_server.url)
    runtime.engine.classify("text", "decode me once")
    runtime.engine.flush("l1")
    assert runtime.engine.classify("text", "decode me once").tier == "l2"  # alias and result from L2
    runtime.engine.flush("l1")
    assert len([k for k in all_keys(redis_server.url) if b":text-raw:" in k]) == 1
    assert runtime.engine.classify("text", "decode me once").tier == "l2"
    assert len(decodes) == 1


def test_cheap_inputs_keep_aliases_out_of_redis(make_runtime, redis_server) -> None:
    """Text canonicalizes in microseconds: a miss costs one Redis read and one write (no
    alias round trips), an L2 hit one read; the in-process alias and rejection remain."""
    model = CountingTextModel()
    runtime = make_runtime(models={"text": model}, redis__url=redis_server.url)
    client = redis.Redis.from_url(redis_server.url)

    def commands() -> int:  # INFO commandstats counts the INFO calls too: subtract them
        return sum(int(v["calls"]) for v in client.info("commandstats").values())

    try:
        before = commands()
        assert runtime.engine.classify("text", "Is my refund on its way?").tier == "miss"
        assert commands() - before - 1 == 2  # GET result, SET result
        runtime.engine.flush("l1")
        before = commands()
        assert runtime.engine.classify("text", "  Is my refund   on its way? ").tier == "l2"
        assert commands() - before - 1 == 1
        for _ in range(2):
            with pytest.raises(InvalidInputError):
                runtime.engine.classify("text", "  \t ")
        assert runtime.engine.counters().negative_hits == 1  # remembered in L1
        assert not [k for k in all_keys(redis_server.url) if b":text-raw:" in k]
        assert model.calls == 1
    finally:
        client.close()


def count_round_trips(store: Any, round_trips: list[str]) -> None:
    """Append to `round_trips` each round trip of the request path: a read (with the writes
    riding along) or a send of writes. Not store._call: the generation watcher goes through it
    too, every refresh, at moments no test controls."""
    for name in ("get_after_writes", "set_many"):
        method = getattr(store, name)
        setattr(store, name, lambda *args, _m=method, _n=name: round_trips.append(_n) or _m(*args))


def test_an_upload_miss_writes_result_and_alias_in_one_round_trip(make_runtime, redis_server) -> None:
    """Where aliases go to Redis (costly canonicalization, like an image): a miss costs three
    round trips (alias, result, both writes together), a hit on another replica two."""
    first, second, model, _ = engine_pair(make_runtime, redis_server.url, CountingTextModel(cheap=False))
    round_trips: list[str] = []
    for runtime in (first, second):
        store = runtime.engine.l2_store()
        assert store is not None
        count_round_trips(store, round_trips)

    assert first.engine.classify("text", "photo bytes, as uploaded").tier == "miss"
    assert len(round_trips) == 3
    keys = all_keys(redis_server.url)
    assert len([k for k in keys if b":text-raw:" in k]) == 1 and len([k for k in keys if b":text:" in k]) == 1
    round_trips.clear()
    assert second.engine.classify("text", "photo bytes, as uploaded").tier == "l2"
    assert len(round_trips) == 2  # the alias, then the result it names: no decode, no write
    second.engine.flush("l1")
    round_trips.clear()
    # The same canonical input in another raw form: its alias is written alone, on a hit.
    assert second.engine.classify("text", "  photo bytes,   as uploaded ").tier == "l2"
    assert len(round_trips) == 3
    assert len([k for k in all_keys(redis_server.url) if b":text-raw:" in k]) == 2
    assert model.calls == 1


class GatedTextModel(CountingTextModel):
    """Holds any message containing "hold" inside the model until `gate` is set, so a
    test can keep one request in flight while others run."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.holding = threading.Event()

    def predict_batch(self, inputs: Any) -> Any:
        if any("hold" in item.text for item in inputs):
            self.holding.set()
            assert self.gate.wait(10), "the test never released the held request"
        return super().predict_batch(inputs)


class HeldRequest:
    """One request kept in flight (inside the model) until `release()`."""

    def __init__(self, runtime: Runtime, model: GatedTextModel, text: str = "hold this one") -> None:
        self.model = model
        self.results: list[Any] = []
        self.thread = threading.Thread(
            target=lambda: self.results.append(runtime.engine.classify("text", text))
        )
        self.thread.start()
        assert model.holding.wait(10), "the held request never reached the model"

    def release(self) -> Any:
        self.model.gate.set()
        self.thread.join(10)
        assert not self.thread.is_alive() and len(self.results) == 1
        return self.results[0]


@pytest.fixture
def write_delay_s() -> float:
    """How long L2 writes may wait: longer than any test here, so that only what a test
    does sends them (the tests of the engine's write timer set the real delay)."""
    return 60.0


@pytest.fixture
def gated(make_runtime, redis_server, write_delay_s, monkeypatch):
    """(runtime, model, round trips list, key presence check, start a held request)."""
    monkeypatch.setattr("engine.cache.tiers.L2_WRITE_DELAY_S", write_delay_s)
    model = GatedTextModel()
    runtime = make_runtime(models={"text": model}, redis__url=redis_server.url)
    store = runtime.engine.l2_store()
    assert store is not None
    round_trips: list[str] = []
    count_round_trips(store, round_trips)
    client = redis.Redis.from_url(redis_server.url)
    held: list[HeldRequest] = []

    def in_redis(result: Any) -> bool:
        return bool(client.exists(result.key))

    def hold(text: str = "hold this one") -> HeldRequest:
        held.append(HeldRequest(runtime, model, text))
        return held[-1]

    yield runtime, model, round_trips, in_redis, hold
    model.gate.set()
    for request in held:
        request.thread.join(10)
    client.close()


class TestWritesShareRoundTrips:
    """While other requests are in flight, a miss's L2 write rides with another round trip."""

    def test_alone_a_miss_is_in_redis_when_it_returns(self, gated) -> None:
        runtime, _, round_trips, in_redis, _ = gated
        result = runtime.engine.classify("text", "Where is my parcel?")
        assert result.tier == "miss" and in_redis(result)
        assert len(round_trips) == 2  # GET, SET

    def test_under_concurrency_writes_ride_with_the_next_read_and_the_last_to_leave(self, gated) -> None:
        runtime, model, round_trips, in_redis, hold = gated
        held = hold()
        round_trips.clear()
        first = runtime.engine.classify("text", "Where is my parcel?")
        assert first.tier == "miss" and len(round_trips) == 1  # its read only: the write waits
        assert not in_redis(first)
        second = runtime.engine.classify("text", "Can I change my address?")
        assert second.tier == "miss" and len(round_trips) == 2  # one read, carrying first's write
        assert in_redis(first) and not in_redis(second)
        late = held.release()  # the last request to leave sends what waits, and its own
        assert in_redis(second) and in_redis(late)
        assert len(round_trips) == 3
        # What went to Redis is what was answered: a second replica reads the same answers.
        for result, text in ((first, "Where is my parcel?"), (second, "Can I change my address?")):
            runtime.engine.flush("l1")
            again = runtime.engine.classify("text", text)
            assert again.tier == "l2" and again.prediction == result.prediction
        assert model.calls == 3

    @pytest.mark.parametrize("write_delay_s", [L2_WRITE_DELAY_S])
    def test_an_overdue_write_goes_out_with_no_other_request(self, gated) -> None:
        runtime, _, round_trips, in_redis, hold = gated
        held = hold()
        round_trips.clear()
        started = time.monotonic()
        first = runtime.engine.classify("text", "Where is my parcel?")
        assert not in_redis(first) or time.monotonic() - started >= L2_WRITE_DELAY_S
        # No request comes by and the held one stays in its forward pass: the engine's
        # timer sends the write once it is L2_WRITE_DELAY_S old.
        deadline = time.monotonic() + 5
        while not in_redis(first):
            assert time.monotonic() < deadline, "the waiting write never reached Redis"
            time.sleep(0.01)
        assert time.monotonic() - started >= L2_WRITE_DELAY_S
        assert held.thread.is_alive() and len(round_trips) == 2  # first's read, the timer's write
        held.release()
        runtime.close()
        assert not runtime.engine._tiers._write_timer.running

    def test_an_l2_flush_drops_writes_that_were_waiting(self, gated) -> None:
        runtime, _, _, in_redis, hold = gated
        held = hold()
        first = runtime.engine.classify("text", "Where is my parcel?")
        assert runtime.engine.flush("l2").l2_removed == 0
        late = held.release()
        assert not in_redis(first)  # computed before the flush: never lands after it
        assert in_redis(late)  # computed after it: written as usual

    def test_closing_the_engine_sends_waiting_writes(self, gated) -> None:
        runtime, _, _, in_redis, hold = gated
        held = hold()
        first = runtime.engine.classify("text", "Where is my parcel?")
        assert not in_redis(first)
        runtime.engine.close()
        assert in_redis(first)
        held.release()

    def test_with_redis_down_waiting_writes_are_dropped_and_answers_go_on(self, gated, redis_server) -> None:
        runtime, model, _, _, hold = gated
        held = hold()
        first = runtime.engine.classify("text", "Where is my parcel?")
        redis_server.close()
        second = runtime.engine.classify("text", "Can I change my address?")
        late = held.release()
        assert [r.tier for r in (first, second, late)] == ["miss", "miss", "miss"]
        assert runtime.engine.counters().l2_errors >= 1
        assert runtime.engine.classify("text", "Where is my parcel?").prediction == first.prediction
        assert model.calls == 3


class BatchingTextModel(GatedTextModel):
    """The stand-in, opted in to micro-batching like the real text model; records its batches."""

    batch_misses = True

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []

    def predict_batch(self, inputs: Any) -> Any:
        self.batches.append([item.text for item in inputs])
        return super().predict_batch(inputs)


@pytest.fixture
def pool() -> Any:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


class TestMissesShareForwardPasses:
    """engine.capacity.batching in the engine: misses waiting for a busy model go in its next pass."""

    def test_waiting_misses_share_the_next_pass_and_each_is_cached(self, make_runtime, pool) -> None:
        model = BatchingTextModel()
        runtime = make_runtime(models={"text": model}, redis__url="off")
        held = HeldRequest(runtime, model)
        texts = ["Where is my parcel?", "I want a refund", "Reset my password"]
        futures = [pool.submit(runtime.engine.classify, "text", text) for text in texts]
        for _ in range(500):  # until all three wait for the held pass
            if len(runtime.engine._passes._batchers["text"]._waiting) == 3:
                break
            time.sleep(0.01)
        held.release()
        results = [future.result(10) for future in futures]
        assert [len(batch) for batch in model.batches] == [1, 3]
        reference = CountingTextModel()
        for text, result in zip(texts, results, strict=True):
            assert result.tier == "miss"
            assert result.prediction == reference.predict_batch([reference.canonicalize(text)])[0]
            assert runtime.engine.classify("text", text).tier == "l1"
        counters = runtime.engine.counters()
        assert counters.model_calls["text"] == 4 and counters.misses == 4

    def test_batch_max_size_one_turns_it_off(self, make_runtime, pool) -> None:
        model = BatchingTextModel()
        runtime = make_runtime(models={"text": model}, redis__url="off", models__batch_max_size=1)
        assert runtime.engine._passes._batchers == {}
        list(pool.map(lambda t: runtime.engine.classify("text", t), [f"message {k}" for k in range(12)]))
        assert all(len(batch) == 1 for batch in model.batches) and len(model.batches) == 12


@pytest.mark.parametrize("cheap", [True, False], ids=["text-like", "upload-like"])
def test_a_memory_answer_comes_only_from_l1_and_is_logged(make_runtime, redis_server, cheap) -> None:
    """`classify_from_memory` (the REST path's answer on the event loop): L1 hits only,
    logged as requests of their route; never Redis, the model or a decode."""
    model = CountingTextModel(cheap=cheap)
    records = []
    runtime = make_runtime(models={"text": model}, redis__url=redis_server.url)
    engine = runtime.engine
    engine.add_listener(records.append)
    assert engine.classify_from_memory("text", "new question", route="rest") is None  # a miss: no answer
    first = engine.classify("text", "new question")
    # Another spelling of a text is canonicalized (microseconds); an upload must be the same bytes.
    hit = engine.classify_from_memory("text", "  new   question " if cheap else "new question", route="rest")
    assert hit is not None and hit.tier == "l1" and hit.key == first.key
    assert hit.prediction == first.prediction and model.calls == 1
    assert [(r.route, r.tier) for r in records] == [("gradio", "miss"), ("rest", "l1")]

    engine.flush("l1")  # in Redis only now: left to classify, which may block on it
    canonicalize = model.canonicalize
    model.canonicalize = lambda raw: pytest.fail("decoded on the memory path")  # type: ignore[method-assign]
    if not cheap:
        assert engine.classify_from_memory("text", "new question", route="rest") is None
    model.canonicalize = canonicalize  # type: ignore[method-assign]
    assert engine.classify_from_memory("text", "new question", route="rest") is None
    assert engine.classify("text", "new question").tier == "l2"
    assert engine.classify_from_memory("text", "", route="rest") is None  # bad input: classify's to refuse
    assert engine.classify_from_memory("nope", "x", route="rest") is None
    assert model.calls == 1 and len(records) == 3


def test_a_memory_answer_hands_its_bookkeeping_to_defer(make_runtime) -> None:
    """With `defer` (the REST door passes its event loop's call_soon), a memory hit's count,
    key observation and request record wait until the deferred work runs, then happen
    exactly once, as without it; nothing is deferred for a miss."""
    records, observed, deferred = [], [], []
    runtime = make_runtime(models={"text": CountingTextModel()}, redis__url="off")
    engine = runtime.engine
    engine.add_listener(records.append)
    engine.observe_keys(lambda task, key, value, tier: observed.append((key, tier)))

    def defer(function, *args) -> None:
        deferred.append((function, args))

    assert engine.classify_from_memory("text", "deferred question", route="rest", defer=defer) is None
    assert deferred == []
    first = engine.classify("text", "deferred question")
    hits_before, records_before, observed_before = engine.counters().hits_l1, len(records), len(observed)
    hit = engine.classify_from_memory("text", "deferred question", route="rest", defer=defer)
    assert hit is not None and hit.tier == "l1" and hit.key == first.key
    assert (engine.counters().hits_l1, len(records), len(observed)) == (hits_before, records_before,
                                                                         observed_before)  # fmt: skip
    assert deferred, "nothing was deferred"
    for function, args in deferred:
        function(*args)
    assert engine.counters().hits_l1 == hits_before + 1
    assert [(r.route, r.tier) for r in records[records_before:]] == [("rest", "l1")]
    assert observed[observed_before:] == [(first.key, "l1")]
