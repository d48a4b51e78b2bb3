"""The cached-call shortcut (ui.cached_calls): Gradio's two-step API answered without
Gradio for cached inputs, exactly as Gradio answers; everything else left to Gradio.
(tests/test_gradio_differential.py compares it with plain Gradio request by request.)"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gradio.server_messages import HeartbeatMessage
from gradio_client import Client
from sqlalchemy import select

from storage.redis.embedded import free_port
from storage.sql import RequestRow, make_engine
from testing.gradio_http import GradioHttpClient, Reply, parse_event_stream
from testing.raw_http import exchange
from tests.conftest import CountingTextModel
from ui.cached_calls import PENDING_CAPACITY, PENDING_TTL_S, CachedCalls
from ui.call_protocol import RefusalLog
from ui.server import BackgroundServer, build_app, serve_runtime

VOLATILE = {"latency_ms", "age_s"}


@pytest.fixture
def serve_shortcut(make_runtime) -> Iterator[Callable[..., tuple[str, CachedCalls]]]:
    """Serve an app from `make_runtime(**args)`; its URL and its cached-call shortcut."""
    servers: list[BackgroundServer] = []

    def start(**runtime_args: Any) -> tuple[str, CachedCalls]:
        app = build_app(make_runtime(**runtime_args))
        servers.append(BackgroundServer(app, port=free_port()).start())
        return servers[-1].url, app.state.cached_calls

    yield start
    for server in servers:
        server.close()


def stable(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k not in VOLATILE}


def test_a_cached_message_is_answered_as_gradio_answers_it(serve_shortcut) -> None:
    model = CountingTextModel()
    url, shortcut = serve_shortcut(models={"text": model})
    with GradioHttpClient(url, timeout_s=30.0) as http:
        miss = http.call("classify_text", ["Where is my parcel?"]).outputs
        assert miss[1]["tier"] == "miss" and shortcut.answered == 1  # computed here: the queue is empty
        hit = http.call("classify_text", ["Where is my parcel?  "]).outputs
        # The "Use via API" snippet: named parameters, and its GET under /call/v2 too.
        v2 = "/gradio_api/call/v2/classify_text"
        queued = http.http.post(v2, json={"message": "Where is my parcel?"})
        named = parse_event_stream(http.http.get(f"{v2}/{queued.json()['event_id']}").text)
    assert shortcut.answered == 3 and model.calls == 1
    # The same hit through Gradio's own queue probe (gradio_client speaks the /queue protocol).
    label, info = Client(url + "/", verbose=False).predict("Where is my parcel?", api_name="/classify_text")
    assert info["tier"] == "l1" and shortcut.answered == 3
    assert hit[0] == miss[0]  # the rendered gr.Label value
    assert label == miss[0]
    assert stable(hit[1]) == {**stable(miss[1]), "tier": "l1"} == stable(info)
    assert named is not None and named[0] == "complete" and named[1][0] == hit[0]
    assert stable(named[1][1]) == stable(hit[1])


def queued_calls(queue: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The calls pushed into Gradio's `queue` from now on."""
    pushed: list[Any] = []
    push = queue.push

    async def counted(body: Any, *args: Any, **kwargs: Any) -> Any:
        pushed.append(body)
        return await push(body, *args, **kwargs)

    monkeypatch.setattr(queue, "push", counted)
    return pushed


def test_a_miss_is_computed_here_while_the_queue_is_empty_and_bad_input_reaches_gradio(
    serve_shortcut, monkeypatch
) -> None:
    model = CountingTextModel()
    url, shortcut = serve_shortcut(models={"text": model})
    queued = queued_calls(shortcut._blocks._queue, monkeypatch)
    with GradioHttpClient(url, timeout_s=30.0, session_hash="tab-1") as http:
        first = http.call("classify_text", ["a brand new message"])
        empty = http.call("classify_text", ["   "])
        assert shortcut.answered == 2 and not queued and model.calls == 1  # neither went through the queue
        wrong_shape = http.call("classify_text", ["a", "b"])
    assert first.outputs[1]["tier"] == "miss" and len(queued) == 1
    # The engine's refusal, as Gradio's queued call streams a gr.Error: its words and title.
    assert empty.event == "error" and "empty" in (empty.error_message or "").lower()
    assert wrong_shape.outputs[1]["tier"] == "miss"  # Gradio ignores the extra item; not ours
    assert shortcut.answered == 2 and model.calls == 2


