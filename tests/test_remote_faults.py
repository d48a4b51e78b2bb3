"""Faults of a remote model's server (engine.models.remote), with a real tritonserver
(testing.triton_server) and the app served over real HTTP: down at start, killed and restarted with
a new model (a new key space), slow (bounded timeouts), garbage answers (refused, counted, never
cached). Misses get 503 with Retry-After while hits are still served, the reason shows in /readyz
and /metrics, and service returns by itself."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.errors import RemoteUnavailableError
from runtime import Runtime
from testing.oip_http import infer_body, parse_answer
from testing.triton_server import TritonRepositoryServer
from tests.test_fleet import wait_until

pytestmark = pytest.mark.timeout(300)

NEW_VERSION = "feedfacecafe0038"


@pytest.fixture(scope="module")
def server(triton_repository: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonRepositoryServer]:  # fmt: skip
    """The text model's folder of the repository, copied (a test gives it a new version), served on
    ports chosen now; not started: the first test starts it (down at start)."""
    folder = tmp_path_factory.mktemp("remote-faults")
    shutil.copytree(triton_repository / "text", folder / "text")
    served = TritonRepositoryServer(folder)
    try:
        yield served
    finally:
        served.close()


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


def test_down_at_start_then_killed_and_restarted_with_a_new_model(
    server: TritonRepositoryServer, remote_model: Callable[..., Any],
    serve: Callable[..., tuple[str, Runtime]],
) -> None:  # fmt: skip
    model = remote_model("text", server.grpc_url)  # nothing listens there yet: it loads all the same
    local_version = model.version
    assert model.remote_state()["status"] == "down" and model.backend_reason.startswith("remote down")
    url, _runtime = serve(models={"text": model})
    _refused(_infer(url, "hello there"))
    ready = httpx.get(f"{url}/readyz").json()
    assert ready["status"] == "ready" and ready["models"]["text"]["remote"]["status"] == "down"
    assert 'infcache_remote_up{task="text"} 0.0' in httpx.get(f"{url}/metrics").text

    server.start()  # service returns by itself (the background check)
    answer = wait_until(lambda: _served(url, "hello there"), 30, what="service after the server started")
    assert parse_answer(answer.json()).cache_info["backend"] == "remote"
    first = parse_answer(_infer(url, "where is my parcel").json())
    assert (first.cache_info["tier"], first.cache_info["model_version"]) == ("miss", local_version)
    assert 'infcache_remote_up{task="text"} 1.0' in httpx.get(f"{url}/metrics").text

    server.kill()
    _refused(_infer(url, "a new message while the server is down"))
    hit = parse_answer(_infer(url, "where is my parcel").json())  # hits are still served
    assert (hit.cache_info["tier"], hit.labels) == ("l1", first.labels)
    state = httpx.get(f"{url}/readyz").json()["models"]["text"]
    assert state["remote"]["status"] == "down" and state["backend_reason"].startswith("remote down")

    # A new model on the server: another cache_model_version (its probe answers and state with it).
    config = server.repository / "text" / "config.pbtxt"
    config.write_text(config.read_text().replace(local_version, NEW_VERSION))
    server.start()
    down_message = "a new message while the server is down"
    wait_until(lambda: _served(url, down_message), 30, what="service after the restart")
    again = parse_answer(_infer(url, "where is my parcel").json())
    # A new key space: the old model's entry is never served for the new one.
    assert (again.cache_info["tier"], again.cache_info["model_version"]) == ("miss", NEW_VERSION)
    assert model.version == NEW_VERSION and server.calls()["text"] > 0


def test_a_slow_server_is_given_up_within_the_timeout_and_comes_back(
    server: TritonRepositoryServer, remote_model: Callable[..., Any], make_runtime: Callable[..., Runtime]
) -> None:
    model = remote_model("text", _running(server).http_url, timeout_s=0.5)
    runtime = make_runtime(models={"text": model})
    runtime.engine.classify("text", "answered before the server slowed down")
    server.set_delay(2.0)
    try:
        started = time.monotonic()
        with pytest.raises(RemoteUnavailableError) as refused:
            runtime.engine.classify("text", "a miss on a slow server")
        assert time.monotonic() - started < 2.0  # bounded: connect 0.5 s + call 0.5 s, not the 2 s delay
        assert refused.value.retry_after_s > 0 and model.remote_state()["status"] == "down"
        hit = runtime.engine.classify("text", "answered before the server slowed down")
        assert hit.tier == "l1"
    finally:
        server.set_delay(0.0)
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
    server: TritonRepositoryServer, remote_model: Callable[..., Any], make_runtime: Callable[..., Runtime],
    mode: str,
) -> None:  # fmt: skip
    model = remote_model("text", _running(server).grpc_url)
    runtime = make_runtime(models={"text": model})
    server.set_garbage(mode)
    try:
        with pytest.raises(RemoteUnavailableError):
            runtime.engine.classify("text", f"garbage please ({mode})")
        assert model.remote_state()["refused_answers"] >= 1
        metrics = runtime.metrics.render().decode()
        assert 'infcache_remote_refused_answers_total{task="text"}' in metrics
        assert 'infcache_remote_up{task="text"} 0.0' in metrics
        assert model.remote_state()["status"] == "refused"
    finally:
        server.set_garbage(None)
    result = wait_until(lambda: _answer(runtime, f"garbage please ({mode})"), 30,
                        what="service after the garbage")
    assert result.tier == "miss"  # the garbage was never cached
    assert all(0.0 <= score <= 1.0 for _, score in result.prediction.labels)
