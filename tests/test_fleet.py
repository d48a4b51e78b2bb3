"""One fleet: replicas sharing one real redis-server act as one cache.

Replicas here are runtimes built in this process (each with its own Redis client, fleet
thread, L1 and model) or, for the holder that dies, a separate process killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from engine.fleet.member import FleetMember
from runtime import Runtime
from storage.redis.embedded import EmbeddedRedis
from tests.conftest import CountingTextModel

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "fleet-operator-token"
FAST = {"fleet__generation_refresh_s": 0.1, "fleet__heartbeat_s": 0.1, "fleet__generation_confirm_s": 0.5}


def wait_until(condition: Callable[[], Any], timeout_s: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not met within {timeout_s}s")


@pytest.fixture
def fleet(make_runtime, redis_server: EmbeddedRedis) -> Callable[..., Runtime]:
    """Replicas on the test's Redis, each named; `fleet("A", model)`."""

    def replica(name: str, model: CountingTextModel | None = None, **overrides: Any) -> Runtime:
        settings = {**FAST, **overrides}
        return make_runtime(models={"text": model or CountingTextModel()}, redis__url=redis_server.url,
                            server__replica_id=name, server__admin_token=TOKEN, **settings)  # fmt: skip

    return replica


def peers_known(*runtimes: Runtime) -> None:
    """Each replica's registry view has the others (the lease is skipped by a lone replica)."""
    for runtime in runtimes:
        assert runtime.fleet is not None
        flight = runtime.engine._fleet_flight
        wait_until(lambda f=flight: f is not None and (f.peers or 0) >= len(runtimes) - 1, what="peers")


class TestRegistry:
    def test_every_replica_heartbeats_its_state(self, fleet) -> None:
        a, _b = fleet("A"), fleet("B")
        a.engine.classify("text", "hello there")
        a.engine.classify("text", "hello there")
        records = {r["id"]: r for r in wait_until(
            lambda: [r for r in a.admin.replicas() if r["id"] == "A" and r["hit_rate"] == 0.5]
            and a.admin.replicas(), what="A's hit rate in its record")}  # fmt: skip
        assert set(records) == {"A", "B"}
        mine = records["A"]
        assert mine["state"] == "live" and mine["self"] is True and records["B"]["self"] is False
        assert mine["models"] == {"text": "standin-v1"}
        assert mine["l1_entries"] >= 1 and mine["l1_bytes"] > 0 and mine["requests"] == 2
        assert mine["generation"] == 0 and mine["flush_epoch"] == 0
        assert mine["started_at"] <= mine["last_seen"] <= time.time() + 1
        assert mine["seen_s_ago"] < 2.0

    def test_a_stopped_replica_is_marked_stopped(self, fleet) -> None:
        a, b = fleet("A"), fleet("B")
        b.close()
        assert {r["id"]: r["state"] for r in a.admin.replicas()} == {"A": "live", "B": "stopped"}

    def test_api_lists_replicas_with_the_token_only(self, serve, redis_server: EmbeddedRedis) -> None:
        url, _runtime = serve(
            redis__url=redis_server.url, server__replica_id="api-replica", server__admin_token=TOKEN, **FAST,
        )
        refused = httpx.get(url + "/admin/api/replicas", timeout=10)
        assert refused.status_code == 401
        headers = {"Authorization": f"Bearer {TOKEN}"}
        answer = httpx.get(url + "/admin/api/replicas", headers=headers, timeout=10)
        assert answer.status_code == 200
        assert [r["id"] for r in answer.json()["replicas"]] == ["api-replica"]