def test_a_miss_waits_its_turn_in_gradios_queue_when_calls_wait_there(serve_shortcut, monkeypatch) -> None:
    """Computed here only when Gradio's queue would start the call at once: with calls
    waiting in it, or its lane full, a miss goes through the queue (no one is overtaken)."""
    model = CountingTextModel()
    url, shortcut = serve_shortcut(models={"text": model})
    queue = shortcut._blocks._queue
    with GradioHttpClient(url, timeout_s=30.0) as http:
        with monkeypatch.context() as patched:
            patched.setattr(type(queue), "__len__", lambda self: 1)  # a call waits in the queue
            queued = queued_calls(queue, patched)
            waited = http.call("classify_text", ["a message behind another"])
        assert shortcut.answered == 0 and len(queued) == 1 and waited.outputs[1]["tier"] == "miss"
        event = next(fn for fn in shortcut._blocks.fns.values() if fn.api_name == "classify_text")
        shortcut._computing[event.concurrency_id] = queue.event_queue_per_concurrency_id[
            event.concurrency_id
        ].concurrency_limit  # its lane is full
        full = http.call("classify_text", ["a message while the lane is full"])
        hit = http.call("classify_text", ["a message behind another"])  # a hit is answered anyway
        shortcut._computing.clear()
        computed = http.call("classify_text", ["a message once the lane has room"])
    assert full.outputs[1]["tier"] == "miss" and hit.outputs[1]["tier"] == "l1"
    assert computed.outputs[1]["tier"] == "miss" and shortcut.answered == 2 and model.calls == 3


def test_a_cached_upload_is_answered_and_only_real_uploads_are_read(
    serve_shortcut, real_models, photo_bytes
) -> None:
    url, shortcut = serve_shortcut(models=real_models)
    with GradioHttpClient(url, timeout_s=60.0) as http:
        photo = http.upload_file("chelsea.png", photo_bytes("chelsea.png"), "image/png")
        miss = http.call("classify_image", [photo]).outputs
        again = http.upload_file("chelsea.png", photo_bytes("chelsea.png"), "image/png")
        hit = http.call("classify_image", [again]).outputs
        assert shortcut.answered == 2  # the miss computed here too: the queue was empty
        assert hit[0] == miss[0] and hit[1]["tier"] == "l1" and hit[1]["key"] == miss[1]["key"]
        # A path the app never received: the shortcut leaves it to Gradio, which refuses it.
        forged = dict(again, path=str(Path(__file__).resolve()))
        refused: Reply = http.call("classify_image", [forged])
    assert refused.status == 400 and shortcut.answered == 2


def test_unread_answers_are_bounded(serve_shortcut) -> None:
    clock = [0.0]
    _, served = serve_shortcut(models={"text": CountingTextModel()})
    shortcut = CachedCalls(served._gradio_app, served._engine, {}, clock=lambda: clock[0])
    for i in range(PENDING_CAPACITY + 10):
        shortcut._remember(f"event-{i}", b"[]")
    assert len(shortcut._pending) == PENDING_CAPACITY and "event-0" not in shortcut._pending
    clock[0] = PENDING_TTL_S + 1
    shortcut._remember("late", b"[]")
    assert list(shortcut._pending) == ["late"]


def test_an_unknown_api_name_is_404(serve_shortcut) -> None:
    url, _ = serve_shortcut(models={"text": CountingTextModel()})
    with httpx.Client(base_url=url, timeout=30) as http:
        unknown = http.post("/gradio_api/call/classify_nope", json={"data": ["hello"]})
        known = http.post("/gradio_api/call/classify_text", json={"data": ["hello"]})
    assert unknown.status_code == 404 and "/gradio_api/info" in unknown.json()["detail"]
    assert known.status_code == 200 and known.json()["event_id"]


