"""/docs and /redoc work with no network: their scripts and styles come from the app.

Chromium loads each page with every request to another host refused (and recorded); the
page must render the API's routes, and nothing may have been asked of another host.
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Route, expect

from runtime import build_runtime
from tests.conftest import free_port
from tests.test_browser import UI_TIMEOUT_MS, browser  # noqa: F401  (its Chromium fixture)
from ui.server import BackgroundServer, build_app

pytestmark = pytest.mark.browser

INFER_ROUTE = "/v2/models/{model}/infer"


@pytest.fixture(scope="module")
def app_url(base_settings, real_models, tmp_path_factory) -> Iterator[str]:
    settings = base_settings.changed(server__data_dir=tmp_path_factory.mktemp("docs-pages"), redis__url="off")
    runtime = build_runtime(settings, models=real_models)
    server = BackgroundServer(build_app(runtime), port=free_port()).start()
    yield server.url
    server.close()
    runtime.close()


def _offline_page(browser: Browser, app_url: str, asked_elsewhere: list[str]):  # noqa: F811
    context = browser.new_context()
    local = urlsplit(app_url).netloc

    def only_the_app(route: Route) -> None:
        if urlsplit(route.request.url).netloc in (local, ""):
            route.continue_()
        else:
            asked_elsewhere.append(route.request.url)
            route.abort("internetdisconnected")

    context.route("**/*", only_the_app)
    return context


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_the_api_reference_renders_with_the_network_off(browser: Browser, app_url: str, path: str) -> None:  # noqa: F811
    asked_elsewhere: list[str] = []
    context = _offline_page(browser, app_url, asked_elsewhere)
    page = context.new_page()
    failed: list[str] = []
    page.on("requestfailed", lambda request: failed.append(request.url))
    infer = httpx.get(app_url + "/openapi.json").json()["paths"][INFER_ROUTE]["post"]
    try:
        response = page.goto(app_url + path)
        assert response is not None and response.status == 200
        # Both pages list the REST infer operation once their scripts have rendered the schema.
        shown = page.get_by_text(infer["summary"], exact=True).locator("visible=true").first
        expect(shown).to_be_visible(timeout=UI_TIMEOUT_MS)
    finally:
        context.close()
    assert asked_elsewhere == [], f"{path} asked other hosts: {asked_elsewhere}"
    assert failed == [], f"{path}: requests failed: {failed}"


def test_the_reference_assets_are_served_by_the_app(app_url: str) -> None:
    html = httpx.get(app_url + "/docs").text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert f"/docs/assets/{asset}" in html
        served = httpx.get(f"{app_url}/docs/assets/{asset}")
        assert served.status_code == 200 and len(served.content) > 10_000
    assert "cdn.jsdelivr" not in html and "fonts.googleapis" not in httpx.get(app_url + "/redoc").text
