"""ui/lean_sessions.py: the Gradio internals it leans on, and what it does to a served app's memory.

Session-less calls (curl style, `testing.gradio_http.GradioHttpClient` without a session hash) must
leave no session and none of Gradio's bookkeeping behind once answered; sessions with a hash
(a browser tab, gradio_client) must keep their `gr.State` whatever the session-less load.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import gradio as gr
import httpx
import pytest
from gradio.state_holder import SessionState
from gradio.utils import LRUCache as GradioLRUCache
from starlette.routing import Mount

from admin.console.tab import NOT_SIGNED_IN
from engine.inputs import CanonicalText
from engine.models.base import Prediction
from runtime import Runtime
from testing.gradio_http import GradioHttpClient, Reply
from tests.conftest import CountingTextModel, free_port
from ui import lean_sessions
from ui.lean_sessions import LeanSessionState, LeanStateHolder, SessionQueues
from ui.server import BackgroundServer, build_app

TOKEN = "lean-sessions-test-token"
CACHED = "where is my parcel"  # answered by the queue's cache probe after its first call


@dataclass
class Served:
    url: str
    gradio_app: Any  # gradio.routes.App, the Mount's app
    runtime: Runtime

    @property
    def holder(self) -> LeanStateHolder:
        return self.gradio_app.state_holder

    @property
    def queue(self) -> Any:
        return self.gradio_app.get_blocks()._queue

    @property
    def blocks(self) -> gr.Blocks:
        return self.gradio_app.get_blocks()


def mount_of(app: Any) -> Mount:
    return next(r for r in app.routes if isinstance(r, Mount) and r.path == "")


def mounted(app: Any) -> Any:
    """The mounted Gradio app (the cached-call shortcut is one of its middlewares)."""
    return mount_of(app).app


@pytest.fixture
def served(make_runtime) -> Iterator[Served]:
    runtime = make_runtime(server__admin_token=TOKEN)
    app = build_app(runtime)
    # Every call through Gradio itself, cached ones included: its queue probe is what is tested.
    app.state.cached_calls.enabled = False
    with BackgroundServer(app, port=free_port()) as server:
        yield Served(server.url, mounted(app), runtime)


@pytest.fixture
def client(served: Served) -> Iterator[GradioHttpClient]:
    with GradioHttpClient(served.url, timeout_s=30.0) as http:  # no session hash: curl style
        yield http


@pytest.fixture
def demo(make_runtime) -> gr.Blocks:
    return mounted(build_app(make_runtime())).get_blocks()


def text_ids(demo: gr.Blocks) -> tuple[int, list[int]]:
    """The ids of classify_text's input and outputs."""
    fn = next(f for f in demo.fns.values() if f.api_name == "classify_text")
    return fn.inputs[0]._id, [o._id for o in fn.outputs]


def by_id(state: SessionState) -> dict[int, dict]:
    return {c["id"]: c for c in state.components}


def assert_answered(reply: Reply, tier: str | None = None) -> None:
    label, info = reply.outputs
    assert label["label"] == "alpha", reply  # the stand-in model's top class for any text
    assert tier is None or info["tier"] == tier, info


# 1. The contract with Gradio's SessionState (fails first on a Gradio upgrade) ----------------


def test_lean_state_has_every_attribute_of_gradio_session_state(demo: gr.Blocks) -> None:
    missing = set(vars(SessionState(demo))) - set(vars(LeanSessionState(demo)))
    assert not missing, f"SessionState gained attributes LeanSessionState lacks: {missing}"


