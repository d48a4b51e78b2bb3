"""Fairness for a public demo (engine.capacity.fairness, engine.capacity.admission): who a client is, a miss
budget per client (in a real Redis, shared by replicas, with a local fallback) that refuses a
miss only when it would take the model from another client, round-robin queueing of misses,
and the doors' answers: REST 429 + Retry-After, Gradio's error message."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from admin.clients.tab import client_rows, proxy_notice
from admin.console.charts import all_figures
from engine.capacity.admission import CONTENDED_WINDOW_S, MissAdmission
from engine.capacity.fairness import ClientLabels, FairQueue, FairSlots, MissBudget, QueueWaits, client_id
from engine.errors import InvalidInputError, OverBudgetError
from engine.pipeline.results import RequestRecord
from runtime import Runtime
from settings import Settings
from storage.breaker import CircuitBreaker
from storage.redis.buckets import LocalBuckets, RedisBuckets
from storage.redis.embedded import EmbeddedRedis, free_port
from storage.redis.store import RedisStore, make_client
from testing.gradio_http import GradioHttpClient
from ui.server import serve_runtime

# ---- who a client is ------------------------------------------------------------------


def test_client_is_the_address_and_an_ipv6_client_its_slash_64() -> None:
    assert client_id("203.0.113.7") == "203.0.113.7"
    assert client_id("::ffff:203.0.113.7") == "203.0.113.7"
    one = client_id("2001:db8:1:2::1")
    assert one == client_id("2001:db8:1:2:ffff:ffff:ffff:ffff") == "2001:db8:1:2::/64"
    assert client_id("2001:db8:1:3::1") != one
    assert client_id(None) == "unknown"
    assert client_id("testclient") == "testclient"


def test_a_label_never_holds_the_whole_address() -> None:
    labels = ClientLabels()
    label = labels.label("203.0.113.7")
    assert label.startswith("203.0.113.x#") and "203.0.113.7" not in label
    assert labels.label("203.0.113.8") != label  # one /24, two clients
    six = labels.label("2001:db8:1:2::/64")
    assert six.startswith("2001:db8:1::/48#") and "1:2" not in six


# ---- the buckets ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_local_bucket_spends_its_burst_then_refills_at_its_rate() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock=clock)
    assert [buckets.take("a", 2.0, 3) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a", 2.0, 3) == pytest.approx(0.5)
    assert buckets.take("b", 2.0, 3) == 0.0  # another client's bucket is full
    clock.now += 0.5
    assert buckets.take("a", 2.0, 3) == 0.0
    assert buckets.take("a", 2.0, 3) > 0


@pytest.fixture
def redis_store(redis_server: EmbeddedRedis) -> Iterator[RedisStore]:
    store = RedisStore(make_client(redis_server.url, socket_timeout_s=0.3), prefix="fair",
                       breaker=CircuitBreaker(failure_threshold=1, reset_s=60))  # fmt: skip
    yield store
    store.close()


@pytest.mark.redis
def test_replicas_share_one_bucket_per_client_in_redis(redis_store: RedisStore) -> None:
    # Two replicas' budgets over one Redis: together they spend the burst, not twice it.
    replicas = [MissBudget(rate=0.5, burst=4, shared=RedisBuckets(redis_store, prefix="fair:meta:b:"))
                for _ in range(2)]  # fmt: skip
    waits = [replicas[turn % 2].spend("198.51.100.1") for turn in range(8)]
    assert waits[:4] == [0.0] * 4
    assert all(0 < wait <= 2 for wait in waits[4:])
    assert replicas[0].spend("198.51.100.2") == 0.0  # another client is not touched
    keys = redis_store.client.keys("fair:meta:b:*")
    assert len(keys) == 2 and all(b"198" not in k for k in keys)  # hashed, never the address
    assert 0 < redis_store.client.pttl(keys[0]) <= 9000  # gone once it would be full again
    refusal = replicas[0].refusal("198.51.100.1", 1.5)
    assert refusal.wait_s == 2 and refusal.first and replicas[0].limited_clients() == 1
    assert not replicas[0].refusal("198.51.100.1", 1.5).first  # one log line, not one per miss


@pytest.mark.redis
def test_redis_down_falls_back_to_each_replicas_own_bucket(
    redis_server: EmbeddedRedis, redis_store: RedisStore
) -> None:
    budget = MissBudget(rate=0.1, burst=2, shared=RedisBuckets(redis_store, prefix="fair:meta:b:"))
    redis_server.kill()
    assert [budget.spend("198.51.100.1") for _ in range(3)] == [0.0, 0.0, pytest.approx(10.0, abs=0.1)]
    assert budget.local_fallbacks == 3


# ---- admission: refused only when it would take the model from someone else --------------


def _admission(clock: Clock, *, rate: float = 0.001, burst: int = 2) -> MissAdmission:
    budget = MissBudget(rate=rate, burst=burst, shared=None, local=LocalBuckets(clock=clock), clock=clock)
    return MissAdmission(budget, clock=clock)


def test_alone_a_client_past_its_budget_is_served_as_fast_as_it_asks() -> None:
    clock = Clock()
    admission = _admission(clock)
    for _ in range(50):  # one at a time, as a script sends them
        with admission.admitted("text", "198.51.100.1"):
            clock.now += 0.01
    with ExitStack() as held:  # eight at once, nobody else waiting: all of them
        for _ in range(8):
            held.enter_context(admission.admitted("text", "198.51.100.1"))
    decisions = admission.state()
    assert decisions[("text", "budget")] == 2 and decisions[("text", "idle")] == 56
    assert ("text", "refused") not in decisions


def test_under_contention_a_client_past_its_budget_keeps_one_miss_per_turn() -> None:
    clock = Clock()
    admission = _admission(clock)
    flood, visitor = "198.51.100.1", "203.0.113.7"
    for _ in range(2):  # the flood spends its burst
        with admission.admitted("text", flood):
            pass
    with admission.admitted("text", visitor):  # a visitor's miss is waiting
        with admission.admitted("text", flood):  # one of the flood's: its share of the turn
            with pytest.raises(OverBudgetError) as refused, admission.admitted("text", flood):
                pass
            assert refused.value.wait_s == 1000  # until its next token (rate 0.001/s)
            with admission.admitted("image", flood):  # another task's model is not contended
                pass
        with admission.admitted("text", flood):  # its waiting miss went through: its next turn
            pass
        with admission.admitted("text", visitor):  # the visitor's second at once: within its budget
            pass
        clock.now += 1000  # the flood waited its Retry-After: its token is there for the retry
        with admission.admitted("text", flood), admission.admitted("text", flood):
            pass
    assert not admission.contended("text")
    clock.now += CONTENDED_WINDOW_S + 0.1
    with ExitStack() as held:  # the visitor gone, the flood alone again: served
        for _ in range(4):
            held.enter_context(admission.admitted("text", flood))
    decisions = admission.state()
    assert decisions[("text", "refused")] == 1
    assert decisions[("text", "one_per_turn")] == 4  # the visitor's first, the flood's three turns
    assert decisions[("text", "budget")] == 2 + 1 + 1  # the burst, the visitor's second, the retry


def test_a_visitor_s_recent_miss_keeps_the_model_contended_for_a_while() -> None:
    # A visitor's misses are seconds apart: between them the flood keeps one miss at a time,
    # so its passes stay small and the visitor's next miss waits for one of them at most.
    clock = Clock()
    admission = _admission(clock)
    flood, visitor = "198.51.100.1", "203.0.113.7"
    for _ in range(2):
        with admission.admitted("text", flood):
            pass
    with admission.admitted("text", visitor):
        pass
    clock.now += CONTENDED_WINDOW_S / 2
    # Nothing of the visitor's in flight, but recent: the flood's second miss at once is refused.
    with admission.admitted("text", flood), pytest.raises(OverBudgetError), admission.admitted("text", flood):
        pass
    clock.now += CONTENDED_WINDOW_S
    # Alone for a while: two at once; then a visitor's miss while the flood's are in flight.
    with ExitStack() as held:
        for client in (flood, flood, visitor):
            held.enter_context(admission.admitted("text", client))
    clock.now += CONTENDED_WINDOW_S / 2
    with admission.admitted("text", flood), pytest.raises(OverBudgetError), admission.admitted("text", flood):
        pass  # the visitor's miss is remembered however it found the model


def test_the_app_s_own_misses_are_admitted_and_contend_with_nobody() -> None:
    admission = _admission(Clock())
    with admission.admitted("text", None), admission.admitted("text", None):
        assert not admission.contended("text")
    assert admission.state() == {}


def test_contended_share_counts_each_pass_against_the_clients_waiting_for_it() -> None:
    admission = MissAdmission(None)
    admission.record_pass("text", ["a", "a"], ["a"])  # alone: not contended
    admission.record_pass("text", ["a", "a", "b", "a"], ["a", "b"])  # 4 inputs, 2 clients: 2 each
    admission.record_pass("text", ["b"], ["b", "a", ""])  # the app's own work competes with nobody
    a, b = admission.contended_share("a"), admission.contended_share("b")
    assert (a.inputs, a.fair, a.total) == (3, 2.5, 5)
    assert (b.inputs, b.fair) == (2, 2.5)


def test_round_robin_slots_name_the_clients_each_pass_was_taken_from() -> None:
    slots = FairSlots(1, task="image")
    seen: dict[str, list[str]] = {}
    gate = threading.Event()

    def miss(client: str) -> None:
        with slots.slot(client) as competing:
            seen[client] = competing
            if client == "first":
                gate.wait(5)

    threads = [threading.Thread(target=miss, args=(c,)) for c in ("first", "flood", "visitor")]
    threads[0].start()
    while "first" not in seen:
        time.sleep(0.001)
    for n, thread in enumerate(threads[1:], start=1):
        thread.start()
        while len(slots._queue) < n:
            time.sleep(0.001)
    gate.set()
    for thread in threads:
        thread.join(5)
    assert seen == {"first": ["first"], "flood": ["flood", "visitor"], "visitor": ["visitor"]}


# ---- fair queueing ----------------------------------------------------------------------


def test_fair_queue_serves_clients_round_robin() -> None:
    queue: FairQueue[str] = FairQueue()
    for n in range(4):
        queue.push("flood", f"f{n}")
    queue.push("a", "a0")
    queue.push("b", "b0")
    queue.push("a", "a1")
    assert [queue.pop() for _ in range(len(queue))] == ["f0", "a0", "b0", "f1", "a1", "f2", "f3"]


def test_a_freed_pass_goes_to_the_next_client_not_the_next_arrival() -> None:
    waits = QueueWaits()
    slots = FairSlots(1, task="text", waits=waits)
    order: list[str] = []
    gate = threading.Event()

    def miss(client: str, name: str) -> None:
        with slots.slot(client):
            order.append(name)
            if name == "first":
                gate.wait(5)

    threads = [threading.Thread(target=miss, args=("flood", "first"))]
    threads[0].start()
    while not order:
        time.sleep(0.001)
    for n in range(5):  # the flood's five misses wait, then the ordinary client's one
        threads.append(threading.Thread(target=miss, args=("flood", f"flood{n}")))
        threads[-1].start()
        while len(slots._queue) < n + 1:
            time.sleep(0.001)
    threads.append(threading.Thread(target=miss, args=("ordinary", "ordinary")))
    threads[-1].start()
    while len(slots._queue) < 6:
        time.sleep(0.001)
    gate.set()
    for thread in threads:
        thread.join(5)
    # First come first served would put it last; round-robin puts it after one of the flood's.
    assert order.index("ordinary") == 2, order
    depths = {depth for (_task, depth) in waits.snapshot()}
    assert {0, 4} <= depths  # waits recorded by how many waited on arrival


# ---- the engine: only misses spend, refusals only under contention ------------------------


@contextmanager
def contended(runtime: Runtime, task: str, *clients: str) -> Iterator[None]:
    """As if each of `clients` had a miss of `task` waiting for a forward pass now (the engine's
    admission, as a real waiting miss holds it), without a slow model in the test."""
    with ExitStack() as stack:
        for client in clients:
            stack.enter_context(runtime.engine._passes.admitted(task, client))
        yield


def test_alone_past_its_budget_a_client_s_misses_are_all_served(make_runtime) -> None:
    runtime = make_runtime(fairness__client_miss_rate=0.01, fairness__client_miss_burst=2)
    engine = runtime.engine
    script = "198.51.100.9"
    tiers = [engine.classify("text", f"script message {n}", client=script).tier for n in range(40)]
    assert tiers == ["miss"] * 40  # an idle model: nobody to take it from
    decisions = engine.fairness_state()["admissions"]
    assert decisions[("text", "budget")] == 2 and decisions[("text", "idle")] == 38
    assert engine.counters().refused == 0


def test_only_misses_spend_and_a_refusal_is_logged_as_its_own_status(make_runtime) -> None:
    runtime = make_runtime(fairness__client_miss_rate=0.01, fairness__client_miss_burst=2)
    engine = runtime.engine
    records: list[RequestRecord] = []
    engine.add_listener(records.append)
    flood = "198.51.100.9"
    for text in ("one", "two"):
        assert engine.classify("text", text, client=flood).tier == "miss"
    with contended(runtime, "text", "198.51.100.10", flood):  # another client waits; so does one of its
        with pytest.raises(OverBudgetError) as refused:
            engine.classify("text", "three", client=flood)
        assert refused.value.wait_s == 100  # until its next token (rate 0.01/s)
        for _ in range(5):  # hits and remembered rejections are never refused
            assert engine.classify("text", "one", client=flood).tier == "l1"
            with pytest.raises(InvalidInputError):
                engine.classify("text", "   ", client=flood)
        assert engine.classify("text", "three", client="198.51.100.11").tier == "miss"  # another client
        assert engine.classify("text", "four").tier == "miss"  # the app's own request has no budget
    assert engine.classify("text", "five", client=flood).tier == "miss"  # alone again
    statuses = [r.status for r in records]
    assert statuses.count("refused") == 1 and statuses.count("ok") == 10
    refusal = next(r for r in records if r.status == "refused")
    assert refusal.error_code == "over_budget" and refusal.tier is None
    assert refusal.client is not None and flood not in refusal.client
    assert engine.counters().refused == 1
    assert engine.fairness_state()["limited_clients"] == 1


# ---- the doors --------------------------------------------------------------------------


def _infer(url: str, text: str, forwarded_for: str | None = None) -> httpx.Response:
    body = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": [text]}]}
    headers = {"x-forwarded-for": forwarded_for} if forwarded_for else {}
    return httpx.post(f"{url}/v2/models/text/infer", json=body, headers=headers, timeout=10)


def test_rest_answers_429_with_retry_after_and_still_serves_hits(serve) -> None:
    url, runtime = serve(fairness__client_miss_rate=0.05, fairness__client_miss_burst=2)
    assert _infer(url, "hello there", "203.0.113.5").status_code == 200
    assert _infer(url, "second message", "203.0.113.5").status_code == 200
    with contended(runtime, "text", "203.0.113.99", "203.0.113.5"):
        refused = _infer(url, "third message", "203.0.113.5")
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "20"  # until its next token (rate 0.05/s)
        assert "Too many new inputs from your address" in refused.json()["error"]
        hit = _infer(url, "hello there", "203.0.113.5")  # from memory, on the event loop
        assert hit.status_code == 200 and hit.json()["parameters"]["tier"] == "l1"
        # A trusted proxy (loopback, the default) names another client: its own budget.
        assert _infer(url, "third message", "203.0.113.6").status_code == 200
        # An IPv6 client is its /64: another address in it shares the bucket. Two of its misses
        # wait (the second spends a token), a third at once spends the last, a fourth is refused.
        v6 = client_id("2001:db8:5:6::3")
        with contended(runtime, "text", v6, v6):
            assert _infer(url, "v6 one", "2001:db8:5:6::1").status_code == 200
            assert _infer(url, "v6 two", "2001:db8:5:6::2").status_code == 429
    assert _infer(url, "fourth message", "203.0.113.5").status_code == 200  # nobody waits now


def _busiest(runtime: Runtime) -> list[list[Any]]:
    return client_rows(runtime.client_activity, "5m")


def test_x_forwarded_for_from_an_untrusted_peer_is_ignored(serve) -> None:
    url, runtime = serve(fairness__forwarded_allow_ips="192.0.2.1")
    for n, forwarded in enumerate(("203.0.113.5", "203.0.113.99", "198.51.100.4")):
        # The header would make each another client; from an untrusted peer it is the peer itself.
        assert _infer(url, f"untrusted {n}", forwarded).status_code == 200
    assert [row[1] for row in _busiest(runtime)] == [3]  # one client, three misses
    # Several clients forwarded by one untrusted peer: said once, with the setting to change.
    notice = proxy_notice(runtime.client_activity)
    assert notice.count("127.0.0.1") == 1 and "FORWARDED_ALLOW_IPS" in notice
    assert _infer(url, "untrusted 4", "203.0.113.77").status_code == 200
    assert proxy_notice(runtime.client_activity) == notice


@pytest.fixture
def space_server(make_runtime) -> Iterator[tuple[Any, Runtime]]:
    """A served app with a Space's settings (SPACE_ID set, nothing else): (server, runtime)."""
    space = Settings.from_env({"SPACE_ID": "someone/inference-cache"})
    trust = space.fairness
    assert trust.forwarded_trusted_hops == 1 and trust.forwarded_allow_ips == "127.0.0.1,::1"
    runtime = make_runtime(fairness__forwarded_trusted_hops=space.fairness.forwarded_trusted_hops)
    server = serve_runtime(runtime, port=free_port())
    yield server, runtime
    server.close()


