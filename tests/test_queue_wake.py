"""Gradio's queue loop woken by work (ui.queue_wake): idle, it looks for work a few times a
second instead of a thousand; queued calls still start at once."""

from __future__ import annotations

import hashlib
import inspect
import time

from gradio.queueing import Queue

from storage.redis.embedded import free_port
from testing.gradio_http import GradioHttpClient
from tests.conftest import CountingTextModel
from ui import queue_wake
from ui.queue_wake import WokenQueue
from ui.server import BackgroundServer, build_app

# gradio.queueing.Queue.start_processing as copied into WokenQueue (gradio==6.31.0).
GRADIO_LOOP_SHA256 = "d65be5a5cbed97d75e13233ab7d0dfc9f347c4ffd33bdcb47293d696f38aaa1f"


def test_the_copied_loop_is_gradios() -> None:
    source = inspect.getsource(Queue.start_processing)
    assert hashlib.sha256(source.encode()).hexdigest() == GRADIO_LOOP_SHA256, (
        "Gradio's queue loop changed: bring ui.queue_wake.WokenQueue.start_processing up to date"
    )


def test_an_idle_queue_sleeps_and_queued_calls_start_at_once(make_runtime, monkeypatch) -> None:
    # A long fallback wait: a call that were not woken for would wait it out, plainly.
    monkeypatch.setattr(queue_wake, "MAX_WAIT_S", 5.0)
    woken: list[WokenQueue] = []
    install = WokenQueue.install

    def kept(self: WokenQueue) -> None:
        woken.append(self)
        install(self)

    monkeypatch.setattr(WokenQueue, "install", kept)
    model = CountingTextModel(delay_s=0.05)
    app = build_app(make_runtime(models={"text": model}))
    with BackgroundServer(app, port=free_port()) as server, GradioHttpClient(server.url) as http:
        (loop,) = woken
        time.sleep(0.5)
        before = loop.wakeups
        time.sleep(1.0)
        idle = loop.wakeups - before
        assert idle <= 2, idle  # Gradio's own loop: about 1,000 a second
        started = time.perf_counter()
        for i in range(5):  # misses: each is queued, and must start without waiting out a sleep
            assert http.call("classify_text", [f"a new message {i}"]).outputs[1]["tier"] == "miss"
        elapsed = time.perf_counter() - started
    assert model.calls == 5
    assert elapsed < 2.5, elapsed  # five misses of 0.05 s each, none waiting out 5 s
