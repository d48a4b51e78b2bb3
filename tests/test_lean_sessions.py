"""ui/lean_sessions.py: the Gradio internals it leans on, and what it does to a served app's memory.

Session-less calls (curl style, `bench.gradio_http.GradioHttpClient` without a session hash) must
leave no session and none of Gradio's bookkeeping behind once answered; sessions with a hash
(a browser tab, gradio_client) must keep their `gr.State` whatever the session-less load.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr
import httpx
import pytest
from gradio.state_holder import SessionState
from starlette.routing import Mount

from admin.tab import NOT_SIGNED_IN
from bench.gradio_http import GradioHttpClient, Reply
from runtime import Runtime
from tests.conftest import free_port
from ui import lean_sessions
from ui.lean_sessions import LeanSessionState, LeanStateHolder
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
    return next(r for r in app.routes if isinstance(r, Mount))


def mounted(app: Any) -> Any:
    """The Gradio app behind the cached-call shortcut (ui.cached_calls)."""
    return mount_of(app).app.gradio_app


@pytest.fixture
def served(make_runtime) -> Iterator[Served]:
    runtime = make_runtime(admin_token=TOKEN)
    app = build_app(runtime)
    # Every call through Gradio itself, cached ones included: its queue probe is what is tested.
    gradio_app = mount_of(app).app = mounted(app)
    with BackgroundServer(app, port=free_port()) as server:
        yield Served(server.url, gradio_app, runtime)


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