def test_behind_a_space_s_front_two_visitors_are_two_clients(space_server) -> None:
    # The Space's front reaches the replica from an internal, non-loopback address; the app
    # is called in-process as from that address (tests bind to loopback only).
    server, runtime = space_server
    app = server.app

    async def visit(forwarded_for: str, text: str) -> int:
        transport = httpx.ASGITransport(app=app, client=("10.16.3.80", 40123))  # the Space's front
        async with httpx.AsyncClient(transport=transport, base_url="http://space") as http:
            body = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": [text]}]}
            response = await http.post("/v2/models/text/infer", json=body,
                                       headers={"x-forwarded-for": forwarded_for})  # fmt: skip
            return response.status_code

    async def visits() -> list[int]:
        return [
            await visit("203.0.113.21", "space visitor one"),
            await visit("198.51.100.22", "space visitor two"),
            # A visitor who writes its own header cannot choose its identity: the front appends.
            await visit("192.0.2.50, 203.0.113.21", "space visitor one again"),
        ]

    assert asyncio.run(visits()) == [200, 200, 200]
    rows = _busiest(runtime)
    assert sorted(row[1] for row in rows) == [1, 2]  # two clients: two misses and one
    assert all(row[0].split("#")[0] in ("203.0.113.x", "198.51.100.x") for row in rows)
    assert proxy_notice(runtime.client_activity) == ""  # a trusted front is no warning


