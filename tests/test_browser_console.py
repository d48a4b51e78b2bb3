"""The console's answers in headless Chromium: the verdict, Redis health with its warning, the
sizing curves with today's size marked, readable cache-state cards (the JSON in a closed
accordion), auto-refresh (on by default, silent while the page is hidden) and CSV downloads.
A stand-in text model keeps it quick; the Redis is real, with a maxmemory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from playwright.sync_api import Browser, Page, expect

from admin.monitoring.device_health import cuda_available
from storage.redis.embedded import EmbeddedRedis
from tests.conftest import CountingTextModel, free_port
from tests.test_browser import ARTIFACTS, UI_TIMEOUT_MS, assert_no_page_errors, browser, shot, sign_in
from ui.server import BackgroundServer, build_app

pytestmark = pytest.mark.browser
__all__ = ["browser"]  # the module-scoped Chromium fixture, shared with test_browser
TOKEN = "browser-console-token"
PLOT_POINTS_JS = """(id) => {
    const plot = document.querySelector(`#${id} .js-plotly-plot`);
    return plot && plot.data ? plot.data.map(trace => trace.x.length) : null;
}"""
# Counts clicks on Refresh, then runs the auto-refresh tick as if the page were hidden.
HIDDEN_TICK_JS = """(tick) => {
    window.__refreshClicks = 0;
    document.querySelector('#admin-refresh').addEventListener('click', () => window.__refreshClicks++);
    Object.defineProperty(document, 'visibilityState', {configurable: true, get: () => 'hidden'});
    (new Function(`return (${tick})`))()();
    delete document.visibilityState;
    return window.__refreshClicks;
}"""


@pytest.fixture
def console_app(make_runtime, redis_server: EmbeddedRedis) -> Iterator[tuple[str, object]]:
    runtime = make_runtime(models={"text": CountingTextModel()}, redis__url=redis_server.url,
                           server__admin_token=TOKEN, cache__l1_max_bytes=100_000)  # fmt: skip
    server = BackgroundServer(build_app(runtime), port=free_port()).start()
    yield server.url, runtime
    server.close()


@pytest.fixture
def console_page(browser: Browser, console_app, page_errors: list[str]) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 1100}, accept_downloads=True)
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    page.goto(console_app[0] + "/", wait_until="domcontentloaded")
    expect(page.get_by_role("tab", name="Admin")).to_be_visible(timeout=UI_TIMEOUT_MS)
    yield page
    context.close()


@pytest.fixture
def page_errors() -> list[str]:
    return []


def test_console_answers_the_operator_s_questions(
    console_page: Page, console_app, page_errors: list[str], redis_server: EmbeddedRedis
) -> None:
    page, (_, runtime) = console_page, console_app
    for i in range(40):
        runtime.engine.classify("text", f"question {i % 10}")  # 10 inputs, four times each
    with redis.Redis.from_url(redis_server.url) as client:
        client.config_set("maxmemory", 0)  # no limit: the console must say the defence is off

    page.get_by_role("tab", name="Admin").click()
    sign_in(page, TOKEN)
    expect(page.locator("#admin-console")).to_be_visible(timeout=UI_TIMEOUT_MS)
    expect(page.locator("#admin-verdict")).to_contain_text(
        "75 % of requests repeat an earlier input; the cache answered 75 %", timeout=UI_TIMEOUT_MS
    )
    expect(page.locator("#admin-health")).to_contain_text("no maxmemory limit is set")
    expect(page.locator("#admin-health")).to_contain_text("allkeys-LRU defence is off")
    expect(page.locator("#admin-health .stat-warn")).not_to_have_count(0)
    if cuda_available():
        expect(page.locator("#admin-gpu .js-plotly-plot")).to_be_attached()
    else:  # no empty chart: a plain statement
        expect(page.locator("#admin-health")).to_contain_text("No CUDA device")
        expect(page.locator("#admin-gpu")).to_be_hidden()
    sizing_text = page.locator("#admin-sizing-text")
    expect(sizing_text).to_contain_text("L1: today's 100.0 kB would have answered 75 %")
    expect(sizing_text).to_contain_text("95 % of that from")
    for plot in ("admin-sizing-l1", "admin-sizing-l2"):
        expect(page.locator(f"#{plot} .js-plotly-plot")).to_be_attached(timeout=UI_TIMEOUT_MS)
        assert page.evaluate(PLOT_POINTS_JS, plot) == [21, 21], plot  # the task's curve and all tasks'
    expect(page.locator("#admin-sizing-l1")).to_contain_text("today")
    expect(page.locator("#admin-state-cards")).to_contain_text("L1 memory")
    # Each of the 10 inputs holds its result and its raw-input alias in L1.
    expect(page.locator("#admin-state-cards")).to_contain_text("20 entries")
    expect(page.locator("#admin-state")).to_be_hidden()  # the raw JSON: a closed accordion
    page.locator("#admin-state-raw").get_by_text("Live cache state (raw JSON)").click()
    expect(page.locator("#admin-state")).to_contain_text("generation")
    shot(page, "console-10-answers")

    # Auto-refresh is on: a new request shows without touching Refresh (10 s period).
    expect(page.locator("#admin-auto-refresh input")).to_be_checked()
    expect(page.locator("#admin-cards")).to_contain_text("40")
    runtime.engine.classify("text", "a brand new question")
    expect(page.locator("#admin-cards")).to_contain_text("41", timeout=15_000)
    # While the page is hidden the tick sends nothing: Refresh is not clicked.
    from admin.insights.tab import AUTO_REFRESH_JS

    assert page.evaluate(HIDDEN_TICK_JS, AUTO_REFRESH_JS) == 0

    with page.expect_download() as requests_download:
        page.locator("#admin-csv-requests").click()
        page.locator("#admin-csv-file a").first.click(timeout=UI_TIMEOUT_MS)
    requests_csv = requests_download.value.path().read_text()
    assert requests_csv.startswith("time_utc,at,task,tier") and requests_csv.count("\n") == 42
    with page.expect_download() as audit_download:
        page.locator("#admin-csv-audit").click()
        expect(page.locator("#admin-csv-file")).to_contain_text("audit-", timeout=UI_TIMEOUT_MS)
        page.locator("#admin-csv-file a").first.click()
    assert audit_download.value.path().read_text().startswith("time_utc,at,action,params")
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#admin-verdict").scroll_into_view_if_needed()
    shot(page, "console-11-verdict-health-sizing")
    assert_no_page_errors(page_errors)