class TestFleetActions:
    def test_flush_reaches_every_l1_with_every_tier(self, fleet) -> None:
        model_b = CountingTextModel()
        a, b = fleet("A"), fleet("B", model_b)
        for tier, then in (("l1", "l2"), ("all", "miss"), ("l2", "l1")):
            b.engine.classify("text", "flush me")
            assert b.engine.classify("text", "flush me").tier == "l1"
            result = a.admin.flush(tier, actor="test")
            assert result["fleet"]["complete"] and result["fleet"]["confirmed"] == ["A", "B"], result
            # l1: B's memory is gone, L2 answers; all: both gone; l2: B's memory still answers.
            assert b.engine.classify("text", "flush me").tier == then, tier

    def test_bump_is_acknowledged_by_every_replica_without_a_blind_sleep(self, fleet) -> None:
        a, b = fleet("A"), fleet("B")
        started = time.monotonic()
        result = a.admin.bump_version(actor="test")
        took = time.monotonic() - started
        assert result["ok"] and result["generation"] == 1
        assert result["fleet"]["confirmed"] == ["A", "B"] and result["fleet"]["complete"]
        # Acknowledged means already there: B's very next request carries the new generation.
        assert b.engine.generation == 1 and b.engine.classify("text", "after bump").generation == 1
        assert took < 1.0  # the old acknowledgement slept two refresh periods (0.2 s here) + B's poll

    def test_a_live_replica_that_does_not_confirm_is_named(self, serve, fleet, redis_server) -> None:
        url, _runtime = serve(redis__url=redis_server.url, server__replica_id="A", server__admin_token=TOKEN,
                             fleet__ack_timeout_s=0.5, **FAST)  # fmt: skip
        # A replica that heartbeats but never applies anything (a wedged process).
        direct = redis.Redis.from_url(redis_server.url)
        wedged = json.dumps({"id": "wedged", "generation": 0, "flush_epoch": 0, "last_seen": time.time()})
        direct.set("infcache:meta:replica:wedged", wedged, px=30_000)
        direct.hset("infcache:meta:replicas", "wedged", wedged)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        flushed = httpx.post(url + "/admin/api/flush", json={"tier": "l1"}, headers=headers, timeout=10)
        assert flushed.status_code == 202
        assert flushed.json()["fleet"]["unconfirmed"] == ["wedged"]
        assert flushed.json()["fleet"]["confirmed"] == ["A"]
        bumped = httpx.post(url + "/admin/api/bump-version", json={}, headers=headers, timeout=10)
        assert bumped.status_code == 202 and bumped.json()["fleet"]["unconfirmed"] == ["wedged"]
        # Its record expires (dead): from then on it is named as lost, and the action is complete.
        direct.delete("infcache:meta:replica:wedged")
        again = httpx.post(url + "/admin/api/flush", json={"tier": "l1"}, headers=headers, timeout=10)
        assert again.status_code == 200 and again.json()["fleet"]["lost"] == ["wedged"]
        direct.close()

    def test_generation_never_goes_backwards(self, fleet, redis_server: EmbeddedRedis) -> None:
        a, b = fleet("A"), fleet("B")
        for _ in range(3):
            a.admin.bump_version(actor="test")
        direct = redis.Redis.from_url(redis_server.url)
        direct.set("infcache:meta:generation", 1)  # a Redis that lost its data, or a stale writer
        time.sleep(0.3)  # three polls
        assert (a.engine.generation, b.engine.generation) == (3, 3)
        # ...and the shared value is lifted back rather than followed down.
        assert wait_until(lambda: int(direct.get("infcache:meta:generation")) >= 3, what="lifted")
        assert a.admin.bump_version(actor="test")["generation"] >= 4
        direct.close()

    def test_a_missed_message_is_caught_up_from_the_epoch(self, fleet, redis_server) -> None:
        _a, b = fleet("A"), fleet("B")
        b.engine.classify("text", "remember me")
        assert b.engine.classify("text", "remember me").tier == "l1"
        direct = redis.Redis.from_url(redis_server.url)
        direct.incr("infcache:meta:fleet_epoch")  # an operation whose message B never got
        wait_until(lambda: b.fleet is not None and b.fleet.missed_caught_up == 1, what="catch-up")
        assert b.engine.classify("text", "remember me").tier == "l2"
        direct.close()

    def test_l1_is_bypassed_while_the_generation_cannot_be_confirmed(self, fleet, redis_server) -> None:
        a = fleet("A", fleet__generation_confirm_s=0.4)
        a.engine.classify("text", "cached")
        assert a.engine.classify("text", "cached").tier == "l1"
        redis_server.close()  # Redis gone: no confirmation any more
        time.sleep(0.6)
        answers = [a.engine.classify("text", "cached") for _ in range(3)]
        assert [r.tier for r in answers] == ["miss"] * 3  # served, by the model, not from memory
        assert a.fleet is not None and not a.fleet.l1_readable()