def test_refusals_are_logged_once_per_client_per_minute(serve_shortcut, caplog) -> None:
    clock = [0.0]
    logger = logging.getLogger("test.refusals")
    refusals = RefusalLog(logger, clock=lambda: clock[0])
    caplog.set_level(logging.WARNING, logger="test.refusals")
    for _ in range(5):
        refusals.refused("10.0.0.1", "a bad call")
    refusals.refused("10.0.0.2", "a bad call")
    clock[0] = 61.0
    refusals.refused("10.0.0.1", "a bad call")
    lines = [r.getMessage() for r in caplog.records if r.name == "test.refusals"]
    assert lines == [
        "refused a bad call from 10.0.0.1",
        "refused a bad call from 10.0.0.2",
        "refused a bad call from 10.0.0.1 (4 more refused since the last line)",
    ]
    # Served: 40 result streams of unknown event ids from one client, one line.
    url, _ = serve_shortcut(models={"text": CountingTextModel()})
    caplog.set_level(logging.WARNING, logger="ui.cached_calls")
    with httpx.Client(base_url=url, timeout=10) as http:
        streams = [http.get(f"/gradio_api/call/classify_text/{i:032x}").text for i in range(40)]
    assert all(stream == 'event: error\ndata: "404: Not Found"\n\n' for stream in streams)
    logged = [r for r in caplog.records if r.name == "ui.cached_calls"]
    assert len(logged) == 1 and "unknown event id" in logged[0].getMessage() and not logged[0].exc_info


def test_a_stream_whose_session_goes_away_ends_cleanly(serve_shortcut, capfd) -> None:
    """A client reads the stream of a call still running when the call's session queue is
    evicted (a full table, ui.lean_sessions.SessionQueues): Gradio sends its 404 event, then
    raises into a response already started. The client gets the event and a clean end, and
    no traceback is logged."""
    url, shortcut = serve_shortcut(models={"text": CountingTextModel(delay_s=1.0)})
    shortcut._lane_free = lambda api: False  # the miss goes through Gradio's queue (as when calls wait)
    table = shortcut._blocks._queue.pending_messages_per_session
    capfd.readouterr()
    with httpx.Client(base_url=url, timeout=30) as http:
        call = "/gradio_api/call/classify_text"
        event_id = http.post(call, json={"data": ["a slow miss"]}).json()["event_id"]
        with http.stream("GET", f"{call}/{event_id}") as stream:
            messages = table[event_id]
            table.evict(event_id)
            messages.put_nowait(HeartbeatMessage())  # wakes the stream, as Gradio's heartbeat task may
            text = stream.read().decode()
        time.sleep(1.5)  # the call finishes meanwhile: it must not post into the queue that is gone
    assert text.endswith('event: error\ndata: "404: Not Found"\n\n'), text
    assert "Traceback" not in capfd.readouterr().err


CROSS_SITE_CALLS_JS = """async ({api, messages}) => {
    const results = [];
    for (const [route, body] of messages) {
        try {
            const queued = await fetch(`${api}/gradio_api/call/${route}`, {
                method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
            const {event_id} = await queued.json();
            const stream = await fetch(`${api}/gradio_api/call/${route}/${event_id}`);
            results.push(await stream.text());
        } catch (error) {
            results.push(`failed: ${error}`);
        }
    }
    return results;
}"""


@pytest.mark.browser
def test_a_page_on_another_site_reads_cached_answers(serve_shortcut) -> None:
    """In Chromium, a page on another origin calls the API of a Space (a Host that is not
    localhost, so Gradio's CORS rule allows it): cached answers pass CORS as Gradio's do."""
    from playwright.sync_api import sync_playwright

    url, shortcut = serve_shortcut(models={"text": CountingTextModel()})
    port = url.rsplit(":", 1)[1]
    space, page_origin = f"http://myspace.test:{port}", f"http://othersite.test:{port}"
    message = "Where is my parcel?"
    calls = [["classify_text", {"data": [message]}], ["classify_text", {"data": [message]}],
             ["v2/classify_text", {"message": message}]]  # fmt: skip
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--host-resolver-rules=MAP myspace.test 127.0.0.1, MAP othersite.test 127.0.0.1"],
        )  # fmt: skip
        try:
            page = browser.new_page()
            # Another origin (another host name), served from loopback so that Chromium lets it
            # reach a loopback address at all (Private Network Access).
            page.goto(f"{page_origin}/healthz")
            results = page.evaluate(CROSS_SITE_CALLS_JS, {"api": space, "messages": calls})
        finally:
            browser.close()
    finals = [parse_event_stream(text) if not text.startswith("failed") else text for text in results]
    assert [f[0] if isinstance(f, tuple) else f for f in finals] == ["complete"] * 3, results
    assert [f[1][1]["tier"] for f in finals] == ["miss", "l1", "l1"]
    assert shortcut.answered == 3  # the calls, both routes, answered in front of Gradio (its queue was empty)


