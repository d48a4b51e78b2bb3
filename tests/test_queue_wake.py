"""Gradio's queue loops woken by work (ui.queue_wake): idle, they look for work a few times a
second instead of 1,100; queued calls still start at once, and a running call's progress is
still sent."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time

import gradio as gr
from gradio.queueing import Queue
from gradio_client import Client

from storage.redis.embedded import free_port
from testing.gradio_http import GradioHttpClient
from tests.conftest import CountingTextModel
from ui import queue_wake
from ui.queue_wake import WokenQueue
from ui.server import BackgroundServer, build_app

# gradio.queueing.Queue.start_processing as copied into WokenQueue (gradio==6.31.0).
GRADIO_LOOP_SHA256 = "d65be5a5cbed97d75e13233ab7d0dfc9f347c4ffd33bdcb47293d696f38aaa1f"
# gradio.queueing.Queue.start_progress_updates as copied into WokenQueue.
GRADIO_PROGRESS_LOOP_SHA256 = "7cbbec1cf932324cd2fc80791130a2cf1ad7d31e42aead9798abc4e51d9e2823"


def test_the_copied_loops_are_gradios() -> None:
    for method, digest in ((Queue.start_processing, GRADIO_LOOP_SHA256),
                           (Queue.start_progress_updates, GRADIO_PROGRESS_LOOP_SHA256)):  # fmt: skip
        source = inspect.getsource(method)
        assert hashlib.sha256(source.encode()).hexdigest() == digest, (
            f"Gradio's {method.__name__} changed: bring ui.queue_wake.WokenQueue's copy up to date"
        )


def test_a_wakeup_set_before_the_wait_ends_it_at_once_and_one_never_set_times_out() -> None:
    async def run() -> tuple[float, float, float]:
        wakeup = queue_wake.Wakeup()
        wakeup.set()
        started = time.perf_counter()
        await wakeup.wait(5.0)  # set since the last clear: at once
        early = time.perf_counter() - started
        asyncio.get_running_loop().call_later(0.05, wakeup.set)
        started = time.perf_counter()
        await wakeup.wait(5.0)  # set while waiting
        woken = time.perf_counter() - started
        started = time.perf_counter()
        await wakeup.wait(0.1)  # cleared by the last wait, never set: the timeout
        return early, woken, time.perf_counter() - started

    early, woken, timed_out = asyncio.run(run())
    assert early < 0.05 and 0.04 < woken < 1.0 and 0.09 < timed_out < 1.0, (early, woken, timed_out)


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
        before, progress_before = loop.wakeups, loop.progress_wakeups
        time.sleep(1.0)
        idle, progress_idle = loop.wakeups - before, loop.progress_wakeups - progress_before
        assert idle <= 2, idle  # Gradio's own loop: about 1,000 a second
        assert progress_idle <= 2, progress_idle  # Gradio's progress loop: about 100 a second
        started = time.perf_counter()
        for i in range(5):  # misses: each is queued, and must start without waiting out a sleep
            assert http.call("classify_text", [f"a new message {i}"]).outputs[1]["tier"] == "miss"
        elapsed = time.perf_counter() - started
    assert model.calls == 5
    assert elapsed < 2.5, elapsed  # five misses of 0.05 s each, none waiting out 5 s


def test_a_running_calls_progress_is_still_sent(monkeypatch) -> None:
    """The progress loop wakes when a call starts and sends its progress as Gradio's does."""
    monkeypatch.setattr(queue_wake, "PROGRESS_MAX_WAIT_S", 30.0)  # only a started job may wake it

    def count(steps: float, progress: gr.Progress = gr.Progress()) -> str:  # noqa: B008 (Gradio's idiom)
        for _ in progress.tqdm(range(int(steps)), desc="counting"):
            time.sleep(0.05)
        return "done"

    with gr.Blocks() as demo:
        steps, out = gr.Number(value=8), gr.Textbox()
        gr.Button().click(count, steps, out, api_name="count")
    demo.queue()
    woken = WokenQueue(demo._queue)
    woken.install()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(),
                        quiet=True)  # fmt: skip
    try:
        client = Client(demo.local_url, verbose=False)
        job = client.submit(8, api_name="/count")
        seen: list[tuple[int, int]] = []
        while not job.done():
            status = job.status()
            for unit in status.progress_data or []:
                if unit.index is not None and unit.length is not None:
                    seen.append((unit.index, unit.length))
            time.sleep(0.02)
        assert job.result() == "done"
        client.close()
    finally:
        demo.close()
    assert seen and all(length == 8 for _, length in seen), seen
    assert len({index for index, _ in seen}) >= 2, seen  # updates while it ran, not only one
    assert woken.progress_wakeups >= 2  # the loop sent them