def test_lean_state_renders_the_same_components(demo: gr.Blocks) -> None:
    real, lean = SessionState(demo), LeanSessionState(demo)
    assert list(lean.components) == list(real.components)

    text_in, (label, info) = text_ids(demo)
    updates = [(text_in, "first"), (label, "first"), (info, "first")]  # superseded before any read
    updates += [(text_in, "hello"), (label, {"label": "alpha", "confidences": []}), (info, {"tier": "l1"})]
    fresh_real, fresh_lean = SessionState(demo), LeanSessionState(demo)
    for state in (fresh_real, fresh_lean):
        for key, value in updates:
            state._update_value_in_config(key, value)
    assert len(fresh_lean._values) == 3, "values were rendered into configs up front: not lean"
    assert list(fresh_lean.components) == list(fresh_real.components)
    assert by_id(fresh_lean)[text_in]["props"]["value"] == "hello"
    fresh_lean._update_value_in_config(text_in, "again")  # after the configs were rendered
    fresh_real._update_value_in_config(text_in, "again")
    assert list(fresh_lean.components) == list(fresh_real.components)


def test_a_new_block_or_config_supersedes_an_earlier_value_the_same_way(demo: gr.Blocks) -> None:
    text_in, (label, info) = text_ids(demo)
    real, lean = SessionState(demo), LeanSessionState(demo)
    for state in (real, lean):
        state._update_value_in_config(text_in, "stale")
        state[text_in] = gr.Textbox(label="Renamed", value="fresh", render=False)  # __setitem__ alone
        state._update_value_in_config(label, "stale")
        state._update_config(label)  # _update_config alone: re-rendered from the block
        state._update_value_in_config(info, "stale")
        state[info] = gr.JSON(label="Renamed", value={"v": 1}, render=False)  # as a gr.update does it
        state._update_config(info)
    # Compared by id: after __setitem__ the lean session lists that block first (see report).
    assert by_id(lean) == by_id(real)
    lean_configs = by_id(lean)
    assert "stale" not in (lean_configs[k]["props"].get("value") for k in (text_in, label, info))
    assert lean_configs[info]["props"]["label"] == "Renamed"
    assert lean[text_in].label == "Renamed"


# 2. Session-less calls leave nothing behind ------------------------------------------------


def assert_nothing_left(served: Served) -> None:
    queue = served.queue
    assert not served.holder.session_data, "a session-less call became a kept session"
    assert len(served.holder.one_shot) <= 2
    assert len(queue.event_ids_to_events) <= 2
    assert len(queue.pending_event_ids_session) <= 2


def test_session_less_cached_calls_leave_no_sessions(served: Served, client: GradioHttpClient) -> None:
    assert_answered(client.call("classify_text", [CACHED]), "miss")
    for _ in range(300):
        assert_answered(client.call("classify_text", [CACHED]), "l1")
    assert_nothing_left(served)


def test_session_less_misses_through_the_queue_leave_no_sessions(
    served: Served, client: GradioHttpClient
) -> None:
    for i in range(200):
        assert_answered(client.call("classify_text", [f"distinct message {i}"]), "miss")
    assert served.runtime.engine.counters().model_calls == {"text": 200}
    assert_nothing_left(served)


# 3. Sessions with a hash keep their state under session-less load -------------------------


def test_admin_sign_in_survives_session_less_load(served: Served, client: GradioHttpClient) -> None:
    served.holder.capacity = 50  # a plain StateHolder would evict the admin's session below
    with (
        GradioHttpClient(served.url, session_hash="admin-tab-session") as admin,
        GradioHttpClient(served.url, session_hash="someone-else") as stranger,
    ):
        assert admin.call("admin_sign_in", [TOKEN]).outputs[0] is None  # a gr.State output
        assert "admin-tab-session" in served.holder.session_data
        for _ in range(600):
            assert_answered(client.call("classify_text", [CACHED]))
        refreshed = admin.call("admin_refresh", [None, "1h"])
        assert "stat-cards" in refreshed.outputs[0]
        assert stranger.call("admin_refresh", [None, "1h"]).error_message == NOT_SIGNED_IN
    assert "admin-tab-session" in served.holder.session_data
    assert "admin-tab-session" not in served.holder.one_shot
    assert set(served.holder.session_data) == {"admin-tab-session", "someone-else"}