def _call(sock: socket.socket, message: str) -> tuple[tuple[list[bytes], bytes], tuple[list[bytes], bytes]]:
    """POST /gradio_api/call/classify_text and the GET of its stream, as raw HTTP."""
    body = json.dumps({"data": [message]}).encode()
    head = b"POST /gradio_api/call/classify_text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    queued = exchange(sock, head + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    event_id = json.loads(queued[1])["event_id"].encode()
    stream = exchange(sock, b"GET /gradio_api/call/classify_text/%b HTTP/1.1\r\nHost: x\r\n\r\n" % event_id)
    return queued, stream


def _same_but_volatile(answer: tuple[list[bytes], bytes]) -> tuple[list[bytes], bytes]:
    """An answer with what differs between two answers of one hit masked: the date, the event
    id (and the lengths that follow from them), the latency and the age."""
    lines, body = answer
    lines = [line.split(b":")[0] if line.lower().startswith((b"date:", b"content-length:")) else line
             for line in lines]  # fmt: skip
    body = re.sub(rb'"event_id":"[0-9a-f]{32}"', b'"event_id":"-"', body)
    body = re.sub(rb'"(latency_ms|age_s)": [0-9.e-]+', rb'"\1": 0', body)
    return lines, re.sub(rb"\r\n[0-9a-f]+\r\n", b"\r\n-\r\n", b"\r\n" + body)


def test_a_cached_call_is_answered_at_once_as_through_the_app(make_runtime, monkeypatch) -> None:
    """The server's protocol asks the shortcut's answer_now for a call's POST and GET before
    it makes a task (ui.limits, through ui.startup.ServingApp): a hit and its stream are
    answered there, the same bytes as through the app; the hit is in the request log and the
    metrics; a miss, and any request with an Origin, go through the app."""
    from ui.limits import LimitedHttpToolsProtocol

    runtime = make_runtime()
    server = serve_runtime(runtime, port=free_port())
    try:
        shortcut = server.app._app.state.cached_calls
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            miss = _call(sock, "Where is my parcel?")
            # The miss is computed by the shortcut in the app's task; its GET is answered at once.
            assert shortcut.answered == shortcut.answered_now == 1 and b'"tier": "miss"' in miss[1][1]
            hit = _call(sock, "Where is my parcel?")
            assert shortcut.answered == 2 and shortcut.answered_now == 3  # the POST and the GET
        monkeypatch.setattr(LimitedHttpToolsProtocol, "answer_at_once", False)  # each new connection
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            through_app = _call(sock, "Where is my parcel?")
        monkeypatch.setattr(LimitedHttpToolsProtocol, "answer_at_once", True)
        assert shortcut.answered == 3 and shortcut.answered_now == 3
        assert hit[0][0][0] == b"HTTP/1.1 200 OK" and b"transfer-encoding: chunked" in hit[1][0]
        assert b'"tier": "l1"' in hit[1][1]
        assert [_same_but_volatile(a) for a in hit] == [_same_but_volatile(a) for a in through_app]
        with httpx.Client(
            base_url=server.url, timeout=10, headers={"origin": "http://localhost:3000"}
        ) as http:
            queued = http.post("/gradio_api/call/classify_text", json={"data": ["Where is my parcel?"]})
            stream = http.get(f"/gradio_api/call/classify_text/{queued.json()['event_id']}")
        assert stream.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert shortcut.answered == 4 and shortcut.answered_now == 3  # CORS: through the app
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.close()
    gradio_hits = [line for line in metrics.splitlines() if line.startswith("infcache_requests_total{")
                   and 'route="gradio"' in line and 'tier="l1"' in line]  # fmt: skip
    assert len(gradio_hits) == 1 and gradio_hits[0].endswith(" 3.0"), metrics
    runtime.log_writer.flush()
    db = make_engine(runtime.settings.effective_database_url)
    try:
        with db.connect() as conn:
            rows = conn.execute(select(RequestRow.route, RequestRow.tier).order_by(RequestRow.id)).all()
    finally:
        db.dispose()
    assert [tuple(row) for row in rows] == [("gradio", "miss")] + [("gradio", "l1")] * 3
