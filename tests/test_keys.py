"""Cache keys cannot be made to collide: pairs of inputs built to share an xxh3-128 digest
(the hash keys used before, see bench/collisions.py) get different keys, and the second of a
pair is computed, never served the first one's answer, in memory, in Redis or over HTTP."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import xxhash

from bench.collisions import bmp_upload_pair, pixel_pair, png_pair, text_pair
from engine.cache.keys import DIGEST_PATTERN, KEY_SCHEME, digest_parts, raw_digest
from engine.inputs import CanonicalImage, canonicalize_image
from runtime import Runtime
from storage.redis.embedded import EmbeddedRedis

PAIRS = {
    "text (raw alias)": lambda: text_pair(),
    "png (canonical pixels)": lambda: png_pair(seed=3),
    "bmp (raw upload alias)": lambda: bmp_upload_pair(seed=4),
}


def _old_raw_digest(raw: str | bytes) -> bytes:
    """What the raw alias key hashed before: the tag, then the input, through xxh3-128."""
    data = b"str:" + raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else b"bytes:" + raw
    return xxhash.xxh3_128_digest(data)


def test_the_pairs_really_collided_under_the_old_hash() -> None:
    """The attack is real: without this the tests below would prove nothing."""
    for name, build in PAIRS.items():
        a, b = build()
        assert a != b, name
        if "canonical" not in name:
            assert _old_raw_digest(a) == _old_raw_digest(b), name
    pixels_a, pixels_b = pixel_pair(seed=5)
    assert np.count_nonzero(pixels_a != pixels_b) > pixels_a.size // 5  # a different picture
    streams = [b"".join(CanonicalImage(p).fingerprint_parts()) for p in (pixels_a, pixels_b)]
    old = {xxhash.xxh3_128_digest(stream) for stream in streams}
    assert len(old) == 1


def test_the_pairs_get_different_digests_now() -> None:
    for name, build in PAIRS.items():
        a, b = build()
        assert raw_digest(a) != raw_digest(b), name
    for seed in range(3):
        pixels = pixel_pair(seed=seed)
        digests = {digest_parts(CanonicalImage(p).fingerprint_parts()) for p in pixels}
        assert len(digests) == 2 and all(DIGEST_PATTERN.match(d) for d in digests)
    pngs = png_pair(seed=6)
    decoded = [canonicalize_image(data, max_bytes=10**6, max_pixels=10**6) for data in pngs]
    assert len({digest_parts(c.fingerprint_parts()) for c in decoded}) == 2


def test_digest_is_tagged_and_128_bits() -> None:
    digest = digest_parts([b"text:", b"hello"])
    assert digest.startswith(KEY_SCHEME) and len(digest) == len(KEY_SCHEME) + 32
    assert digest != digest_parts([b"text:", b"hellp"])
    # The parts are hashed as one stream: the same bytes cut differently are the same input.
    assert digest_parts([b"text:he", b"llo"]) == digest


@pytest.fixture
def shared_redis_runtimes(
    make_runtime: Callable[..., Runtime], real_models: dict[str, Any], redis_server: EmbeddedRedis
) -> tuple[Runtime, Runtime]:
    """Two replicas with the real models and one real Redis."""
    return tuple(make_runtime(models=real_models, redis__url=redis_server.url) for _ in range(2))


@pytest.mark.redis
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_a_planted_pair_is_computed_not_served(
    pair: str,
    shared_redis_runtimes: tuple[Runtime, Runtime],
    redis_server: EmbeddedRedis,
    real_models: dict[str, Any],
) -> None:
    first, second = shared_redis_runtimes
    a, b = PAIRS[pair]()
    task = "text" if isinstance(a, str) else "image"
    planted = first.engine.classify(task, a)
    assert planted.tier == "miss"
    redis_client = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 10
    while not redis_client.exists(planted.key):  # the planted entry reaches Redis (written late)
        assert time.monotonic() < deadline, "the first answer never reached Redis"
        time.sleep(0.05)
    assert second.engine.classify(task, a).tier == "l2"  # the replicas do share entries
    # Another replica (through Redis), then the planting one (its L1 and raw aliases): B gets
    # its own key and its own answer; the first to see B computes it.
    model = real_models[task]
    own = model.predict_batch([model.canonicalize(b)])[0]
    for runtime, tiers in ((second, {"miss"}), (first, {"miss", "l2"})):
        served = runtime.engine.classify(task, b)
        assert served.key != planted.key, pair
        assert served.tier in tiers, f"{pair}: {served.tier}"
        assert [label for label, _ in served.prediction.labels] == [label for label, _ in own.labels]
        assert np.allclose([p for _, p in served.prediction.labels], [p for _, p in own.labels], atol=1e-5)


@pytest.mark.redis
def test_planted_text_pair_over_http(
    serve: Callable[..., tuple[str, Runtime]], real_models: dict[str, Any]
) -> None:
    url, _ = serve(models=real_models)
    a, b = text_pair(filler="hello, i would like to pay my bill ")

    def infer(message: str) -> dict[str, Any]:
        body = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES",
                            "data": [base64.b64encode(message.encode()).decode()],
                            "parameters": {"content_type": "base64"}}]}  # fmt: skip
        response = httpx.post(f"{url}/v2/models/text/infer", json=body, timeout=60)
        assert response.status_code == 200, response.text
        (info,) = json.loads(response.json()["parameters"]["cache_info"])
        return info

    first, second = infer(a), infer(b)
    assert (first["tier"], second["tier"]) == ("miss", "miss") and first["key"] != second["key"]
    assert infer(b)["tier"] == "l1"  # and B is cached under its own key
