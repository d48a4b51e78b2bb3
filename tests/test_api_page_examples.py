"""The "Use via API" page's examples work as printed: every Python and bash snippet the page
shows (read from the page in headless Chromium, as a person would copy it) is run verbatim
against the served app, Python with this venv's interpreter, bash with `bash -c`. Real models,
the app served as `make run` serves it (ui.server.serve_runtime).

And a gradio_client or curl user whose call the app refuses (an image URL: the app never
fetches one) is told why, not only "400 Bad Request"."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import ValidationError
from playwright.sync_api import Browser, Page, expect

from runtime import build_runtime
from storage.redis.embedded import free_port
from tests.test_browser import UI_TIMEOUT_MS, browser, shot
from ui.server import serve_runtime

pytestmark = pytest.mark.browser
__all__ = ["browser"]  # the module-scoped Chromium fixture, shared with test_browser
RUN_TIMEOUT_S = 120  # a miss runs the model on CPU (2 shared cores in CI)
CAT = ("tabby", "tiger cat", "Egyptian cat")


@pytest.fixture(scope="module")
def app_url(base_settings, real_models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = base_settings.changed(server__data_dir=tmp_path_factory.mktemp("api-page"))
    runtime = build_runtime(settings, models=real_models)
    server = serve_runtime(runtime, port=free_port())
    yield server.url
    server.close()
    runtime.close()


@pytest.fixture
def api_page(browser: Browser, app_url: str) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 1100})
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    page.goto(app_url + "/", wait_until="domcontentloaded")
    page.get_by_text("Use via API").click()
    expect(page.get_by_text("API documentation")).to_be_visible()
    yield page
    context.close()


def shown_snippets(page: Page, language: str, marker: str) -> list[str]:
    """The code blocks the page shows for `language` (its tab clicked) that hold `marker`."""
    page.get_by_role("listitem").filter(has_text=language).first.click()
    blocks = page.locator("pre:visible").filter(has_text=marker)
    expect(blocks.first).to_be_visible()
    return [blocks.nth(i).inner_text() for i in range(blocks.count())]


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def test_python_snippets_run_as_printed(api_page: Page, app_url: str) -> None:
    snippets = shown_snippets(api_page, "Python", "client.predict(")
    shot(api_page, "api-page-python")
    assert len(snippets) == 2, snippets  # classify_image, classify_text
    image = next(s for s in snippets if "/classify_image" in s)
    # The example file is one the client uploads, not Gradio's URL of a bus on GitHub.
    assert "https://" not in image and "handle_file('/" in image, image
    for snippet in snippets:
        assert f'Client("{app_url}")' in snippet, snippet
        out = run([sys.executable, "-c", snippet])
        assert "'confidences'" in out and "'tier'" in out, out
    assert any(name in run([sys.executable, "-c", image]) for name in CAT)


def test_bash_snippets_run_as_printed(api_page: Page, app_url: str) -> None:
    snippets = shown_snippets(api_page, "cURL", "curl -X POST")
    shot(api_page, "api-page-curl")
    assert len(snippets) == 2, snippets
    for snippet in snippets:
        assert app_url in snippet and "/path/to/your/file" not in snippet, snippet
        out = run(["bash", "-c", snippet])
        # The result stream: its `complete` event with the answer.
        assert "event: complete" in out and '"confidences"' in out, out
        if "classify_image" in snippet:
            assert any(name in out for name in CAT), out


def test_a_refused_call_tells_curl_why(api_page: Page) -> None:
    """The page's bash snippet for the image, its file an image URL: the call is accepted and
    its result stream says why the app refuses it (a 4xx body would be lost in the snippet's
    awk, which reads the event id from the POST's answer)."""
    snippet = next(s for s in shown_snippets(api_page, "cURL", "curl -X POST") if "classify_image" in s)
    upload, call = snippet.split("\n\n", 1)
    assert upload.startswith("FILE_PATH=$(curl"), upload
    out = run(["bash", "-c", "FILE_PATH=https://example.invalid/cat.jpg\n" + call])
    assert out.startswith("event: error\ndata: ") and "does not fetch URLs" in out, out


def test_a_refused_call_tells_the_gradio_client_why(app_url: str, photo_dir: Path) -> None:
    client = Client(app_url, verbose=False)
    url = "https://raw.githubusercontent.com/gradio-app/gradio/main/test/test_files/bus.png"
    with pytest.raises(ValidationError, match="does not fetch URLs") as refused:
        client.predict(image=handle_file(url), api_name="/classify_image")
    assert "/gradio_api/upload" in str(refused.value)
    with pytest.raises(ValidationError, match="not a valid image value"):
        client.predict(image=5, api_name="/classify_image")
    # The same client goes on working with an uploaded file.
    label, info = client.predict(image=handle_file(photo_dir / "chelsea.png"), api_name="/classify_image")
    assert label["label"] in CAT and info["tier"] in ("miss", "l1", "l2", "coalesced")
    client.close()
