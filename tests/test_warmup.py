"""Warm-up (engine.lifecycle.warmup, WARM_SET_SIZE): the inputs of the hottest keys kept in Redis (at
most N, with a TTL, never in the request log) and recomputed in the background after a
generation bump or a live model swap, so that the next request for them is a hit."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from PIL import Image
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from admin.models.warmup_tab import warmup_text
from engine.cache.keys import DIGEST_PATTERN, digest_parts
from engine.inputs import CanonicalImage, canonicalize_image
from engine.lifecycle.warmup import WarmSet
from runtime import Runtime, build_runtime
from settings import Settings
from storage.redis.embedded import EmbeddedRedis
from storage.sql import RequestRow
from tests.conftest import CountingTextModel

pytestmark = pytest.mark.redis
TOKEN = "warmup-operator-token"
# Hits per message: the three hottest are m0, m1, m2; m3 and m4 come first, so they are the
# ones held before anything is known to be hot.
TRAFFIC = [("m3", 1), ("m4", 1), ("m0", 6), ("m1", 5), ("m2", 4)]


def send_traffic(runtime: Runtime) -> int:
    sent = 0
    for text, hits in TRAFFIC:
        for _ in range(hits):
            runtime.engine.classify("text", f"message {text}")
            sent += 1
    return sent


def logged_requests(runtime: Runtime) -> int:
    runtime.log_writer.flush()
    with Session(runtime.admin._db) as session:
        return int(session.scalar(select(func.count()).select_from(RequestRow)) or 0)


def wait_warmed(runtime: Runtime, runs: int, timeout_s: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        progress = runtime.admin.warmup_progress()
        if progress["runs"] >= runs and not progress["running"]:
            return progress
        time.sleep(0.02)
    raise AssertionError(f"warm-up not finished: {runtime.admin.warmup_progress()}")


def kept_texts(warm_set: WarmSet) -> set[str]:
    return {value[1:].decode() for value in warm_set.stored("text").values()}


def test_hot_inputs_kept_bounded_and_recomputed_after_a_bump(
    make_runtime: Callable[..., Runtime], redis_server: EmbeddedRedis
) -> None:
    model = CountingTextModel("v1")
    runtime = make_runtime(models={"text": model}, redis__url=redis_server.url, warmup__size=3,
                           warmup__ttl_s=600)  # fmt: skip
    warm_set = runtime.warm_set
    assert warm_set is not None
    users = send_traffic(runtime)
    warm_set.flush()
    # m3 and m4 were held first but are not hot; m0 was held and is: kept at once.
    assert kept_texts(warm_set) == {"message m0"}
    users += send_traffic(runtime)  # now m1 and m2 are known to be hot: held on their next hit
    warm_set.flush()
    assert kept_texts(warm_set) == {"message m0", "message m1", "message m2"}  # at most N: the top 3

    client = redis.Redis.from_url(redis_server.url)
    try:
        ttl = client.ttl(warm_set.inputs_key("text"))
        assert 0 < ttl <= 600
        hits_keys = list(client.scan_iter(match="*:meta:warm:*:hits:*"))
        assert hits_keys and all(0 < client.ttl(k) <= 2 * 3600 for k in hits_keys)
        members = [m.decode() for m in client.zrange(hits_keys[0], 0, -1)]
        assert len(members) == 5 and all(DIGEST_PATTERN.match(m) for m in members)  # by digest, not by text
    finally:
        client.close()

    calls_before = model.calls
    assert logged_requests(runtime) == users
    runtime.engine.bump_generation()
    progress = wait_warmed(runtime, runs=1)
    assert progress["total"] == 3 and progress["done"] == 3 and progress["failed"] == 0
    assert progress["computed"] == 3 and progress["tasks"] == ["text"]
    assert model.calls == calls_before + 3  # the warm-up ran the model for each kept input
    assert logged_requests(runtime) == users  # ... and wrote nothing to the request log

    for text in ("m0", "m1", "m2"):  # the next user request for each is a cache hit
        assert runtime.engine.classify("text", f"message {text}").tier in ("l1", "l2")
    assert model.calls == calls_before + 3
    assert runtime.engine.classify("text", "message m3").tier == "miss"  # not kept: not warmed


def test_a_reload_warms_the_new_version(base_settings: Settings, tmp_path: Path,
                                        redis_server: EmbeddedRedis) -> None:  # fmt: skip
    new = CountingTextModel("v2")
    settings = base_settings.changed(
        server__data_dir=tmp_path / "rt", redis__url=redis_server.url, warmup__size=3,
    )
    with build_runtime(
        settings, models={"text": CountingTextModel("v1")}, model_loader=lambda _task: new
    ) as rt:
        assert rt.warm_set is not None
        send_traffic(rt)
        rt.warm_set.flush()
        send_traffic(rt)
        rt.warm_set.flush()
        result = rt.admin.reload_model("text", actor="test", note="v2")
        assert result["version"] == "v2"
        progress = wait_warmed(rt, runs=1)
        assert (progress["total"], progress["computed"], progress["failed"]) == (3, 3, 0)
        assert new.calls == 3
        answer = rt.engine.classify("text", "message m1")
        assert answer.tier in ("l1", "l2") and answer.model_version == "v2"
        assert new.calls == 3


def test_warm_set_size_zero_keeps_nothing(make_runtime: Callable[..., Runtime],
                                          redis_server: EmbeddedRedis) -> None:  # fmt: skip
    runtime = make_runtime(redis__url=redis_server.url)
    assert runtime.settings.warmup.size == 0 and runtime.warm_set is None
    send_traffic(runtime)
    runtime.engine.bump_generation()
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert list(client.scan_iter(match="*warm*")) == []
    finally:
        client.close()
    assert runtime.admin.warmup_progress() == {"enabled": False, "running": False}


def test_window_counts_and_the_api(
    serve: Callable[..., tuple[str, Runtime]], redis_server: EmbeddedRedis
) -> None:
    """The top N adds this window's hits to the last one's; older windows no longer count."""
    url, runtime = serve(redis__url=redis_server.url, warmup__size=1, server__admin_token=TOKEN)
    now = [10_000.0]
    store = runtime.engine.l2_store()
    assert store is not None
    warm = WarmSet(store, prefix="w", size=1, ttl_s=60, engine=runtime.engine, window_s=100,
                   clock=lambda: now[0])  # fmt: skip
    key = "w:text:v:0:{}"
    for _ in range(3):
        warm.note("text", key.format("a" * 32), "old favourite")
    warm.flush()
    assert kept_texts(warm) == {"old favourite"}
    now[0] += 100  # next window: a's 3 hits still count (this window and the last)
    for _ in range(2):
        warm.note("text", key.format("b" * 32), "newcomer")
    warm.flush()
    assert kept_texts(warm) == {"old favourite"}
    now[0] += 100  # a's window is two windows back now: b leads
    warm.note("text", key.format("b" * 32), "newcomer")
    warm.flush()
    assert kept_texts(warm) == {"newcomer"}
    warm.close()

    assert httpx.get(f"{url}/admin/api/warmup").status_code == 401
    body = httpx.get(f"{url}/admin/api/warmup", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert body["enabled"] is True and body["size"] == 1 and body["running"] is False


class ImageStandIn:
    """Canonicalises like every image model (engine.inputs); the model is not the subject."""

    task = "image"
    kind = "image-classification"

    def canonicalize(self, raw: Any) -> CanonicalImage:
        return canonicalize_image(raw, max_bytes=10_000_000, max_pixels=10_000_000)


def test_an_image_is_kept_as_its_canonical_pixels_without_metadata(
    photo_bytes: Callable[[str], bytes],
) -> None:
    picture = Image.open(io.BytesIO(photo_bytes("chelsea.png"))).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotated; canonicalisation turns it upright
    exif[0x010F] = "PhoneMaker"  # metadata that must not be kept
    upload = io.BytesIO()
    picture.save(upload, format="JPEG", exif=exif, quality=90)
    model = ImageStandIn()
    canonical = model.canonicalize(upload.getvalue())

    kept = WarmSet._stored_form(model, upload.getvalue())  # type: ignore[arg-type]
    assert kept is not None
    replay = WarmSet._replayed(kept)
    again = model.canonicalize(replay)
    assert again == canonical  # same pixels: the same cache key for every model
    assert digest_parts(again.fingerprint_parts()) == digest_parts(canonical.fingerprint_parts())
    assert not Image.open(io.BytesIO(replay)).getexif()  # no EXIF kept
    assert WarmSet._stored_form(model, b"not an image") is None  # a refused input is not kept


def test_the_warm_up_waits_for_live_requests(
    make_runtime: Callable[..., Runtime], redis_server: EmbeddedRedis
) -> None:
    model = CountingTextModel("v1")
    runtime = make_runtime(models={"text": model}, redis__url=redis_server.url, warmup__size=2)
    warm_set = runtime.warm_set
    assert warm_set is not None
    for _ in range(2):
        runtime.engine.classify("text", "hot one")
        runtime.engine.classify("text", "hot two")
    warm_set.flush()
    assert kept_texts(warm_set) == {"hot one", "hot two"}
    runtime.engine.bump_generation()
    wait_warmed(runtime, runs=1)
    calls = model.calls
    model.delay_s = 0.6  # a live request holds the engine this long
    live = threading.Thread(target=runtime.engine.classify, args=("text", "a slow new message"))
    live.start()
    time.sleep(0.1)
    runtime.engine.bump_generation()  # a warm-up starts while the request is inside
    time.sleep(0.3)
    assert runtime.admin.warmup_progress()["done"] == 0 and model.calls == calls + 1
    live.join()
    progress = wait_warmed(runtime, runs=2)
    assert (progress["done"], progress["computed"]) == (2, 2) and model.calls == calls + 3
    assert "2/2 inputs done" in warmup_text(runtime.admin.warmup_progress())


def test_the_warm_set_works_on_a_redis_cluster(
    make_runtime: Callable[..., Runtime], redis_binary: str
) -> None:
    from testing.redis_servers import LocalCluster

    with LocalCluster() as cluster:
        model = CountingTextModel("v1")
        runtime = make_runtime(models={"text": model}, redis__url=cluster.url, warmup__size=3)
        warm_set = runtime.warm_set
        assert warm_set is not None
        send_traffic(runtime)
        warm_set.flush()
        send_traffic(runtime)
        warm_set.flush()
        assert kept_texts(warm_set) == {"message m0", "message m1", "message m2"}
        calls = model.calls
        runtime.engine.bump_generation()
        progress = wait_warmed(runtime, runs=1)
        assert (progress["done"], progress["computed"], progress["failed"]) == (3, 3, 0)
        assert runtime.engine.classify("text", "message m2").tier in ("l1", "l2")
        assert model.calls == calls + 3
        runtime.close()  # before the cluster stops
