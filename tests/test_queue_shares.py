"""Queue places per client (ui.queue_shares): a flood of calls from one address, abandoned
(never fetched), leaves room in Gradio's queue for everyone else. Real models, default
settings, the app served over HTTP; the flood and the visitor come from different loopback
addresses, as two people would. A pass that holds a flood message takes a quarter of a second
longer, as on a busier server: the real model keeps up with this flood on 2 cores (every call
answered in its POST), and the queue would never be reached."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from runtime import Runtime
from settings import Settings
from tests.conftest import free_port
from ui.queue_shares import share_of_places
from ui.server import QUEUE_MAX_SIZE, serve_runtime

FLOODER, VISITOR = "127.0.0.2", "127.0.0.3"
FLOOD_THREADS = 24
FLOOD_PASS_DELAY_S = 0.25
CALL = "/gradio_api/call/classify_text"


def test_a_share_leaves_room_for_a_newcomer_whatever_the_number_of_clients() -> None:
    for clients in range(1, QUEUE_MAX_SIZE):
        taken = clients * share_of_places(QUEUE_MAX_SIZE, clients - 1)
        assert taken < QUEUE_MAX_SIZE, clients
    assert share_of_places(QUEUE_MAX_SIZE, 0) == QUEUE_MAX_SIZE // 2  # alone: half the queue


class SlowFloodPasses:
    """The real text model; a pass with a flood message in it waits FLOOD_PASS_DELAY_S first."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def predict_batch(self, inputs: Sequence[Any]) -> Any:
        if any(item.text.startswith("flood ") for item in inputs):
            time.sleep(FLOOD_PASS_DELAY_S)
        return self._model.predict_batch(inputs)


@pytest.fixture
def default_server(make_runtime, real_models) -> Iterator[tuple[str, Runtime]]:
    defaults = Settings.from_env({})
    models = {**real_models, "text": SlowFloodPasses(real_models["text"])}
    runtime = make_runtime(models=models, fairness__client_miss_rate=defaults.fairness.client_miss_rate,
                           fairness__client_miss_burst=defaults.fairness.client_miss_burst)  # fmt: skip
    server = serve_runtime(runtime, port=free_port())
    yield server.url, runtime
    server.close()


def _client(url: str, source: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(local_address=source))


def _answer(http: httpx.Client, text: str) -> tuple[int, str]:
    """A two-step call fetched as a visitor's would be: the POST's status, then the event."""
    post = http.post(CALL, json={"data": [text]})
    if post.status_code != 200:
        return post.status_code, post.text
    stream = http.get(f"{CALL}/{post.json()['event_id']}")
    return 200, stream.text.split("\n", 1)[0]


def test_a_flood_of_abandoned_calls_from_one_address_leaves_room_for_others(default_server) -> None:
    url, _runtime = default_server
    with _client(url, VISITOR) as visitor:
        assert _answer(visitor, "Where is my parcel?") == (200, "event: complete")  # now cached
    stop = threading.Event()
    flood: Counter[int] = Counter()

    def flooder() -> None:
        with _client(url, FLOODER) as http:
            while not stop.is_set():  # new messages, posted and never fetched
                flood[http.post(CALL, json={"data": [f"flood {uuid.uuid4().hex}"]}).status_code] += 1

    threads = [threading.Thread(target=flooder, daemon=True) for _ in range(FLOOD_THREADS)]
    for thread in threads:
        thread.start()
    visits: list[tuple[int, str]] = []
    try:
        deadline = time.monotonic() + 60
        with _client(url, VISITOR) as visitor:
            while flood[503] < 50 and time.monotonic() < deadline:  # the flood holds its whole share
                time.sleep(0.2)
            for n in range(10):
                visits.append(_answer(visitor, "Where is my parcel?"))  # cached
                visits.append(_answer(visitor, f"A new question number {n}: {uuid.uuid4().hex}"))
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    # The flood did reach its share of the queue (the wait above wants 50; a slow machine posts fewer).
    assert flood[503] >= 10, flood
    assert flood[200] > 0, flood
    assert visits == [(200, "event: complete")] * 20, [v for v in visits if v != (200, "event: complete")]
