"""The served app through HTTP and gradio_client: both API names, errors, health, queue bypass."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from runtime import Runtime
from storage.redis.embedded import EmbeddedRedis
from testing.gradio_http import GradioHttpClient, Reply, file_data
from tests.conftest import CountingTextModel

CAT_CLASSES = {"tabby", "tiger cat", "Egyptian cat", "Persian cat", "Siamese cat"}


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def real_app(serve, real_models, redis_server: EmbeddedRedis) -> tuple[str, Runtime]:
    return serve(models=real_models, redis__url=redis_server.url)


def test_both_api_names_answer_with_label_and_cache_info(real_app, photo_dir: Path) -> None:
    url, _ = real_app
    client = Client(url + "/", verbose=False)
    assert {"/classify_image", "/classify_text"} <= set(
        client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    )
    photo = handle_file(str(photo_dir / "chelsea.png"))
    label, info = client.predict(photo, api_name="/classify_image")
    assert label["label"] in CAT_CLASSES
    assert len(label["confidences"]) == 5
    assert info["tier"] == "miss" and info["model"] == "efficientnet-lite0"
    assert info["device"] in ("cpu", "cuda:0") and info["latency_ms"] > 0
    again_label, again = client.predict(photo, api_name="/classify_image")
    assert again["tier"] == "l1" and again["key"] == info["key"]
    assert again_label == label

    label, info = client.predict("Where is my parcel? It's a week late", api_name="/classify_text")
    assert label["label"] == "order_status" and info["tier"] == "miss"
    _, info = client.predict("  where is my PARCEL?   it's a week late ", api_name="/classify_text")
    assert info["tier"] == "l1"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "empty"),
        (b"this is a text file, not a picture\n", "not an image"),
        (None, "truncated or corrupted"),  # a truncated PNG, built in the test
    ],
)
def test_bad_uploads_get_a_clear_message_not_a_traceback(
    real_app, tmp_path: Path, photo_bytes, payload, message
) -> None:
    url, _ = real_app
    path = tmp_path / "upload.png"
    path.write_bytes(payload if payload is not None else photo_bytes("coffee.png")[:3000])
    client = Client(url + "/", verbose=False)
    for _ in range(2):  # the second time from the negative cache
        with pytest.raises(AppError) as error:
            client.predict(handle_file(str(path)), api_name="/classify_image")
        text = str(error.value)
        assert message in text and "Traceback" not in text


def test_health_and_readiness(real_app) -> None:
    url, _ = real_app
    assert get_json(url + "/healthz") == (200, {"status": "ok"})
    status, body = get_json(url + "/readyz")
    assert status == 200 and body["l2"] == "up"
    assert set(body["models"]) == {"image", "text"}


def test_a_hit_does_not_wait_behind_queued_misses(serve) -> None:
    model_time = 1.5
    url, _ = serve(models={"text": CountingTextModel(delay_s=model_time)}, redis__url="off")
    warm = Client(url + "/", verbose=False)
    warm.predict("cached question", api_name="/classify_text")

    busy = [Client(url + "/", verbose=False) for _ in range(3)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        misses = [pool.submit(c.predict, f"slow miss {i}", api_name="/classify_text")
                  for i, c in enumerate(busy)]  # fmt: skip
        time.sleep(0.3)  # the queue now holds ~4.5 s of misses
        started = time.monotonic()
        _, info = warm.predict("cached question", api_name="/classify_text")
        hit_latency = time.monotonic() - started
        assert not any(m.done() for m in misses), "misses finished early: the queue was not busy"
        for m in misses:
            m.result(timeout=60)
    assert info["tier"] == "l1"
    assert hit_latency < model_time, f"hit waited {hit_latency:.2f}s behind the queue"


def call_raw(url: str, api_name: str, data: list) -> Reply:
    """One call through Gradio's HTTP API without gradio_client (no session, curl style)."""
    with GradioHttpClient(url, timeout_s=60.0) as client:
        return client.call(api_name, data)


def test_a_request_cannot_name_a_server_file_as_its_upload(real_app, tmp_path: Path, photo_dir: Path) -> None:
    """Only files that went through Gradio's upload are read: never a path the client names."""
    url, runtime = real_app
    outside = tmp_path / "never-uploaded.png"
    outside.write_bytes((photo_dir / "coffee.png").read_bytes())
    in_working_dir = Path("docs/console.png").resolve()
    assert in_working_dir.is_file()
    forged = [
        outside,
        in_working_dir,
        photo_dir / "rocket.jpg",
        Path("/etc/hostname"),
        tmp_path / "missing.png",
    ]
    before = runtime.engine.counters()
    for path in forged:
        reply = call_raw(url, "classify_image", [file_data(str(path))])
        assert reply.status == 400, (path, reply)
        assert "must be uploaded first" in reply.body and "Traceback" not in reply.body
    after = runtime.engine.counters()
    assert (
        after.model_calls == before.model_calls and after.invalid == before.invalid
    )  # never reached the engine
    # A real upload still works after the refusals.
    label, info = Client(url + "/", verbose=False).predict(
        handle_file(str(outside)), api_name="/classify_image"
    )
    assert label["label"] == "espresso" and info["tier"] == "miss"


def test_uploads_work_when_the_upload_folder_is_inside_the_data_folder(
    serve, real_models, tmp_path: Path, photo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request log is off limits, yet an upload folder under DATA_DIR stays usable."""
    monkeypatch.setenv(
        "GRADIO_TEMP_DIR", str(tmp_path / "rt0" / "uploads")
    )  # rt0: the first runtime's DATA_DIR
    url, runtime = serve(models=real_models, redis__url="off")
    assert runtime.settings.server.data_dir == tmp_path / "rt0"
    label, _ = Client(url + "/", verbose=False).predict(
        handle_file(str(photo_dir / "coffee.png")), api_name="/classify_image"
    )
    assert label["label"] == "espresso"
    assert any((tmp_path / "rt0").rglob("*.png")), "the upload did not land in DATA_DIR"
    sqlite = runtime.settings.sqlite_path.resolve()
    assert sqlite.is_file()
    assert call_raw(url, "classify_image", [file_data(str(sqlite))]).status == 400
