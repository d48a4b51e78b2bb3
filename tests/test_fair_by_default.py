"""Fair by default (engine.capacity.admission): with the default miss budget, one client alone on an idle
server is answered every time, through each door a person or a script uses: REST (the real
tritonclient), gradio_client, and the browser (headless Chromium driving the page).

Real models, a real Redis (the budget's buckets live there, as in a fleet), default settings:
200 new messages and 50 new photos per door, one request at a time, well past the budget's burst
(CLIENT_MISS_BURST) and rate (CLIENT_MISS_RATE). None may be refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from gradio_client import Client, handle_file
from playwright.sync_api import Browser, Page, expect

from bench.workload.inputs import make_images, make_messages
from runtime import Runtime
from settings import CLIENT_MISS_BURST, Settings
from storage.redis.embedded import EmbeddedRedis
from tests.conftest import free_port
from tests.test_browser import browser  # noqa: F401  (its Chromium fixture)
from ui.server import serve_runtime

MESSAGES = 200
PHOTOS = 50
MODEL_TIMEOUT_MS = 30_000
PNG_SIGNATURE = b"\x89PNG"


@pytest.fixture
def idle_server(make_runtime, real_models, redis_server: EmbeddedRedis) -> Iterator[tuple[str, Runtime]]:
    defaults = Settings.from_env({})
    runtime = make_runtime(models=real_models, redis__url=redis_server.url,
                           fairness__client_miss_rate=defaults.fairness.client_miss_rate,
                           fairness__client_miss_burst=defaults.fairness.client_miss_burst)  # fmt: skip
    assert runtime.engine.fairness_state()["miss_budget"] is not None  # the default budget is on
    server = serve_runtime(runtime, port=free_port())
    yield server.url, runtime
    server.close()


def _inputs(seed: int, tmp_path: Path) -> tuple[list[str], list[Path]]:
    photos = []
    for n, data in enumerate(make_images(PHOTOS, seed=seed)):
        suffix = ".png" if data.startswith(PNG_SIGNATURE) else ".jpg"
        path = tmp_path / f"photo-{n}{suffix}"
        path.write_bytes(data)
        photos.append(path)
    return make_messages(MESSAGES, seed=seed), photos


def _assert_all_computed(runtime: Runtime) -> None:
    counters = runtime.engine.counters()
    assert counters.refused == 0
    assert counters.misses == MESSAGES + PHOTOS  # every one a new input, computed
    admissions = runtime.engine.fairness_state()["admissions"]
    past_budget = sum(n for (_task, decision), n in admissions.items() if decision == "idle")
    # Most were past the budget (its burst, plus what its rate refilled meanwhile), and no matter.
    assert past_budget >= (MESSAGES + PHOTOS) // 2 > CLIENT_MISS_BURST


def test_rest_alone_on_an_idle_server_every_new_input_is_answered(idle_server, tmp_path: Path) -> None:
    url, runtime = idle_server
    messages, photos = _inputs(seed=301, tmp_path=tmp_path)
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    try:
        uploads = [("text", m.encode()) for m in messages] + [("image", p.read_bytes()) for p in photos]
        for task, item in uploads:
            tensor = triton.InferInput("input", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([item], dtype=np.object_), binary_data=True)
            result = client.infer(task, [tensor])  # raises on any refusal
            assert result.get_response()["parameters"]["tier"] == "miss"
    finally:
        client.close()
    _assert_all_computed(runtime)


def test_gradio_client_alone_on_an_idle_server_every_new_input_is_answered(
    idle_server, tmp_path: Path
) -> None:
    url, runtime = idle_server
    messages, photos = _inputs(seed=302, tmp_path=tmp_path)
    client = Client(url + "/", verbose=False)
    try:
        for message in messages:
            _, info = client.predict(message, api_name="/classify_text")
            assert info["tier"] == "miss"
        for photo in photos:
            _, info = client.predict(handle_file(str(photo)), api_name="/classify_image")
            assert info["tier"] == "miss"
    finally:
        client.close()
    _assert_all_computed(runtime)


def _wait_answered(runtime: Runtime, before: int) -> None:
    """Until the engine has answered (or refused) one more request than `before`."""
    deadline = time.monotonic() + MODEL_TIMEOUT_MS / 1000
    while _answered(runtime) <= before:
        assert time.monotonic() < deadline, "the page's request was never answered"
        time.sleep(0.005)


def _wait_shown(page: Page, info: str, before: str) -> None:
    """Until the page shows the new answer's cache_info, as a person reads the answer before
    sending the next input (Gradio ignores a click while the same event is still pending:
    on a busy machine the engine's answer can take a while to reach the page)."""
    locator = page.locator(info)
    deadline = time.monotonic() + MODEL_TIMEOUT_MS / 1000
    while locator.inner_text() in (before, ""):  # choosing a photo clears the last answer first
        assert time.monotonic() < deadline, "the answer never reached the page"
        time.sleep(0.02)


def _answered(runtime: Runtime) -> int:
    counters = runtime.engine.counters()
    return counters.misses + counters.hits_l1 + counters.hits_l2 + counters.refused + counters.errors


@pytest.mark.browser
def test_the_browser_alone_on_an_idle_server_every_new_input_is_answered(
    idle_server, browser: Browser, tmp_path: Path  # noqa: F811
) -> None:
    url, runtime = idle_server
    messages, photos = _inputs(seed=303, tmp_path=tmp_path)
    toasts: list[Any] = []
    context = browser.new_context(viewport={"width": 1280, "height": 1100})
    try:
        page = context.new_page()
        page.goto(url + "/", wait_until="domcontentloaded")
        page.get_by_role("tab", name="Text").click()
        textarea = page.locator("#text-input textarea")
        for message in messages:
            before, shown = _answered(runtime), page.locator("#text-info").inner_text()
            textarea.fill(message)
            page.locator("#text-submit").click()
            _wait_answered(runtime, before)
            _wait_shown(page, "#text-info", shown)
        expect(page.locator("#text-badge")).to_contain_text("Computed on", timeout=MODEL_TIMEOUT_MS)
        toasts += page.locator(".toast-body").all_inner_texts()
        page.get_by_role("tab", name="Image").click()
        file_input = page.locator("#image-input input[type=file]")
        for photo in photos:
            before, shown = _answered(runtime), page.locator("#image-info").inner_text()
            file_input.set_input_files(str(photo))
            page.locator("#image-submit").click()
            _wait_answered(runtime, before)
            _wait_shown(page, "#image-info", shown)
        expect(page.locator("#image-badge")).to_contain_text("Computed on", timeout=MODEL_TIMEOUT_MS)
        toasts += page.locator(".toast-body").all_inner_texts()
    finally:
        context.close()
    assert not toasts, toasts  # no error shown to the visitor
    _assert_all_computed(runtime)
