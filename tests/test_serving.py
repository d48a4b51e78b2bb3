"""The serving path over HTTP: ready means ready, misses run together, hits never wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.inputs import CanonicalText
from engine.models.base import Prediction
from runtime import Runtime, build_runtime
from settings import Settings
from storage.redis.embedded import EmbeddedRedis, free_port
from testing.gradio_http import GradioHttpClient
from tests.conftest import CountingTextModel
from ui.server import BackgroundServer, build_app
from ui.startup import ServingApp

WAIT_S = 60.0


def poll(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class BatchingTextModel(CountingTextModel):
    """A stand-in that batches like the real text model and records every pass's size."""

    batch_misses = True

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(delay_s=delay_s)
        self.pass_sizes: list[int] = []

    def predict_batch(self, inputs: Sequence[CanonicalText]) -> list[Prediction]:
        with self._lock:
            self.pass_sizes.append(len(inputs))
        return super().predict_batch(inputs)


class RendezvousModel(CountingTextModel):
    """A non-batching stand-in whose passes only finish when `parties` of them run at once."""

    def __init__(self, parties: int) -> None:
        super().__init__(cheap=False)
        self.barrier = threading.Barrier(parties, timeout=20)

    def predict_batch(self, inputs: Sequence[CanonicalText]) -> list[Prediction]:
        self.barrier.wait()  # BrokenBarrierError (a model error) unless enough passes overlap
        return super().predict_batch(inputs)


def call_text(url: str, message: str, session_hash: str | None = None) -> dict[str, Any]:
    with GradioHttpClient(url, session_hash=session_hash) as client:
        return client.call("classify_text", [message]).outputs[1]


# ---- ready means ready ------------------------------------------------------------


class GatedStart:
    """build_runtime that waits for `release` (the models "loading") and records closing."""

    def __init__(self, make: Callable[[Settings], Runtime]) -> None:
        self.release = threading.Event()
        self.runtimes: list[Runtime] = []
        self.started_calls = 0  # ServingApp's on_started: once start-up is over (app.py's collector)
        self._make = make

    def started(self) -> None:
        self.started_calls += 1

    def __call__(self, settings: Settings) -> Runtime:
        if not self.release.wait(WAIT_S):
            raise RuntimeError("never released")
        runtime = self._make(settings)
        self.runtimes.append(runtime)
        return runtime


@pytest.fixture
def gated_server(base_settings: Settings, tmp_path: Path) -> Iterator[tuple[str, GatedStart, ServingApp]]:
    settings = base_settings.changed(server__data_dir=tmp_path / "gated")
    gate = GatedStart(lambda s: build_runtime(s, models={"text": CountingTextModel()}))
    serving = ServingApp(settings, build_runtime=gate, build_app=build_app, on_started=gate.started)
    server = BackgroundServer(serving, port=free_port()).start()
    try:
        yield server.url, gate, serving
    finally:
        gate.release.set()
        server.close()


def test_listens_before_models_load_and_is_ready_only_after(gated_server) -> None:
    url, gate, serving = gated_server
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/healthz").status_code == 200
        assert http.get("/v2/health/live").status_code == 200
        for path in ("/readyz", "/v2/health/ready", "/v2/models/text/ready"):
            response = http.get(path)
            assert response.status_code == 503, path
            assert response.headers["retry-after"]
        refused = http.post("/v2/models/text/infer", json={"inputs": []})
        assert refused.status_code == 503 and "error" in refused.json()
        page = http.get("/")
        assert page.status_code == 200 and 'id="loading-notice"' in page.text
        assert http.post("/gradio_api/call/classify_text", json={"data": ["hi"]}).status_code == 503
        assert gate.started_calls == 0

        gate.release.set()
        poll(lambda: http.get("/readyz").status_code == 200, "/readyz to turn 200")
        assert gate.started_calls == 1
        assert http.get("/v2/health/ready").status_code == 200
        assert 'id="loading-notice"' not in http.get("/").text
        assert http.get("/docs").status_code == 200  # API paths reach the FastAPI routes
    assert call_text(url, "where is my order")["tier"] == "miss"
    runtime = gate.runtimes[0]
    assert serving.runtime is runtime


def test_shutdown_closes_the_runtime_it_built(base_settings: Settings, tmp_path: Path) -> None:
    closed = threading.Event()

    def make(settings: Settings) -> Runtime:
        runtime = build_runtime(settings, models={"text": CountingTextModel()})
        runtime._stack.callback(closed.set)
        return runtime

    settings = base_settings.changed(server__data_dir=tmp_path / "s")
    serving = ServingApp(settings, build_runtime=make, build_app=build_app)
    with BackgroundServer(serving, port=free_port()) as server:
        poll(lambda: httpx.get(server.url + "/readyz").status_code == 200, "ready")
    assert closed.is_set()