def test_a_session_with_a_hash_does_not_pile_up_answered_events(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One gradio_client session for many calls: Gradio never forgets the cache probe's events."""
    monkeypatch.setattr(lean_sessions, "EVENT_SWEEP_EVERY", 32)  # state look-ups between sweeps
    with GradioHttpClient(served.url, session_hash="gradio-client-session") as session:
        assert_answered(session.call("classify_text", [CACHED]), "miss")
        for _ in range(200):
            assert_answered(session.call("classify_text", [CACHED]), "l1")
    assert len(served.queue.event_ids_to_events) <= 32
    assert set(served.holder.session_data) == {"gradio-client-session"} and not served.holder.one_shot


# 4, 5. Answers never read, and the sweep --------------------------------------------------


def post_only(client: GradioHttpClient, message: str) -> str:
    """Queue a call and never read its answer; its event id."""
    queued = client.http.post("/gradio_api/call/classify_text", json={"data": [message]})
    queued.raise_for_status()
    return queued.json()["event_id"]


def read_answer(client: GradioHttpClient, event_id: str) -> str:
    stream = client.http.get(f"/gradio_api/call/classify_text/{event_id}")
    stream.raise_for_status()
    assert "event: complete" in stream.text, stream.text
    return stream.text


def test_answers_never_read_leave_a_bounded_number_of_sessions(
    served: Served, client: GradioHttpClient
) -> None:
    holder = LeanStateHolder(one_shot_capacity=8)
    holder.set_blocks(served.blocks)
    served.gradio_app.state_holder = served.blocks.app.state_holder = holder
    assert_answered(client.call("classify_text", [CACHED]), "miss")
    abandoned = [post_only(client, CACHED) for _ in range(40)]
    assert len(holder.one_shot) <= 8
    assert abandoned[-1] in holder.one_shot
    assert not holder.session_data
    queue = served.queue
    # Gradio's records of the abandoned calls go with them, so nothing grows with the count.
    assert sum(event_id in queue.event_ids_to_events for event_id in abandoned) <= 8
    assert sum(event_id in queue.pending_event_ids_session for event_id in abandoned) <= 8
    read_answer(client, abandoned[-1])  # a recent one is still delivered
    # Dropped: Gradio answers it as it answers any unknown event id (a stream it breaks off).
    try:
        late = client.http.get(f"/gradio_api/call/classify_text/{abandoned[0]}").text
    except httpx.RemoteProtocolError:
        late = ""
    assert "event: complete" not in late


def _from(served: Served, source: str) -> httpx.Client:
    return httpx.Client(base_url=served.url, timeout=30, transport=httpx.HTTPTransport(local_address=source))


def test_one_address_abandoning_calls_pushes_out_only_its_own(
    served: Served, client: GradioHttpClient
) -> None:
    holder, queue = served.holder, served.queue
    holder.one_shot_per_client, holder.sessions_per_client = 8, 6
    assert_answered(client.call("classify_text", [CACHED]), "miss")
    fn_index = next(i for i, fn in served.blocks.fns.items() if fn.api_name == "classify_text")
    with _from(served, "127.0.0.5") as other, _from(served, "127.0.0.6") as flooder:
        kept = other.post("/gradio_api/call/classify_text", json={"data": [CACHED]}).json()["event_id"]
        for n in range(40):  # session-less calls, and calls each of a session of its own
            flooder.post("/gradio_api/call/classify_text", json={"data": [CACHED]}).raise_for_status()
            join = {"data": [CACHED], "fn_index": fn_index, "session_hash": f"flood-session-{n}"}
            flooder.post("/gradio_api/queue/join", json=join).raise_for_status()
        deadline = time.monotonic() + 10
        while len(holder.one_shot) > 9 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kept in holder.one_shot  # another client's call is not pushed out
        assert len(holder.one_shot) <= 9, len(holder.one_shot)  # the flooder's 8 and the other's
        flood_sessions = [s for s in holder.session_data if s.startswith("flood-session-")]
        assert flood_sessions == [f"flood-session-{n}" for n in range(34, 40)]  # its 6 latest
        assert not any(s.startswith("flood-session-") and s not in flood_sessions
                       for s in queue.pending_messages_per_session)  # fmt: skip
        stream = other.get(f"/gradio_api/call/classify_text/{kept}")
        assert "event: complete" in stream.text


def test_many_addresses_filling_the_table_push_out_their_own_calls_not_a_visitors(
    served: Served, client: GradioHttpClient
) -> None:
    holder = served.holder
    holder.one_shot_capacity = 12  # the bound in all; each flooding address stays under its own
    assert_answered(client.call("classify_text", [CACHED]), "miss")
    with _from(served, "127.0.0.5") as visitor:
        kept = visitor.post("/gradio_api/call/classify_text", json={"data": [CACHED]}).json()["event_id"]
        deadline = time.monotonic() + 10
        while kept not in holder.one_shot and time.monotonic() < deadline:
            time.sleep(0.05)  # its session made once it runs
        for n in range(10):
            with _from(served, f"127.0.1.{n + 1}") as flooder:
                for _ in range(3):
                    flooder.post("/gradio_api/call/classify_text", json={"data": [CACHED]}).raise_for_status()
        deadline = time.monotonic() + 10
        while len(holder.one_shot) > holder.one_shot_capacity and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(holder.one_shot) <= holder.one_shot_capacity
        assert kept in holder.one_shot  # the oldest, but its client holds one call, the others 3
        stream = visitor.get(f"/gradio_api/call/classify_text/{kept}")
        assert "event: complete" in stream.text


def test_many_addresses_filling_the_message_queues_push_out_their_own_not_a_visitors(
    served: Served, client: GradioHttpClient
) -> None:
    queues = served.queue.pending_messages_per_session
    queues.max_size = 12  # Gradio's table of message queues, one per session, in all
    assert_answered(client.call("classify_text", [CACHED]), "miss")
    fn_index = next(i for i, fn in served.blocks.fns.items() if fn.api_name == "classify_text")
    with _from(served, "127.0.0.5") as visitor:
        kept = visitor.post("/gradio_api/call/classify_text", json={"data": [CACHED]}).json()["event_id"]
        for n in range(10):  # each address a few sessions of its own, never fetched
            with _from(served, f"127.0.1.{n + 1}") as flooder:
                for k in range(3):
                    join = {"data": [CACHED], "fn_index": fn_index, "session_hash": f"crowd-{n}-{k}"}
                    flooder.post("/gradio_api/queue/join", json=join).raise_for_status()
        assert len(queues) <= queues.max_size
        assert kept in queues  # the oldest queue, but its client holds one, the others 3 each
        stream = visitor.get(f"/gradio_api/call/classify_text/{kept}")
        assert "event: complete" in stream.text


def test_abandoned_calls_expire_with_no_new_call_to_sweep_them(make_runtime, monkeypatch) -> None:
    monkeypatch.setattr(lean_sessions, "SWEEP_EVERY_S", 0.2)
    app = build_app(make_runtime())
    app.state.cached_calls.enabled = False  # every call through Gradio's queue
    holder = mounted(app).state_holder
    with BackgroundServer(app, port=free_port()) as server, GradioHttpClient(server.url) as client:
        abandoned = [post_only(client, f"{CACHED} {n}") for n in range(5)]
        deadline = time.monotonic() + 10
        while any(e not in holder.one_shot for e in abandoned) and time.monotonic() < deadline:
            time.sleep(0.05)  # each call's session made once it runs
        assert all(e in holder.one_shot for e in abandoned)
        holder.one_shot_max_age_s = 0.5
        time.sleep(1.5)  # no call comes
        assert not any(e in holder.one_shot for e in abandoned), len(holder.one_shot)
        assert not any(e in mounted(app).get_blocks()._queue.pending_messages_per_session for e in abandoned)


def test_sweep_keeps_a_session_until_its_answer_is_delivered(
    served: Served, client: GradioHttpClient
) -> None:
    holder, queue = served.holder, served.queue
    assert_answered(client.call("classify_text", [CACHED]), "miss")
    pending = post_only(client, CACHED)
    holder.sweep()
    assert pending in holder.one_shot and queue.pending_event_ids_session[pending] == {pending}
    read_answer(client, pending)
    holder.sweep()
    assert pending not in holder.one_shot
    assert pending not in queue.pending_event_ids_session
    assert pending not in queue.event_ids_to_events


# 6. No number of session-less calls ends a session in use ---------------------------------


def test_a_full_message_queue_table_evicts_sessions_without_state_first(demo: gr.Blocks) -> None:
    holder = LeanStateHolder()
    holder.set_blocks(demo)
    queue = SimpleNamespace(pending_messages_per_session=GradioLRUCache(4), pending_event_ids_session={},
                            event_ids_to_events={"one-shot-0": SimpleNamespace(alive=True)})  # fmt: skip
    table = SessionQueues(queue, holder)
    holder.session_data["browser-tab"] = LeanSessionState(demo)  # a session in use
    table["browser-tab"] = "its messages"
    for i in range(10):
        table[f"one-shot-{i}"] = i
    assert list(table) == ["browser-tab", "one-shot-7", "one-shot-8", "one-shot-9"]
    assert not queue.event_ids_to_events["one-shot-0"].alive  # a call of a queue dropped must not post
    # Only sessions in use left: the oldest goes, as in Gradio.
    for name in ("a", "b", "c", "d"):
        holder.session_data[name] = LeanSessionState(demo)
        table[name] = name
    assert list(table) == ["a", "b", "c", "d"]


def fn_index(blocks: gr.Blocks, api_name: str) -> int:
    return next(index for index, fn in blocks.fns.items() if fn.api_name == api_name)


def queue_messages(client: GradioHttpClient, session_hash: str) -> list[dict[str, Any]]:
    """The browser protocol's stream of a session, read to its end."""
    stream = client.http.get("/gradio_api/queue/data", params={"session_hash": session_hash})
    return [json.loads(line[len("data:") :]) for line in stream.text.splitlines() if line.startswith("data:")]


def test_abandoned_calls_never_end_a_session_in_use(served: Served, client: GradioHttpClient) -> None:
    """A tab has joined the queue (its answer waits in its session's message queue, its
    stream not open yet); then more session-less calls than Gradio's table of message
    queues holds, half never read: the tab's answer is still there, the admin still signed in."""
    table = served.queue.pending_messages_per_session
    assert isinstance(table, SessionQueues) and table.max_size == 2000  # Gradio's own bound
    table.max_size = 40  # the browser test below fills a table of 2,000
    assert_answered(client.call("classify_text", [CACHED]), "miss")
    with GradioHttpClient(served.url, session_hash="admin-tab") as admin:
        assert admin.call("admin_sign_in", [TOKEN]).outputs[0] is None
        index = fn_index(served.blocks, "classify_text")
        join = {"data": [CACHED], "fn_index": index, "session_hash": "browser-tab"}
        joined = client.http.post("/gradio_api/queue/join", json=join)
        assert joined.status_code == 200, joined.text
        for i in range(60):
            post_only(client, CACHED)  # never read
            if i % 2:
                assert_answered(client.call("classify_text", [CACHED]), "l1")
        assert len(table) == 40  # full: evictions happened
        messages = queue_messages(client, "browser-tab")
        assert "stat-cards" in admin.call("admin_refresh", [None, "1h"]).outputs[0]
    completed = [m for m in messages if m["msg"] == "process_completed"]
    assert completed and completed[0]["output"]["data"][0]["label"] == "alpha", messages


def test_a_second_get_of_an_answered_call_waits_as_gradio_does(
    make_runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gradio keeps a session-less call's session once its answer is read: a second GET gets
    heartbeats (until its client leaves). The lean holder drops the session; the shortcut
    (ui.cached_calls) answers that GET as Gradio would."""
    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.2")
    app = build_app(make_runtime())
    holder = mounted(app).state_holder
    with BackgroundServer(app, port=free_port()) as server, GradioHttpClient(server.url) as client:
        first = post_only(client, "a miss: Gradio answers it")
        read_answer(client, first)
        # The next session-less call's session sweeps the first one's away.
        assert_answered(client.call("classify_text", ["another miss"]), "miss")
        assert first not in holder.one_shot and first in holder.delivered
        url = f"/gradio_api/call/classify_text/{first}"
        with client.http.stream("GET", url, timeout=httpx.Timeout(10, read=2)) as stream:
            assert stream.status_code == 200
            assert next(stream.iter_bytes()) == b"event: heartbeat\ndata: null\n\n"
        time.sleep(0.5)  # that client left: as in Gradio, the call is gone
        assert client.http.get(url).text == 'event: error\ndata: "404: Not Found"\n\n'


class GatedTextModel(CountingTextModel):
    """The stand-in text model, whose forward pass waits for `gate` while `gated` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gated = False
        self.gate = threading.Event()

    def predict_batch(self, inputs: Sequence[CanonicalText]) -> list[Prediction]:
        if self.gated:
            self.gate.wait(timeout=120)
        return super().predict_batch(inputs)


FLOOD_CALLS = 2_100  # more than Gradio's table of message queues holds (2,000)


@pytest.mark.browser
def test_a_signed_in_tab_survives_thousands_of_abandoned_calls(make_runtime) -> None:
    """In Chromium: a tab signed into the console waits for an answer (its stream open) while
    2,100 session-less calls go unread; the answer arrives, and the console is still signed in."""
    from playwright.sync_api import expect, sync_playwright

    model = GatedTextModel()
    app = build_app(make_runtime(models={"text": model}, server__admin_token=TOKEN))
    queue = mounted(app).get_blocks()._queue
    # As if the flood came from many addresses: one address alone keeps ONE_SHOT_PER_CLIENT.
    mounted(app).state_holder.one_shot_per_client = FLOOD_CALLS
    with BackgroundServer(app, port=free_port()) as server, sync_playwright() as playwright:
        with GradioHttpClient(server.url) as warm:
            assert_answered(warm.call("classify_text", [CACHED]), "miss")
        browser = playwright.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )  # fmt: skip
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(server.url + "/")
            page.get_by_role("tab", name="Admin").click()
            page.locator("#admin-token input").fill(TOKEN)
            page.locator("#admin-signin").click()
            expect(page.locator("#admin-console")).to_be_visible(timeout=15_000)
            page.get_by_role("tab", name="Text").click()
            page.locator("#text-input textarea").fill("a message the model takes its time over")
            model.gated = True
            page.locator("#text-submit").click()
            flood(server.url, FLOOD_CALLS)
            assert len(queue.pending_messages_per_session) == 2000  # Gradio's table is full
            model.gate.set()
            expect(page.locator("#text-label").get_by_role("heading")).to_have_text("alpha", timeout=30_000)
            page.get_by_role("tab", name="Admin").click()
            page.locator("#admin-refresh").click()
            expect(page.locator("#admin-cards")).to_contain_text("Hit rate", timeout=15_000)
            expect(page.locator("body")).not_to_contain_text("404")
            expect(page.locator("#admin-console")).to_be_visible()
            assert not errors, errors
        finally:
            model.gate.set()
            browser.close()


def flood(url: str, calls: int) -> None:
    """`calls` session-less calls that reach Gradio (an extra item: not the shortcut's), never read."""

    def send(count: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(count):
                queued = http.post("/gradio_api/call/classify_text", json={"data": [CACHED, "extra"]})
                assert queued.status_code == 200, queued.text

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(send, [calls // 4 + (i < calls % 4) for i in range(4)]))
