"""Live model reload (engine.lifecycle.reload): new weights swapped in beside the old, in-flight requests
finishing on the old model, failures keeping it, audit rows, and the reload reaching every replica."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime import Runtime, build_runtime, load_models
from settings import Settings
from storage.redis.embedded import EmbeddedRedis, free_port
from testing.tiny_models import make_text_model, write_config
from tests.conftest import CountingTextModel
from tests.test_model_config import assert_same, own_text_scores

TOKEN = "reload-operator-token"
FAST = {"fleet__generation_refresh_s": 0.1, "fleet__heartbeat_s": 0.1, "fleet__generation_confirm_s": 0.5}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_text_model(tmp_path / "sentiment", seed=0)


@pytest.fixture
def replicas(base_settings: Settings, tmp_path: Path, model_dir: Path) -> Iterator[Callable[..., Runtime]]:
    config = write_config(tmp_path / "models.yaml", [
        {"task": "sentiment", "kind": "text-classification", "source": "transformers",
         "path": str(model_dir)},
    ])  # fmt: skip
    built: list[Runtime] = []

    def start(name: str = "A", **overrides: Any) -> Runtime:
        settings = base_settings.changed(
            server__data_dir=tmp_path / f"rt-{name}", models__models_config=config, server__replica_id=name,
            server__admin_token=TOKEN, **overrides,
        )  # fmt: skip
        runtime = build_runtime(settings, model_factory=load_models)
        built.append(runtime)
        return runtime

    yield start
    for runtime in reversed(built):
        runtime.close()


def replace_weights(folder: Path, seed: int) -> None:
    """New weights in the same folder, as an operator would copy them in."""
    fresh = folder.parent / f"fresh-{seed}"
    make_text_model(fresh, seed=seed)
    shutil.copy(fresh / "model.safetensors", folder / "model.safetensors")


def reload(url: str, task: str, *, token: str = TOKEN, note: str = "new weights") -> httpx.Response:
    return httpx.post(f"{url}/admin/api/models/{task}/reload", json={"note": note},
                      headers={"Authorization": f"Bearer {token}"}, timeout=60)  # fmt: skip


def test_reload_through_the_api(replicas: Callable[..., Runtime], model_dir: Path) -> None:
    from ui.server import serve_runtime

    runtime = replicas()
    engine = runtime.engine
    text = "I want my money back"
    before = engine.classify("sentiment", text)
    server = serve_runtime(runtime, port=free_port())
    try:
        assert reload(server.url, "sentiment", token="wrong-token-value").status_code == 401
        assert engine.models["sentiment"].version == before.model_version  # nothing changed
        same = reload(server.url, "sentiment")  # the same files: nothing to swap
        assert same.status_code == 200 and same.json()["changed"] is False

        replace_weights(model_dir, seed=5)
        answer = reload(server.url, "sentiment", note="retrained on May data")
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["changed"] and body["version_before"] == before.model_version
        assert body["version"] != before.model_version and body["fleet"]["complete"]
        after = engine.classify("sentiment", text)
        assert after.tier == "miss" and after.model_version == body["version"]  # never the old answer
        assert_same(after.prediction.as_label_value(), own_text_scores(model_dir, text))
        assert after.prediction != before.prediction

        (model_dir / "model.safetensors").write_bytes(b"truncated")  # a broken copy
        broken = reload(server.url, "sentiment")
        assert broken.status_code == 422 and "keeps serving" in broken.json()["error"]
        assert "sentiment" in broken.json()["error"]
        still = engine.classify("sentiment", text)
        assert still.model_version == body["version"] and still.tier == "l1"

        assert reload(server.url, "nope").status_code == 404
        audit = runtime.admin.audit_rows()
        rows = [r for r in audit if r["action"] == "reload_model"]
        reloads = [(json.loads(r["params"]), json.loads(r["result"])) for r in rows]
        assert [result["ok"] for _, result in reloads] == [False, False, True, True]  # newest first
        assert reloads[2] == ({"task": "sentiment", "note": "retrained on May data"}, {**body})
        assert "header" in reloads[1][1]["error"]  # the broken file's reason
    finally:
        server.close()


class SlowModel(CountingTextModel):
    def __init__(self, version: str, *, delay_s: float, batched: bool) -> None:
        super().__init__(version, delay_s=delay_s)
        self.batch_misses = batched
        self.started = threading.Event()

    def predict_batch(self, inputs: Any) -> Any:
        self.started.set()
        return super().predict_batch(inputs)


@pytest.mark.parametrize("batched", [False, True])
def test_requests_in_flight_finish_on_the_old_model(
    make_runtime: Callable[..., Runtime], batched: bool
) -> None:
    old, new = (
        SlowModel("v-old", delay_s=0.5, batched=batched),
        SlowModel("v-new", delay_s=0.0, batched=batched),
    )
    runtime = make_runtime(models={"text": old}, models__batch_max_size=4)
    engine = runtime.engine
    results: dict[str, Any] = {}
    inflight = threading.Thread(target=lambda: results.setdefault("old", engine.classify("text", "slow one")))
    inflight.start()
    assert old.started.wait(5)
    engine.replace_model("text", new)
    fresh = engine.classify("text", "after the swap")
    inflight.join(5)
    assert results["old"].model_version == "v-old" and results["old"].key.split(":")[2] == "v-old"
    assert fresh.model_version == "v-new" and new.calls == 1 and old.calls == 1
    again = engine.classify("text", "slow one")  # the old version's entry is not served any more
    assert again.model_version == "v-new" and again.tier == "miss"


@pytest.mark.redis
def test_a_reload_reaches_every_replica(
    replicas: Callable[..., Runtime], model_dir: Path, redis_server: EmbeddedRedis
) -> None:
    a = replicas("A", redis__url=redis_server.url, **FAST)
    b = replicas("B", redis__url=redis_server.url, **FAST)
    text = "where is my parcel"
    old = b.engine.classify("sentiment", text)
    assert a.engine.classify("sentiment", text).tier == "l2"  # one shared cache
    replace_weights(model_dir, seed=9)
    started = time.monotonic()
    result = a.admin.reload_model("sentiment", actor="test", note="fleet")
    assert result["changed"] and result["fleet"]["complete"], result
    assert set(result["fleet"]["confirmed"]) == {"A", "B"}
    assert time.monotonic() - started < 30
    assert b.engine.models["sentiment"].version == result["version"] == a.engine.models["sentiment"].version
    fresh = b.engine.classify("sentiment", text)
    assert (
        fresh.model_version == result["version"]
        and fresh.tier == "miss"
        and fresh.prediction != old.prediction
    )
    assert b.lifecycle is not None and b.lifecycle.remote_reloads == 1


@pytest.mark.redis
def test_fault_scenario_reload_under_load(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """The fault suite's model_reload scenario, quick: no failed request, every answer the
    model's own for the version it names, no old version after the acknowledgement."""
    from faults.scenarios_models import reload_under_load

    report = reload_under_load(redis_server.url, tmp_path, prefix="reload-quick", load_s=1.0, threads=3)
    assert report.failed == [] and report.wrong == [] and report.stale_after_ack == []
    assert report.reload["changed"] and report.reload["fleet"]["complete"]
    assert len(report.versions) == 2 and report.sent > 20, report.versions