def test_failed_start_is_reported_not_hidden(base_settings: Settings, tmp_path: Path) -> None:
    failures: list[BaseException] = []

    def broken(_settings: Settings) -> Runtime:
        raise RuntimeError("weights missing")

    started: list[bool] = []  # on_started, and whether the failure was known by then
    serving = ServingApp(
        base_settings.changed(server__data_dir=tmp_path / "f"), build_runtime=broken, build_app=build_app,
        on_failure=failures.append, on_started=lambda: started.append(bool(failures)),
    )  # fmt: skip
    with BackgroundServer(serving, port=free_port()) as server:
        poll(lambda: bool(failures), "the failure callback")
        response = httpx.get(server.url + "/readyz")
        assert response.status_code == 503 and response.json()["status"] == "failed"
        assert httpx.get(server.url + "/").status_code == 503
    assert str(failures[0]) == "weights missing"
    assert started == [True]  # a failed start-up is over too: the collector runs again


def test_ready_waits_for_redis_then_shares_it(
    base_settings: Settings, redis_binary: str, tmp_path: Path
) -> None:
    port = free_port()
    redis = EmbeddedRedis(data_dir=tmp_path / "late-redis", maxmemory_mb=16, binary=redis_binary, port=port,
                          save=False)  # fmt: skip
    settings = base_settings.changed(
        server__data_dir=tmp_path / "r", redis__url=f"redis://127.0.0.1:{port}/0",
        server__ready_l2_wait_s=WAIT_S,
    )  # fmt: skip
    serving = ServingApp(
        settings, build_runtime=lambda s: build_runtime(s, models={"text": CountingTextModel()}),
        build_app=build_app,
    )  # fmt: skip
    with BackgroundServer(serving, port=free_port()) as server:
        poll(lambda: serving.runtime is not None, "the runtime")
        assert httpx.get(server.url + "/readyz").status_code == 503  # models up, Redis not yet
        redis.start()
        try:
            poll(lambda: httpx.get(server.url + "/readyz").status_code == 200, "ready once Redis answers")
            assert httpx.get(server.url + "/readyz").json()["l2"] == "up"
            assert call_text(server.url, "is my refund on its way")["tier"] == "miss"
            store = serving.runtime.engine.l2_store()
            assert store is not None
            poll(lambda: store.count_keys() >= 1, "the answer in Redis")
        finally:
            redis.close()


# ---- misses run together, hits never wait -------------------------------------------


def test_concurrent_text_misses_share_forward_passes_through_http(serve) -> None:
    model = BatchingTextModel(delay_s=0.3)
    url, runtime = serve(models={"text": model}, models__batch_max_size=8)
    messages = [f"parcel number {i} is late" for i in range(12)]
    with ThreadPoolExecutor(len(messages)) as pool:
        infos = list(pool.map(lambda m: call_text(url, m), messages))
    assert all(info["tier"] == "miss" for info in infos)
    assert sum(model.pass_sizes) == len(messages)
    assert max(model.pass_sizes) > 1, model.pass_sizes  # one pass at a time: the rest batched
    batches = runtime.engine.cache_state()["batches"]["text"]
    assert batches["passes"] == len(model.pass_sizes) and batches["max_size"] == max(model.pass_sizes)
    metrics = httpx.get(url + "/metrics").text
    assert f'infcache_batch_size_count{{task="text"}} {float(len(model.pass_sizes))}' in metrics


def test_identical_burst_coalesces_in_the_engine(serve) -> None:
    model = BatchingTextModel(delay_s=0.5)
    url, _ = serve(models={"text": model}, models__batch_max_size=8)
    with ThreadPoolExecutor(8) as pool:
        tiers = list(pool.map(lambda _: call_text(url, "my card was charged twice")["tier"], range(8)))
    assert model.calls == 1
    assert tiers.count("miss") == 1 and "coalesced" in tiers, tiers


def test_misses_of_a_model_that_does_not_batch_run_up_to_its_limit(serve) -> None:
    model = RendezvousModel(parties=2)
    url, runtime = serve(models={"text": model}, models__miss_concurrency_cpu=2)
    assert runtime.engine.admission_limit("text") == 2
    with ThreadPoolExecutor(2) as pool:
        infos = list(pool.map(lambda m: call_text(url, m), ["first new message", "second new message"]))
    assert [info["tier"] for info in infos] == ["miss", "miss"]  # both passes met at the barrier


def test_hits_never_wait_behind_misses(serve) -> None:
    model = BatchingTextModel()
    url, _ = serve(models={"text": model}, models__batch_max_size=2)
    call_text(url, "cached already")
    model.delay_s = 3.0
    order: list[str] = []
    with ThreadPoolExecutor(4) as pool:
        misses = [
            pool.submit(lambda m=m: (call_text(url, m), order.append("miss"))) for m in ("new a", "new b")
        ]
        poll(lambda: model.calls >= 1, "a slow miss to reach the model")
        hit = call_text(url, "cached already", session_hash="browser-tab")
        order.append("hit")
        for miss in misses:
            miss.result()
    assert hit["tier"] == "l1"
    assert order[0] == "hit", order
