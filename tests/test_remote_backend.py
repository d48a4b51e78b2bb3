"""The remote backend against a real tritonserver (testing.triton_server) serving the repository
`make triton-repository` writes, through the real tritonclient over HTTP and gRPC: answers equal
the local model's within 1e-5, hits never reach the server, concurrent misses share calls, two
replicas on one Redis send each unique input once, a MODELS_CONFIG entry through the composition
root. Then faults, with the app served over real HTTP where the answer's form matters: a slow
server (bounded timeouts), garbage answers (refused, counted, never cached), the server killed
(misses 503 with Retry-After, hits served, the reason in /readyz and /metrics, a replica started
meanwhile loads all the same) and restarted with a new model (a new key space, service back by
itself). One server for the module: its start is most of the cost."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from engine.errors import RemoteUnavailableError
from engine.inputs import CanonicalImage
from runtime import Runtime, build_runtime, load_models
from settings import Settings
from storage.redis.embedded import EmbeddedRedis
from testing.oip_http import infer_body, parse_answer
from testing.tiny_models import write_config
from testing.triton_server import TritonRepositoryServer
from tests.test_fleet import wait_until

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-5
MESSAGES = ("where is my parcel", "I want my money back for the broken kettle",
            "how do I change my password", "cancel the order I placed this morning",
            "Ihr Paket ist unterwegs", "thanks, that was all")  # fmt: skip


@pytest.fixture(scope="module")
def triton(triton_repository: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonRepositoryServer]:  # fmt: skip
    """One server for the module, on a copy of the repository (the last test gives the text model a
    new version). The fault tests restore what they change, and the restart comes last."""
    copy = tmp_path_factory.mktemp("remote-backend") / "repository"
    shutil.copytree(triton_repository, copy)
    with TritonRepositoryServer(copy) as server:
        yield server


def test_answers_through_the_server_equal_local_answers(
    triton: TritonRepositoryServer, remote_model: Callable[..., Any], real_models: dict[str, Any]
) -> None:
    rng = np.random.default_rng(38)
    sizes = ((240, 320), (500, 300))
    images = [CanonicalImage(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    for url in (triton.http_url, triton.grpc_url):
        for task, raws in (("text", MESSAGES), ("image", images)):
            # The probe's reference: torch's answers as the local export recorded them, or (the image
            # over gRPC: no export to read) computed by torch here.
            exports = task == "text" or url == triton.http_url
            model, local = remote_model(task, url, exports=exports), real_models[task]
            assert (model.backend, model.backend_reason, model.version) == ("remote", None, local.version)
            assert (model._torch_module is None) == exports
            inputs = [model.canonicalize(raw) for raw in raws] if task == "text" else raws
            for got, want in zip(model.predict_batch(inputs), local.predict_batch(inputs), strict=True):
                assert [n for n, _ in got.labels] == [n for n, _ in want.labels], url
                pairs = zip(got.labels, want.labels, strict=True)
                assert max(abs(a - b) for (_, a), (_, b) in pairs) <= TOLERANCE


def _rows(server: TritonRepositoryServer, task: str) -> tuple[int, int]:
    counts = server.counts()
    return counts["rows"].get(task, 0), counts["requests"].get(task, 0)


def _together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls at once (a barrier releases them together)."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def test_hits_never_reach_the_server_and_concurrent_misses_share_calls(
    triton: TritonRepositoryServer, remote_model: Callable[..., Any], make_runtime: Callable[..., Runtime]
) -> None:
    model = remote_model("text", triton.grpc_url)
    runtime = make_runtime(models={"text": model})
    texts = [f"{message} (order {i})" for i, message in enumerate(MESSAGES + MESSAGES[:2])]
    rows, requests = _rows(triton, "text")
    results = _together([lambda t=t: runtime.engine.classify("text", t) for t in texts])
    assert {r.tier for r in results} == {"miss"}
    info = results[0].cache_info()
    assert (info["backend"], info["model_version"]) == ("remote", model.version)
    after_rows, after_requests = _rows(triton, "text")
    assert after_rows - rows == len(texts)  # each input reached it once
    assert after_requests - requests < len(texts)  # misses that met in one pass window shared a call
    assert runtime.engine.batch_summary()["text"]["max_size"] > 1
    again = [runtime.engine.classify("text", t) for t in texts]
    assert {r.tier for r in again} == {"l1"}
    assert [r.prediction for r in again] == [r.prediction for r in results]
    assert _rows(triton, "text") == (after_rows, after_requests)  # hits never reach the server


def test_two_replicas_in_front_of_one_server_send_each_unique_input_once(
    triton: TritonRepositoryServer, remote_model: Callable[..., Any], make_runtime: Callable[..., Runtime],
    redis_server: EmbeddedRedis,
) -> None:  # fmt: skip
    fast = {"fleet__generation_refresh_s": 0.1, "fleet__heartbeat_s": 0.1, "fleet__generation_confirm_s": 0.5}
    replicas = [
        make_runtime(models={"text": remote_model("text", url)}, redis__url=redis_server.url,
                     server__replica_id=name, **fast)
        for name, url in (("A", triton.grpc_url), ("B", triton.http_url))
    ]
    _wait_for_peers(replicas)
    texts = [f"replicas {i}: {message}" for i, message in enumerate(MESSAGES)]
    rows, _ = _rows(triton, "text")
    calls = [lambda r=r, t=t: r.engine.classify("text", t) for t in texts for r in replicas]
    results = _together(calls)
    assert _rows(triton, "text")[0] - rows == len(texts)  # one remote row per unique input, fleet-wide
    by_text: dict[str, set[Any]] = {}
    for (text, _), result in zip([(t, r) for t in texts for r in replicas], results, strict=True):
        by_text.setdefault(text, set()).add(result.prediction)
    assert all(len(answers) == 1 for answers in by_text.values())  # both replicas gave the same answer


def _wait_for_peers(replicas: list[Runtime]) -> None:
    """Each replica knows the other (a lone replica skips the fleet lease)."""
    flights = [r.engine._fleet_flight for r in replicas]
    wait_until(lambda: all(f is not None and (f.peers or 0) >= len(replicas) - 1 for f in flights), 10,
               what="the replicas seeing each other")  # fmt: skip


def test_a_models_config_entry_serves_remotely_and_a_reload_reads_the_server_again(
    triton: TritonRepositoryServer, base_settings: Settings, tmp_path: Path
) -> None:
    """The whole path: MODELS_CONFIG's entry, REMOTE_* settings, the composition root, the admin
    reload (which reads the server's version again: the same here, so nothing is swapped)."""
    config = write_config(tmp_path / "models.yaml", [
        {"task": "text", "kind": "text-classification", "source": "builtin:minilm-intents",
         "backend": "remote", "remote_url": triton.http_url, "remote_model": "text"},
    ])  # fmt: skip
    settings = base_settings.changed(server__data_dir=tmp_path / "data", models__models_config=config,
                                     remote__timeout_s=3.0)  # fmt: skip
    with build_runtime(settings, model_factory=load_models) as runtime:
        model = runtime.engine.models["text"]
        state = runtime.engine.cache_state()["models"]["text"]
        assert (state["backend"], state["backend_reason"]) == ("remote", None)
        assert state["remote"]["status"] == "ok"
        assert runtime.engine.classify("text", "where is my refund").cache_info()["backend"] == "remote"
        assert runtime.lifecycle is not None
        result = runtime.lifecycle.reload("text")
        assert (result.changed, result.version) == (False, model.version)
        assert runtime.engine.models["text"] is model and model.remote_state()["usable"]
    assert model.remote_state()["status"] == "closed"  # the runtime closed what it loaded


# ---- faults -----------------------------------------------------------------------------------

NEW_VERSION = "feedfacecafe0038"


def _running(server: TritonRepositoryServer) -> TritonRepositoryServer:
    if not server.running():
        server.start()
    return server


def _infer(url: str, text: str) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/text/infer", json=infer_body(text), timeout=30)


def _served(url: str, text: str) -> httpx.Response | None:
    response = _infer(url, text)
    return response if response.status_code == 200 else None


def _refused(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    assert "server is unavailable" in response.json()["error"]
    assert "answers already cached still work" in response.json()["error"]


def test_a_slow_server_is_given_up_within_the_timeout_and_comes_back(
    triton: TritonRepositoryServer, remote_model: Callable[..., Any], make_runtime: Callable[..., Runtime]
) -> None:
    model = remote_model("text", _running(triton).http_url, timeout_s=1.0)
    runtime = make_runtime(models={"text": model})
    runtime.engine.classify("text", "answered before the server slowed down")
    triton.set_delay(3.0)
    try:
        started = time.monotonic()
        with pytest.raises(RemoteUnavailableError) as refused:
            runtime.engine.classify("text", "a miss on a slow server")
        assert time.monotonic() - started < 3.0  # bounded: connect 0.5 s + call 1 s, not the 3 s delay
        assert refused.value.retry_after_s > 0 and model.remote_state()["status"] == "down"
        hit = runtime.engine.classify("text", "answered before the server slowed down")
        assert hit.tier == "l1"
    finally:
        triton.set_delay(0.0)
    result = wait_until(lambda: _answer(runtime, "a miss on a slow server"), 30,
                        what="service after the delay")
    assert result.tier == "miss"


def _answer(runtime: Runtime, text: str) -> Any:
    try:
        return runtime.engine.classify("text", text)
    except RemoteUnavailableError:
        return None


@pytest.mark.parametrize("mode", ["nan", "shape"])
def test_garbage_answers_are_refused_counted_and_never_cached(
    triton: TritonRepositoryServer, remote_model: Callable[..., Any], make_runtime: Callable[..., Runtime],
    mode: str,
) -> None:  # fmt: skip
    model = remote_model("text", _running(triton).grpc_url)
    runtime = make_runtime(models={"text": model})
    triton.set_garbage(mode)
    try:
        with pytest.raises(RemoteUnavailableError):
            runtime.engine.classify("text", f"garbage please ({mode})")
        assert model.remote_state()["refused_answers"] >= 1
        metrics = runtime.metrics.render().decode()
        assert 'infcache_remote_refused_answers_total{task="text"}' in metrics
        assert 'infcache_remote_up{task="text"} 0.0' in metrics
        assert model.remote_state()["status"] == "refused"
    finally:
        triton.set_garbage(None)
    result = wait_until(lambda: _answer(runtime, f"garbage please ({mode})"), 30,
                        what="service after the garbage")
    assert result.tier == "miss"  # the garbage was never cached
    assert all(0.0 <= score <= 1.0 for _, score in result.prediction.labels)


def test_killed_and_restarted_with_a_new_model(
    triton: TritonRepositoryServer, remote_model: Callable[..., Any],
    serve: Callable[..., tuple[str, Runtime]],
) -> None:  # fmt: skip
    model = remote_model("text", triton.grpc_url)
    local_version = model.version
    url, _runtime = serve(models={"text": model})
    first = parse_answer(_infer(url, "where is my parcel").json())
    assert (first.cache_info["tier"], first.cache_info["model_version"]) == ("miss", local_version)
    assert 'infcache_remote_up{task="text"} 1.0' in httpx.get(f"{url}/metrics").text

    triton.kill()
    _refused(_infer(url, "a new message while the server is down"))
    hit = parse_answer(_infer(url, "where is my parcel").json())  # hits are still served
    assert (hit.cache_info["tier"], hit.labels) == ("l1", first.labels)
    ready = httpx.get(f"{url}/readyz").json()
    state = ready["models"]["text"]
    assert ready["status"] == "ready" and state["remote"]["status"] == "down"
    assert state["backend_reason"].startswith("remote down")
    assert 'infcache_remote_up{task="text"} 0.0' in httpx.get(f"{url}/metrics").text
    late = remote_model("text", triton.http_url)  # a replica started now loads all the same
    assert late.remote_state()["status"] == "down"
    _refused_engine(late)

    # A new model on the server: another cache_model_version (its probe answers and state with it).
    config = triton.repository / "text" / "config.pbtxt"
    config.write_text(config.read_text().replace(local_version, NEW_VERSION))
    triton.start()
    down_message = "a new message while the server is down"
    wait_until(lambda: _served(url, down_message), 30, what="service after the restart")  # by itself
    again = parse_answer(_infer(url, "where is my parcel").json())
    # A new key space: the old model's entry is never served for the new one.
    assert (again.cache_info["tier"], again.cache_info["model_version"]) == ("miss", NEW_VERSION)
    assert model.version == NEW_VERSION and triton.calls()["text"] > 0
    wait_until(lambda: late.remote_state()["usable"], 30, what="the late replica's remote")
    assert late.version == NEW_VERSION


def _refused_engine(model: Any) -> None:
    with pytest.raises(RemoteUnavailableError) as refused:
        model.predict_batch([model.canonicalize("anything")])
    assert refused.value.retry_after_s > 0
