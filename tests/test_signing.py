"""Signed L2 values (CACHE_SIGNING_KEY(S)): the codec, the settings, and two engines on a
real Redis that refuse, delete, count and recompute what their keys did not sign."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from engine.cache.codec import (
    CHECKSUM_CODEC,
    CachedAlias,
    CachedResult,
    ForgedValue,
    UndecodableValue,
    ValueCodec,
)
from engine.models.base import Prediction
from runtime import Runtime
from settings import Settings, SettingsError
from storage.redis.embedded import EmbeddedRedis

K1 = b"k1-" + b"a" * 40
K2 = b"k2-" + b"b" * 40
KEY = "infcache:text:v1:0:" + "ab" * 16
RESULT = CachedResult(Prediction((("alpha", 0.75), ("beta", 0.25))), "v1", 1700000000.0)


def test_a_signed_value_round_trips_and_verifies_with_the_old_key_after_rotation() -> None:
    old, rotated = ValueCodec([K1]), ValueCodec([K2, K1])
    blob = old.encode(RESULT, key=KEY)
    assert old.decode(blob, key=KEY) == RESULT
    assert rotated.decode(blob, key=KEY) == RESULT  # new,old: values of the old key still verify
    fresh = rotated.encode(RESULT, key=KEY)
    assert fresh != blob  # signed with the new key
    with pytest.raises(ForgedValue):
        old.decode(fresh, key=KEY)  # a replica that only knows the old key refuses it
    with pytest.raises(ForgedValue):
        ValueCodec([K2]).decode(blob, key=KEY)  # once the old key is retired its values go


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda blob: CHECKSUM_CODEC.encode(RESULT, key=KEY), id="unsigned"),
        pytest.param(lambda blob: ValueCodec([K2]).encode(RESULT, key=KEY), id="other-secret"),
        pytest.param(lambda blob: blob[:-1] + bytes([blob[-1] ^ 1]), id="tag-bit"),
        pytest.param(lambda blob: bytes([blob[0] ^ 4]) + blob[1:], id="payload-bit"),
        pytest.param(lambda blob: blob[:10], id="truncated"),
        pytest.param(lambda blob: b"", id="empty"),
        pytest.param(lambda blob: ValueCodec([K1]).encode(RESULT, key=KEY + "0"), id="moved"),
    ],
)
def test_a_value_the_key_did_not_sign_is_refused_as_forged(tamper: Callable[[bytes], bytes]) -> None:
    codec = ValueCodec([K1])
    with pytest.raises(ForgedValue):
        codec.decode(tamper(codec.encode(RESULT, key=KEY)), key=KEY)


def test_an_unsigned_value_is_named_as_such_and_a_signed_one_is_damage_to_an_unsigned_cache() -> None:
    with pytest.raises(ForgedValue, match="missing"):
        ValueCodec([K1]).decode(CHECKSUM_CODEC.encode(CachedAlias("ab12"), key=KEY), key=KEY)
    with pytest.raises(UndecodableValue) as caught:
        CHECKSUM_CODEC.decode(ValueCodec([K1]).encode(RESULT, key=KEY), key=KEY)
    assert not isinstance(caught.value, ForgedValue)


def test_signing_keys_shorter_than_32_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        ValueCodec([b"x" * 31])


def test_settings_read_one_key_or_a_rotation_list_and_never_show_them() -> None:
    one = Settings.from_env({"CACHE_SIGNING_KEY": K1.decode()})
    assert one.cache.signing_keys == (K1.decode(),)
    both = Settings.from_env({"CACHE_SIGNING_KEYS": f"{K2.decode()}, {K1.decode()}"})
    assert both.cache.signing_keys == (K2.decode(), K1.decode())
    assert K1.decode() not in repr(both) and K2.decode() not in repr(both)
    assert Settings.from_env({}).cache.signing_keys == ()
    with pytest.raises(SettingsError, match="at least 32 bytes") as short:
        Settings.from_env({"CACHE_SIGNING_KEYS": f"{K1.decode()},tooshort"})
    assert "tooshort" not in str(short.value)  # a secret never goes into a message
    with pytest.raises(SettingsError, match="not both"):
        Settings.from_env({"CACHE_SIGNING_KEY": K1.decode(), "CACHE_SIGNING_KEYS": K1.decode()})


def test_shadow_sample_rate_defaults_to_one_percent_and_must_be_a_share() -> None:
    assert Settings.from_env({}).quality.shadow_sample_rate == 0.01
    assert Settings.from_env({"SHADOW_SAMPLE_RATE": "0"}).quality.shadow_sample_rate == 0.0
    with pytest.raises(SettingsError, match="between 0 and 1"):
        Settings.from_env({"SHADOW_SAMPLE_RATE": "1.5"})


# ---- engines on a real Redis -------------------------------------------------


def _signed(make_runtime: Callable[..., Runtime], server: EmbeddedRedis, *keys: bytes, **kw: Any) -> Runtime:
    return make_runtime(redis__url=server.url, cache__signing_keys=tuple(k.decode() for k in keys), **kw)


def test_a_forged_value_is_refused_deleted_counted_and_recomputed(
    make_runtime: Callable[..., Runtime], redis_server: EmbeddedRedis
) -> None:
    runtime = _signed(make_runtime, redis_server, K1)
    engine = runtime.engine
    first = engine.classify("text", "where is my parcel")
    assert first.tier == "miss"
    wrong = CachedResult(Prediction((("beta", 0.99), ("alpha", 0.01))), first.model_version, 1.0)
    direct = redis.Redis.from_url(redis_server.url)
    try:
        # Whoever can write to Redis can compute the checksum, but not the signature.
        direct.set(first.key, CHECKSUM_CODEC.encode(wrong, key=first.key), ex=600)
        engine.flush("l1")
        again = engine.classify("text", "where is my parcel")
        assert again.tier == "miss" and again.prediction == first.prediction
        assert engine.counters().forged_values == 1
        assert engine.counters().corrupt_values == 0
        # Deleted, then rewritten with the recomputed, signed answer.
        stored = direct.get(first.key)
        assert stored is not None
        assert ValueCodec([K1]).decode(stored, key=first.key).prediction == first.prediction  # type: ignore[union-attr]
        assert b"infcache_l2_forged_values_total 1.0" in runtime.metrics.render()
    finally:
        direct.close()


def test_replicas_with_different_keys_never_serve_each_others_values(
    make_runtime: Callable[..., Runtime], redis_server: EmbeddedRedis
) -> None:
    writer = _signed(make_runtime, redis_server, K1).engine
    reader = _signed(make_runtime, redis_server, K2).engine
    rotated = _signed(make_runtime, redis_server, K2, K1).engine
    assert writer.classify("text", "refund please").tier == "miss"
    # The rotated replica (new,old) reads the old key's value from L2.
    assert rotated.classify("text", "refund please").tier == "l2"
    # A replica with another key refuses it, deletes it and computes its own.
    assert reader.classify("text", "refund please").tier == "miss"
    assert reader.counters().forged_values == 1
    # ...which the first replica, in turn, refuses (after its L1 copy is gone).
    writer.flush("l1")
    assert writer.classify("text", "refund please").tier == "miss"
    assert writer.counters().forged_values == 1


@pytest.mark.parametrize("reply", [7, [b"a", b"b"], "text", None])
@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "signed"])
def test_a_reply_that_is_not_bytes_is_refused_as_undecodable(reply: object, signed: bool) -> None:
    """A connection that read another command's reply hands the decoder an int or a list."""
    codec = ValueCodec([b"k" * 32]) if signed else ValueCodec()
    with pytest.raises(UndecodableValue, match="not bytes"):
        codec.decode(reply, key="infcache:text:v:0:abc")  # type: ignore[arg-type]
