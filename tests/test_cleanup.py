"""Old versions in L2 (engine.lifecycle.cleanup): counts per model version and generation, a dry run,
a rate-limited background deletion that keeps what is served now and everything else."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from engine.cache.keys import digest_parts
from engine.lifecycle.cleanup import LEGACY_SCHEME_MARK, CleanupJob, census, is_old, parse_key
from runtime import Runtime
from storage.redis.embedded import EmbeddedRedis, free_port
from tests.conftest import CountingTextModel

pytestmark = pytest.mark.redis
TOKEN = "cleanup-operator-token"


def wait_done(get: Callable[[], dict[str, Any]], timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        progress = get()
        if progress["state"] != "running":
            return progress
        time.sleep(0.05)
    raise AssertionError(f"clean-up still running: {get()}")


@pytest.fixture
def aged(make_runtime: Callable[..., Runtime], redis_server: EmbeddedRedis) -> Runtime:
    """Entries of v1 at generation 0 (30) and 1 (10), then of v2 at generation 1 (10, served now)."""
    runtime = make_runtime(models={"text": CountingTextModel("v1")}, redis__url=redis_server.url,
                           server__admin_token=TOKEN)  # fmt: skip
    engine = runtime.engine
    for n in range(30):
        engine.classify("text", f"old message {n}")
    engine.bump_generation()
    for n in range(10):
        engine.classify("text", f"bumped message {n}")
    engine.replace_model("text", CountingTextModel("v2"))
    for n in range(10):
        engine.classify("text", f"new message {n}")
    engine.close()  # the waiting L2 writes go out now
    return runtime


def test_parse_key_knows_only_entries() -> None:
    digest = digest_parts([b"text:", b"hello"])
    assert parse_key(f"p:text:v1:3:{digest}".encode(), "p") == ("text", "v1", 3)
    assert parse_key(f"p:image-raw:v1:0:{digest}", "p") == ("image", "v1", 0)
    # An entry of the key scheme before (a bare xxh3-128 digest) is never read again: old.
    legacy = parse_key("p:text:v1:3:0123456789abcdef0123456789abcdef", "p")
    assert legacy == ("text", "v1" + LEGACY_SCHEME_MARK, 3)
    assert is_old(*legacy, ({"text": "v1"}, 3))
    for other in (
        "p:meta:generation",
        f"p:lease:text:v1:0:{digest}",
        f"q:text:v1:0:{digest}",
        "p:text:v1:x:y",
        f"p:text:v1:0:{digest}0",
        "p:text:v1:0:b3" + "g" * 32,
    ):
        assert parse_key(other, "p") is None


def test_census_dry_run_and_delete(aged: Runtime, redis_server: EmbeddedRedis) -> None:
    from ui.server import serve_runtime

    direct = redis.Redis.from_url(redis_server.url)
    direct.set("someone-else:text:v1:0:" + "a" * 32, b"x", ex=600)  # another app's key: never touched
    meta_before = sorted(direct.scan_iter(match=f"{aged.settings.cache.prefix}:meta:*"))
    server = serve_runtime(aged, port=free_port())
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        assert httpx.get(f"{server.url}/admin/api/l2/versions", timeout=10).status_code == 401
        counts = httpx.get(f"{server.url}/admin/api/l2/versions", headers=auth, timeout=10).json()
        groups = {(r["model_version"], r["generation"]): (r["entries"], r["current"]) for r in counts["rows"]}
        assert counts["exact"] and groups == {
            ("v1", 0): (30, False),
            ("v1", 1): (10, False),
            ("v2", 1): (10, True),
        }
        assert counts["old_estimate"] == 40

        def progress() -> dict[str, Any]:
            return httpx.get(f"{server.url}/admin/api/l2/cleanup", headers=auth, timeout=10).json()

        started = httpx.post(
            f"{server.url}/admin/api/l2/cleanup", json={"dry_run": True}, headers=auth, timeout=10
        )
        assert started.status_code == 202 and started.json()["dry_run"]
        dry = wait_done(progress)
        assert dry["state"] == "done" and dry["matched"] == 40 and dry["deleted"] == 0
        assert dry["scanned"] >= 50
        assert aged.engine.l2_store().count_keys() >= 50  # nothing deleted by a dry run

        answer = httpx.post(
            f"{server.url}/admin/api/l2/cleanup", json={"dry_run": False}, headers=auth, timeout=10
        )
        assert answer.status_code == 202
        done = wait_done(progress)
        assert done["state"] == "done" and done["deleted"] == 40 and done["matched"] == 40
        left = census(aged.engine.l2_store(), prefix=aged.settings.cache.prefix,
                      current=lambda: ({"text": "v2"}, 1))  # fmt: skip
        assert [(r["model_version"], r["generation"], r["entries"]) for r in left["rows"]] == [("v2", 1, 10)]
        assert direct.exists("someone-else:text:v1:0:" + "a" * 32)
        assert sorted(direct.scan_iter(match=f"{aged.settings.cache.prefix}:meta:*")) == meta_before
        aged.engine.flush("l1")
        assert aged.engine.classify("text", "new message 3").tier == "l2"  # served entries kept
        actions = [r["action"] for r in aged.admin.audit_rows()]
        assert actions.count("cleanup_l2") == 1  # the deletion is audited, the dry run is not
    finally:
        server.close()


def test_census_estimates_from_a_sample(aged: Runtime, redis_server: EmbeddedRedis) -> None:
    direct = redis.Redis.from_url(redis_server.url)
    prefix = aged.settings.cache.prefix
    with direct.pipeline(transaction=False) as pipe:
        for n in range(3000):  # many old entries, and as many keys of someone else
            pipe.set(f"{prefix}:text:v0:0:b3{n:032x}", b"x", ex=600)
            pipe.set(f"other:{n}", b"x", ex=600)
        pipe.execute()
    estimate = census(
        aged.engine.l2_store(), prefix=prefix, current=lambda: ({"text": "v2"}, 1), max_scanned=1500
    )
    assert not estimate["exact"] and estimate["scanned"] < 6050
    by_version = {r["model_version"]: r["entries"] for r in estimate["rows"]}
    assert 3000 * 0.6 <= by_version["v0"] <= 3000 * 1.4, by_version


def test_deletion_is_rate_limited_and_one_at_a_time(aged: Runtime) -> None:
    store = aged.engine.l2_store()
    assert store is not None
    started = time.monotonic()
    job = CleanupJob(store, prefix=aged.settings.cache.prefix, current=lambda: ({"text": "v2"}, 1),
                     dry_run=True, rate=100, batch=10).start()  # fmt: skip
    progress = wait_done(job.snapshot)
    assert progress["matched"] == 40 and progress["scanned"] >= 50
    assert time.monotonic() - started >= 0.4  # >= 50 keys at 100 keys/s (less the last batch)

    with redis.Redis.from_url(aged.l2_url or "") as direct, direct.pipeline(transaction=False) as pipe:
        for n in range(5000):  # a second at the default rate: the next start finds it running
            pipe.set(f"{aged.settings.cache.prefix}:text:v0:0:{n:032x}", b"x", ex=600)
        pipe.execute()
    first = aged.admin.start_cleanup(dry_run=True, actor="test")
    assert first["state"] == "running"
    with pytest.raises(Exception, match="already running"):
        aged.admin.start_cleanup(dry_run=True, actor="test")