class TestSingleFlightAcrossReplicas:
    def test_two_replicas_times_16_requests_cost_one_model_call(self, fleet) -> None:
        models = [CountingTextModel(delay_s=0.3), CountingTextModel(delay_s=0.3)]
        replicas = [fleet("A", models[0]), fleet("B", models[1])]
        peers_known(*replicas)
        barrier = threading.Barrier(32)
        answers: list[Any] = []

        def ask(runtime: Runtime) -> None:
            barrier.wait()
            try:
                answers.append(runtime.engine.classify("text", "one new input for the fleet"))
            except Exception as exc:  # counted below as a failure
                answers.append(exc)

        threads = [threading.Thread(target=ask, args=(r,)) for r in replicas for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(not isinstance(a, Exception) for a in answers), answers
        assert sum(m.calls for m in models) == 1
        assert Counter(a.tier for a in answers) == {"miss": 1, "coalesced": 31}
        assert len({a.prediction for a in answers}) == 1

    def test_lease_skipped_when_redis_is_down(self, fleet, redis_server) -> None:
        model = CountingTextModel()
        a, b = fleet("A", model), fleet("B")
        peers_known(a, b)
        redis_server.close()
        answer = a.engine.classify("text", "redis is gone")
        assert answer.tier == "miss" and model.calls == 1

    def test_a_killed_holder_releases_by_expiry_and_no_request_fails(
        self, fleet, redis_server: EmbeddedRedis, tmp_path: Path
    ) -> None:
        text, lease_s = "asked of a replica that dies", 1.5
        holder = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet_holder", redis_server.url, "infcache",
             str(tmp_path / "holder"), text, str(lease_s)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            direct = redis.Redis.from_url(redis_server.url)
            models = [CountingTextModel(delay_s=0.2), CountingTextModel(delay_s=0.2)]
            replicas = [fleet("A", models[0]), fleet("B", models[1])]
            wait_until(lambda: direct.keys("infcache:lease:*"), timeout_s=60, what="the holder's lease")
            answers: list[Any] = []
            started = time.monotonic()

            def ask(runtime: Runtime) -> None:
                try:
                    answers.append(runtime.engine.classify("text", text))
                except Exception as exc:  # counted below as a failure
                    answers.append(exc)

            threads = [threading.Thread(target=ask, args=(r,)) for r in replicas for _ in range(16)]
            for t in threads:
                t.start()
            time.sleep(0.2)
            holder.send_signal(signal.SIGKILL)  # mid-computation: its model sleeps for a minute
            holder.wait(timeout=10)
            for t in threads:
                t.join(timeout=30)
            took = time.monotonic() - started
            assert all(not isinstance(a, Exception) for a in answers) and len(answers) == 32, answers
            assert sum(m.calls for m in models) == 1  # one survivor took the expired lease
            assert took >= 0.5  # they waited for the lease (1.5 s from when the holder took it)
            assert Counter(a.tier for a in answers)["miss"] == 1
            lost = wait_until(
                lambda: [r["id"] for r in replicas[0].admin.replicas() if r["state"] == "lost"],
                what="the holder listed as lost",
            )
            assert lost == ["doomed-holder"]
            direct.close()
        finally:
            with contextlib.suppress(ProcessLookupError):
                holder.kill()
            holder.wait(timeout=10)


def test_member_closes_idempotently(fleet) -> None:
    runtime = fleet("A")
    member = runtime.fleet
    assert isinstance(member, FleetMember)
    member.close()
    member.close()


def test_console_lists_replicas_and_names_unconfirmed_ones(fleet) -> None:
    from admin.replicas.tab import fleet_line, make_replicas_callback

    a, _b = fleet("A"), fleet("B")
    rows = make_replicas_callback(a.admin)("signed-in operator")
    assert [row[0] for row in rows] == ["A (this one)", "B"] and {row[1] for row in rows} == {"live"}
    line = fleet_line({"fleet": {"confirmed": ["A"], "unconfirmed": ["B"], "left": [], "lost": ["C"],
                                 "waited_s": 5.0, "timeout_s": 5.0, "error": None}})  # fmt: skip
    assert "not confirmed within 5 s: B" in line and "C" in line


def test_lease_follows_the_p99_within_its_bounds(fleet) -> None:
    from engine.fleet.flight import LEASE_MIN_S

    flight = fleet("A", fleet__flight_lease_max_s=4.0).engine._fleet_flight
    assert flight is not None
    assert flight.lease_s("text") == 4.0  # nothing measured yet: the longest
    for _ in range(99):
        flight.record("text", 0.01)
    assert flight.lease_s("text") == LEASE_MIN_S  # fast model: the floor
    for _ in range(10):
        flight.record("text", 0.5)
    assert flight.lease_s("text") == pytest.approx(3 * 0.5 + 0.25)
    for _ in range(10):
        flight.record("text", 10.0)
    assert flight.lease_s("text") == 4.0