def _gradio_call(url: str, text: str, forwarded_for: str) -> Any:
    with GradioHttpClient(url, headers={"x-forwarded-for": forwarded_for}) as client:
        return client.call("classify_text", [text])


def test_gradio_shows_the_budget_message_and_serves_hits(serve) -> None:
    url, runtime = serve(fairness__client_miss_rate=0.05, fairness__client_miss_burst=1)
    assert _gradio_call(url, "gradio first", "203.0.113.7").outputs[1]["tier"] == "miss"
    with contended(runtime, "text", "203.0.113.70", "203.0.113.7"):
        refused = _gradio_call(url, "gradio second", "203.0.113.7")
        assert refused.error_message is not None
        assert "Too many new inputs from your address at once while others wait for the model; answers " \
               "already cached still work; try again in 20 s." in refused.error_message  # fmt: skip
        assert _gradio_call(url, "gradio first", "203.0.113.7").outputs[1]["tier"] == "l1"
        assert _gradio_call(url, "gradio second", "203.0.113.8").outputs[1]["tier"] == "miss"


# ---- visible: metrics, the console, the request log --------------------------------------


def test_refusals_show_in_metrics_the_busiest_clients_and_the_tier_chart(serve) -> None:
    url, runtime = serve(fairness__client_miss_rate=0.05, fairness__client_miss_burst=1)
    assert _infer(url, "visible one", "203.0.113.40").status_code == 200
    with contended(runtime, "text", "198.51.100.1", "203.0.113.40"):
        assert _infer(url, "visible two", "203.0.113.40").status_code == 429
    assert _infer(url, "visible one", "203.0.113.40").status_code == 200  # a hit
    assert _infer(url, "visible one", "203.0.113.41").status_code == 200  # another client's hit
    metrics = httpx.get(url + "/metrics").text
    assert 'infcache_refused_misses_total{route="rest",task="text"} 1.0' in metrics
    assert "infcache_clients_limited 1.0" in metrics
    assert 'infcache_miss_queue_waits_total{task="text",waiting="0"}' in metrics
    assert 'infcache_miss_admissions_total{decision="refused",task="text"} 1.0' in metrics
    # The first miss alone (a token spent); the two held ones, each its client's turn.
    assert 'infcache_miss_admissions_total{decision="budget",task="text"} 1.0' in metrics
    assert 'infcache_miss_admissions_total{decision="one_per_turn",task="text"} 2.0' in metrics
    assert "203.0.113.40" not in metrics

    rows = client_rows(runtime.client_activity, "5m")
    assert [row[1:] for row in rows] == [[1, 1, 1], [0, 1, 0]]  # misses, hits, refused
    assert rows[0][0].startswith("203.0.113.x#") and not any("203.0.113.4" in str(r) for r in rows)

    runtime.log_writer.flush()
    data = runtime.admin.stats("1h")
    assert data["summary"]["total"] == 4  # the refusal is logged as its own status
    figure = all_figures(data)["tiers"]
    refused = next(trace for trace in figure.data if trace.name.startswith("refused"))
    assert sum(refused.y) == 1
    assert data["per_minute"][0]["total"] == 3  # answers only: a refusal is no answer


def test_client_activity_keeps_the_most_recently_seen_clients() -> None:
    from admin.clients.service import ClientActivity

    now = 1_000_000.0
    activity = ClientActivity(clock=lambda: now, max_clients=3)

    def seen(client: str, tier: str = "miss") -> None:
        activity.observe(RequestRecord(
            at=now, task="text", tier=tier, latency_ms=1.0, status="ok", error_code=None, key_digest=None,
            model_version="v", generation=0, top_label=None, model_ms=None, route="rest", client=client,
        ))  # fmt: skip

    for client in ("a", "b", "c"):
        seen(client)
    seen("a", "l1")  # a is the most recent now: b goes first
    seen("d")
    rows = {row.client: (row.misses, row.hits) for row in activity.busiest(3600)}
    assert rows == {"a": (1, 1), "c": (1, 0), "d": (1, 0)}
