"""The remote backend against a real tritonserver (testing.triton_server) serving the repository
`make triton-repository` writes, through the real tritonclient over HTTP and gRPC: answers equal
the local model's within 1e-5, hits never reach the server, concurrent misses share calls, two
replicas on one Redis send each unique input once. Faults (down at start, killed and restarted with
a new model, slow, garbage) are in tests/test_remote_faults.py."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.inputs import CanonicalImage
from runtime import Runtime, build_runtime, load_models
from settings import Settings
from storage.redis.embedded import EmbeddedRedis
from testing.tiny_models import write_config
from testing.triton_server import TritonRepositoryServer

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-5
MESSAGES = ("where is my parcel", "I want my money back for the broken kettle",
            "how do I change my password", "cancel the order I placed this morning",
            "Ihr Paket ist unterwegs", "thanks, that was all")  # fmt: skip


@pytest.fixture(scope="module")
def triton(triton_repository: Path) -> Iterator[TritonRepositoryServer]:
    with TritonRepositoryServer(triton_repository) as server:
        yield server


def test_answers_through_the_server_equal_local_answers(
    triton: TritonRepositoryServer, remote_model: Callable[..., Any], real_models: dict[str, Any]
) -> None:
    rng = np.random.default_rng(38)
    sizes = ((240, 320), (500, 300))
    images = [CanonicalImage(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    for url in (triton.http_url, triton.grpc_url):
        for task, raws in (("text", MESSAGES), ("image", images)):
            model, local = remote_model(task, url), real_models[task]
            assert (model.backend, model.backend_reason, model.version) == ("remote", None, local.version)
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


def _wait_for_peers(replicas: list[Runtime], timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        flights = [r.engine._fleet_flight for r in replicas]
        if all(f is not None and (f.peers or 0) >= len(replicas) - 1 for f in flights):
            return
        time.sleep(0.05)
    raise AssertionError("the replicas did not see each other")


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
