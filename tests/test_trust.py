"""Trust in one cached answer: inspect and evict over the admin API, and shadow verification
catching a well-formed wrong answer (valid signature) on a real Redis."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from admin.trust.service import mismatch_rows, shadow_summary
from engine.cache.codec import CachedResult, ValueCodec
from engine.models.base import Prediction
from engine.quality.shadow import ShadowVerifier, agree
from runtime import Runtime
from storage.redis.embedded import EmbeddedRedis
from tests.conftest import CountingTextModel

TOKEN = "trust-tests-operator-token"
K1 = "k1-" + "s" * 40
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _admin(url: str, path: str, body: Any, headers: dict[str, str] | None = AUTH) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers or {}, timeout=30.0)


# ---- inspect and evict --------------------------------------------------------


def test_inspect_shows_one_entry_and_evict_removes_it_from_both_tiers_with_an_audit_row(
    serve: Callable[..., tuple[str, Runtime]],
    make_runtime: Callable[..., Runtime],
    redis_server: EmbeddedRedis,
) -> None:
    url, runtime = serve(redis__url=redis_server.url, server__admin_token=TOKEN, cache__signing_keys=(K1,))
    engine = runtime.engine
    first = engine.classify("text", "  Where is my PARCEL? ")
    # Another replica on the same Redis, holding the answer in its own L1.
    other = make_runtime(redis__url=redis_server.url, cache__signing_keys=(K1,)).engine
    assert other.classify("text", "Where is my PARCEL?").tier == "l2"
    assert other.classify("text", "Where is my PARCEL?").tier == "l1"
    body = {"task": "text", "input": "Where is my PARCEL?"}  # the same canonical text

    refused = _admin(url, "/admin/api/inspect", body, headers=None)
    assert refused.status_code == 401
    refused = _admin(url, "/admin/api/evict", body, headers={"Authorization": "Bearer wrong-token"})
    assert refused.status_code == 401
    assert engine.classify("text", "Where is my PARCEL?").tier == "l1"  # nothing changed

    seen = _admin(url, "/admin/api/inspect", body)
    assert seen.status_code == 200, seen.text
    report = seen.json()
    assert report["key"] == first.key
    assert report["in_l1"] is True and report["l2"] == "valid"
    assert 0 < report["l2_ttl_s"] <= runtime.settings.cache.ttl_s
    assert 0 <= report["age_s"] < 60
    assert report["answer"] == first.prediction.to_plain()
    assert report["answer_model_version"] == report["model_version"] == first.model_version
    assert report["generation"] == first.generation

    gone = _admin(url, "/admin/api/evict", body)
    assert gone.status_code == 200, gone.text
    evicted = gone.json()
    assert {k: evicted[k] for k in ("key", "l1_removed", "l2_removed", "l2_error")} == {
        "key": first.key,
        "l1_removed": True,
        "l2_removed": True,
        "l2_error": None,
    }
    assert evicted["fleet"]["complete"] is True  # every live replica confirmed
    direct = redis.Redis.from_url(redis_server.url)
    try:
        assert direct.exists(first.key) == 0
    finally:
        direct.close()
    after = _admin(url, "/admin/api/inspect", body).json()
    assert (after["in_l1"], after["l2"], after["answer"]) == (False, "absent", None)
    audit = runtime.admin.audit_rows()
    assert audit[0]["action"] == "evict" and first.key in audit[0]["params"]
    assert engine.classify("text", "Where is my PARCEL?").tier == "miss"
    assert other.classify("text", "Where is my PARCEL?").tier != "l1"  # its L1 copy went too


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({}, 400, "task"),
        ({"task": "text"}, 400, "exactly one"),
        ({"task": "text", "input": "a", "input_base64": "YQ=="}, 400, "exactly one"),
        ({"task": "text", "input": 42}, 400, "must be a string"),
        ({"task": "text", "input_base64": "not base64!"}, 400, "not valid base64"),
        ({"task": "speech", "input": "hello"}, 404, "Unknown task"),
        ({"task": "text", "input": "   "}, 400, "empty"),
    ],
)
def test_bad_entry_bodies_get_a_clear_error_and_change_nothing(
    serve: Callable[..., tuple[str, Runtime]], body: dict[str, Any], status: int, words: str
) -> None:
    url, runtime = serve(server__admin_token=TOKEN)
    for path in ("/admin/api/inspect", "/admin/api/evict"):
        response = _admin(url, path, body)
        assert response.status_code == status, response.text
        assert words.lower() in response.json()["error"].lower()
    assert runtime.admin.audit_rows() == []


def test_an_uploaded_image_is_inspected_by_its_decoded_pixels(
    serve: Callable[..., tuple[str, Runtime]],
    real_models: dict[str, Any],
    photo_bytes: Callable[[str], bytes],
) -> None:
    url, runtime = serve(models={"image": real_models["image"]}, server__admin_token=TOKEN)
    png = photo_bytes("chelsea.png")
    first = runtime.engine.classify("image", png)
    report = _admin(
        url, "/admin/api/inspect", {"task": "image", "input_base64": base64.b64encode(png).decode()}
    )
    assert report.status_code == 200, report.text
    assert report.json()["key"] == first.key and report.json()["answer"][0][0] == "tabby"
    junk = _admin(
        url, "/admin/api/inspect", {"task": "image", "input_base64": base64.b64encode(b"junk").decode()}
    )
    assert junk.status_code == 400 and "image" in junk.json()["error"].lower()


# ---- shadow verification --------------------------------------------------------


def test_a_planted_wrong_answer_with_a_valid_signature_is_detected_and_evicted(
    make_runtime: Callable[..., Runtime], redis_server: EmbeddedRedis
) -> None:
    runtime = make_runtime(
        redis__url=redis_server.url, cache__signing_keys=(K1,), quality__shadow_sample_rate=1.0,
    )
    engine, shadow = runtime.engine, runtime.engine.shadow
    assert shadow is not None
    right = engine.classify("text", "cancel my order")
    wrong = CachedResult(Prediction((("beta", 0.9), ("alpha", 0.1))), right.model_version, time.time())
    direct = redis.Redis.from_url(redis_server.url)
    try:
        # Someone holding the signing key (or a canonicalisation bug) stores another answer.
        direct.set(right.key, ValueCodec([K1.encode()]).encode(wrong, key=right.key), ex=600)
        engine.flush("l1")
        served = engine.classify("text", "cancel my order")
        assert served.tier == "l2" and served.prediction == wrong.prediction  # signature is valid
        assert shadow.wait_processed(1, timeout_s=10)
        stats = shadow.stats()
        assert stats.checks == {"text": 1} and stats.mismatches == {"text": 1}
        mismatch = stats.recent[0]
        assert mismatch.key == right.key and mismatch.evicted
        assert (
            mismatch.cached == wrong.prediction.to_plain() and mismatch.fresh == right.prediction.to_plain()
        )
        assert mismatch.cached_version == mismatch.fresh_version == right.model_version
        assert direct.exists(right.key) == 0  # evicted from L2 ...
        again = engine.classify("text", "cancel my order")
        assert again.tier == "miss" and again.prediction == right.prediction  # ... and from L1
        # The right answer, sampled in turn, passes.
        assert engine.classify("text", "cancel my order").tier == "l1"
        assert shadow.wait_processed(2, timeout_s=10)
        assert shadow.stats().checks == {"text": 2} and shadow.stats().mismatches == {"text": 1}
        metrics = runtime.metrics.render().decode()
        assert 'infcache_shadow_mismatches_total{task="text"} 1.0' in metrics
        assert 'infcache_shadow_checks_total{task="text"} 2.0' in metrics
        assert "1 mismatches in 2 checks (50.00%)" in shadow_summary(runtime.admin.shadow_report())
        assert mismatch_rows(runtime.admin.shadow_report())[0][2] == right.key  # the console's table
    finally:
        direct.close()


def test_shadow_checks_wait_until_the_model_is_idle() -> None:
    model = CountingTextModel()
    busy = threading.Event()
    busy.set()
    evicted: list[str] = []
    verifier = ShadowVerifier(rate=1.0, model_for=lambda task: model, evict=evicted.append,
                              idle=lambda: not busy.is_set())  # fmt: skip
    verifier.start()
    try:
        key = f"infcache:text:{model.version}:0:abc"
        canonical = model.canonicalize("hello")
        cached = CachedResult(model.predict_batch([canonical])[0], model.version, 0.0)
        calls = model.calls
        verifier.offer("text", key, cached, "hello", canonical)
        assert not verifier.wait_processed(1, timeout_s=0.3)
        assert model.calls == calls  # nothing ran while a request was inside
        busy.clear()
        assert verifier.wait_processed(1, timeout_s=5)
        assert model.calls == calls + 1 and verifier.stats().checks == {"text": 1} and not evicted
    finally:
        verifier.close()


def test_shadow_checks_each_entry_once_not_each_hit() -> None:
    model = CountingTextModel()
    evicted: list[str] = []
    verifier = ShadowVerifier(rate=1.0, model_for=lambda task: model, evict=evicted.append, idle=lambda: True)
    verifier.start()
    try:
        key = f"infcache:text:{model.version}:0:abc"
        canonical = model.canonicalize("hello")
        right = model.predict_batch([canonical])[0]
        for _ in range(20):  # a hot key: every hit drawn, its entry checked once
            verifier.offer("text", key, CachedResult(right, model.version, 0.0), "hello", canonical)
        assert verifier.wait_processed(1, timeout_s=5)
        assert not verifier.wait_processed(2, timeout_s=0.2)
        assert verifier.stats().checks == {"text": 1}
        # Another answer under the same key (planted, or recomputed) is another entry: checked.
        wrong = Prediction((("beta", 0.9), ("alpha", 0.1)))
        for _ in range(3):
            verifier.offer("text", key, CachedResult(wrong, model.version, 1.0), "hello", canonical)
        assert verifier.wait_processed(2, timeout_s=5) and evicted == [key]
        # Found out, it is forgotten: the same answer planted again is checked again.
        verifier.offer("text", key, CachedResult(wrong, model.version, 2.0), "hello", canonical)
        assert verifier.wait_processed(3, timeout_s=5) and evicted == [key, key]
        assert verifier.stats().checks == {"text": 3} and verifier.stats().mismatches == {"text": 2}
        # Another version or generation names another key: checked anew.
        newer = f"infcache:text:{model.version}:1:abc"
        verifier.offer("text", newer, CachedResult(right, model.version, 0.0), "hello", canonical)
        assert verifier.wait_processed(4, timeout_s=5) and verifier.stats().checks == {"text": 4}
    finally:
        verifier.close()


def test_shadow_sampling_is_off_at_rate_zero(make_runtime: Callable[..., Runtime]) -> None:
    runtime = make_runtime(quality__shadow_sample_rate=0.0)
    assert runtime.engine.shadow is None
    assert b"infcache_shadow_checks" not in runtime.metrics.render()


def test_answers_agree_within_the_tolerance_only() -> None:
    a = Prediction((("x", 0.5), ("y", 0.3), ("z", 0.2)))
    assert agree(a, Prediction((("x", 0.5 + 5e-6), ("y", 0.3), ("z", 0.2))))
    assert not agree(a, Prediction((("x", 0.5 + 5e-5), ("y", 0.3), ("z", 0.2))))
    assert not agree(a, Prediction((("y", 0.5), ("x", 0.3), ("z", 0.2))))  # labels swapped
    tie = Prediction((("x", 0.4), ("y", 0.4 - 1e-7), ("z", 0.2)))
    assert agree(tie, Prediction((("y", 0.4 - 1e-7), ("x", 0.4), ("z", 0.2))))  # order of a near tie
    # A class only one answer lists must sit below the other's last one.
    assert agree(a, Prediction((("x", 0.5), ("y", 0.3), ("w", 0.2 - 2e-6))))
    assert not agree(a, Prediction((("x", 0.5), ("y", 0.3), ("w", 0.25))))
