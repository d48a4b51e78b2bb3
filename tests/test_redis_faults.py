"""Redis failing under the cache: killed, paused, unreachable at start-up, restarted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import redis

from runtime import Runtime
from storage.redis.embedded import EmbeddedRedis
from tests.conftest import CountingTextModel, free_port

pytestmark = pytest.mark.redis

SOCKET_TIMEOUT_S = 0.2
MODEL_DELAY_S = 0.05
# Scheduling noise on a loaded 2-core machine; the bound under test is timeout + model time.
SLACK_S = 0.25


def wait_until(condition: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if condition():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s}s")


def l2_serves(runtime: Runtime, text: str) -> bool:
    """True once a fresh answer goes to Redis and comes back from it."""
    runtime.engine.classify("text", text)
    runtime.engine.flush("l1")
    return runtime.engine.classify("text", text).tier == "l2"


@pytest.fixture
def runtime_on(make_runtime) -> Callable[[EmbeddedRedis], tuple[Runtime, CountingTextModel]]:
    def build(server: EmbeddedRedis) -> tuple[Runtime, CountingTextModel]:
        model = CountingTextModel(delay_s=MODEL_DELAY_S)
        runtime = make_runtime(
            models={"text": model}, redis__url=server.url, redis__socket_timeout_s=SOCKET_TIMEOUT_S
        )
        return runtime, model

    return build


def test_redis_killed_mid_run_then_restarted(runtime_on, redis_server: EmbeddedRedis) -> None:
    runtime, _ = runtime_on(redis_server)
    for i in range(20):
        runtime.engine.classify("text", f"warm {i}")
    redis_server.kill()
    worst = 0.0
    tiers = []
    for i in range(40):  # half cached (L1), half new (model)
        started = time.monotonic()
        result = runtime.engine.classify("text", f"warm {i}" if i < 20 else f"new {i}")
        worst = max(worst, time.monotonic() - started)
        tiers.append(result.tier)
    assert tiers[:20] == ["l1"] * 20 and tiers[20:] == ["miss"] * 20
    assert worst < SOCKET_TIMEOUT_S + MODEL_DELAY_S + SLACK_S, f"slowest request took {worst:.3f}s"
    assert runtime.engine.cache_state()["l2"]["state"] == "down"
    assert runtime.engine.counters().l2_errors > 0

    redis_server.start()  # same port, empty
    counter = iter(range(10_000))
    recovery = wait_until(lambda: l2_serves(runtime, f"after restart {next(counter)}"), timeout_s=10)
    assert recovery < 10
    assert runtime.engine.cache_state()["l2"]["state"] == "up"


def test_redis_paused_requests_finish_within_timeout_plus_model_time(
    runtime_on, redis_server: EmbeddedRedis
) -> None:
    runtime, _ = runtime_on(redis_server)
    runtime.engine.classify("text", "cached before the pause")
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")
    try:
        durations = []
        for i in range(8):
            started = time.monotonic()
            runtime.engine.classify("text", f"during pause {i}")
            durations.append(time.monotonic() - started)
        started = time.monotonic()
        assert runtime.engine.classify("text", "cached before the pause").tier == "l1"
        durations.append(time.monotonic() - started)
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
    assert max(durations) < SOCKET_TIMEOUT_S + MODEL_DELAY_S + SLACK_S, durations
    counter = iter(range(10_000))
    wait_until(lambda: l2_serves(runtime, f"after unpause {next(counter)}"), timeout_s=10)


def test_concurrent_requests_survive_a_kill(runtime_on, redis_server: EmbeddedRedis) -> None:
    runtime, _ = runtime_on(redis_server)
    failures: list[BaseException] = []
    answered = [0] * 4  # per client; each list slot is written by one thread only
    stop = threading.Event()

    def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                runtime.engine.classify("text", f"client {n} question {i % 7}")
                answered[n] += 1
            except BaseException as exc:  # any exception reaching a caller is a failure
                failures.append(exc)
            i += 1

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    redis_server.kill()
    time.sleep(1.0)
    redis_server.start()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert [t.name for t in threads if t.is_alive()] == [], "a client is stuck in classify"
    assert failures == []
    assert all(n > 0 for n in answered), answered


def test_app_starts_with_redis_unreachable_and_l2_joins_later(make_runtime, redis_binary, tmp_path) -> None:
    port = free_port()
    model = CountingTextModel()
    runtime = make_runtime(
        models={"text": model}, redis__url=f"redis://127.0.0.1:{port}/0", redis__socket_timeout_s=0.2
    )
    assert runtime.engine.classify("text", "before redis").tier == "miss"
    server = EmbeddedRedis(data_dir=tmp_path / "late", maxmemory_mb=16, binary=redis_binary, port=port,
                           save=False)  # fmt: skip
    server.start()
    try:
        counter = iter(range(10_000))
        wait_until(lambda: l2_serves(runtime, f"late {next(counter)}"), timeout_s=10)
    finally:
        server.close()
