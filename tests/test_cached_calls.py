"""The cached-call shortcut (ui.cached_calls): Gradio's two-step API answered without
Gradio for cached inputs, exactly as Gradio answers; everything else left to Gradio."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gradio_client import Client
from starlette.routing import Mount

from bench.gradio_http import GradioHttpClient, Reply
from storage.embedded_redis import free_port
from tests.conftest import CountingTextModel
from ui.cached_calls import PENDING_CAPACITY, PENDING_TTL_S, CachedCalls
from ui.server import BackgroundServer, build_app

VOLATILE = {"latency_ms", "age_s"}


@pytest.fixture
def serve_shortcut(make_runtime) -> Iterator[Callable[..., tuple[str, CachedCalls]]]:
    """Serve an app from `make_runtime(**args)`; its URL and its cached-call shortcut."""
    servers: list[BackgroundServer] = []

    def start(**runtime_args: Any) -> tuple[str, CachedCalls]:
        app = build_app(make_runtime(**runtime_args))
        servers.append(BackgroundServer(app, port=free_port()).start())
        return servers[-1].url, next(r.app for r in app.routes if isinstance(r, Mount))

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
        assert miss[1]["tier"] == "miss" and shortcut.answered == 0  # a miss is Gradio's
        hit = http.call("classify_text", ["Where is my parcel?  "]).outputs
    assert shortcut.answered == 1 and model.calls == 1
    # The same hit through Gradio's own queue probe (gradio_client speaks the /queue protocol).
    label, info = Client(url + "/", verbose=False).predict("Where is my parcel?", api_name="/classify_text")
    assert info["tier"] == "l1" and shortcut.answered == 1
    assert hit[0] == miss[0]  # the rendered gr.Label value
    assert label == miss[0]
    assert stable(hit[1]) == {**stable(miss[1]), "tier": "l1"} == stable(info)


def test_misses_and_bad_input_reach_gradio_with_their_body(serve_shortcut) -> None:
    url, shortcut = serve_shortcut(models={"text": CountingTextModel()})
    with GradioHttpClient(url, timeout_s=30.0, session_hash="tab-1") as http:
        first = http.call("classify_text", ["a brand new message"])
        empty = http.call("classify_text", ["   "])
        wrong_shape = http.call("classify_text", ["a", "b"])
    assert first.outputs[1]["tier"] == "miss"
    assert empty.event == "error" and "empty" in (empty.error_message or "").lower()
    assert wrong_shape.outputs[1]["tier"] == "miss"  # Gradio ignores the extra item; not ours
    assert shortcut.answered == 0


def test_a_cached_upload_is_answered_and_only_real_uploads_are_read(
    serve_shortcut, real_models, photo_bytes
) -> None:
    url, shortcut = serve_shortcut(models=real_models)
    with GradioHttpClient(url, timeout_s=60.0) as http:
        photo = http.upload_file("chelsea.png", photo_bytes("chelsea.png"), "image/png")
        miss = http.call("classify_image", [photo]).outputs
        again = http.upload_file("chelsea.png", photo_bytes("chelsea.png"), "image/png")
        hit = http.call("classify_image", [again]).outputs
        assert shortcut.answered == 1
        assert hit[0] == miss[0] and hit[1]["tier"] == "l1" and hit[1]["key"] == miss[1]["key"]
        # A path the app never received: the shortcut leaves it to Gradio, which refuses it.
        forged = dict(again, path=str(Path(__file__).resolve()))
        refused: Reply = http.call("classify_image", [forged])
    assert refused.status == 400 and shortcut.answered == 1


def test_unread_answers_are_bounded(serve_shortcut) -> None:
    clock = [0.0]
    _, served = serve_shortcut(models={"text": CountingTextModel()})
    shortcut = CachedCalls(served.gradio_app, served._engine, {}, clock=lambda: clock[0])
    for i in range(PENDING_CAPACITY + 10):
        shortcut._remember(f"event-{i}", b"[]")
    assert len(shortcut._pending) == PENDING_CAPACITY and "event-0" not in shortcut._pending
    clock[0] = PENDING_TTL_S + 1
    shortcut._remember("late", b"[]")
    assert list(shortcut._pending) == ["late"]




def test_calls_gradio_would_fail_with_a_500_are_refused_with_400(serve_shortcut, real_models, caplog) -> None:
    url, shortcut = serve_shortcut(models=real_models)
    file_ref = {"_type": "gradio.FileData"}
    refused = {
        "classify_text": [b'{"data": []}', b'{"data": "abc"}', b'[1]', b'{"data": ["\xff"]}', b"[" * 20_000],
        "classify_image": [
            b'{"data": [5]}',
            b'{"data": ["/etc/passwd"]}',
            b'{"data": ["data:image/png;base64,iVBORw0KGgo="]}',
            json.dumps({"data": [{"path": 5, "meta": file_ref}]}).encode(),
        ],
    }
    caplog.set_level(logging.WARNING, logger="ui.cached_calls")
    with httpx.Client(base_url=url, timeout=30) as http:
        for api_name, bodies in refused.items():
            for body in bodies:
                reply = http.post(f"/gradio_api/call/{api_name}", content=body,
                                  headers={"content-type": "application/json"})  # fmt: skip
                assert reply.status_code == 400, (api_name, body[:40], reply.text)
                assert reply.json()["detail"] and "Traceback" not in reply.text
        # Still serving, and Gradio's own leniency kept: a number is a message to its Textbox.
        with GradioHttpClient(url, timeout_s=30.0) as client:
            answered = client.call("classify_text", ["Where is my parcel?"]).outputs
            lenient = client.call("classify_text", [12345])
    assert answered[1]["tier"] == "miss" and lenient.event == "complete"
    warnings = [r for r in caplog.records if "refused a call" in r.getMessage()]
    assert len(warnings) == sum(len(bodies) for bodies in refused.values())
    assert shortcut.answered == 0


def test_an_unknown_api_name_is_404(serve_shortcut) -> None:
    url, _ = serve_shortcut(models={"text": CountingTextModel()})
    with httpx.Client(base_url=url, timeout=30) as http:
        unknown = http.post("/gradio_api/call/classify_nope", json={"data": ["hello"]})
        known = http.post("/gradio_api/call/classify_text", json={"data": ["hello"]})
    assert unknown.status_code == 404 and "/gradio_api/info" in unknown.json()["detail"]
    assert known.status_code == 200 and known.json()["event_id"]
