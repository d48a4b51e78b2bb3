"""The console's Hard examples panel in headless Chromium: a person signs in, reads the kept
examples, picks the right class, saves it and exports the set (stand-in model: fast)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from playwright.sync_api import Browser, Page, expect

from runtime import Runtime
from storage.redis.embedded import EmbeddedRedis, free_port
from tests.test_browser import UI_TIMEOUT_MS, assert_no_page_errors, browser, shot, sign_in  # noqa: F401
from tests.test_hard_examples import ConfidenceModel
from ui.server import BackgroundServer, build_app

pytestmark = pytest.mark.browser
TOKEN = "browser-hard-examples-token"


@pytest.fixture
def console(browser: Browser, make_runtime: Callable[..., Runtime],  # noqa: F811
            redis_server: EmbeddedRedis) -> Iterator[tuple[Page, list[str], Runtime]]:  # fmt: skip
    runtime = make_runtime(
        models={"text": ConfidenceModel()}, redis__url=redis_server.url, server__admin_token=TOKEN,
        quality__hard_examples_size=5,
    )  # fmt: skip
    for text in ("unsure message one", "unsure message two", "unsure message two"):
        runtime.engine.classify("text", text)
    assert runtime.hard_examples is not None
    runtime.hard_examples.flush()
    server = BackgroundServer(build_app(runtime), port=free_port()).start()
    context = browser.new_context(viewport={"width": 1280, "height": 1400})
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(server.url + "/", wait_until="domcontentloaded")
        yield page, errors, runtime
    finally:
        context.close()
        server.close()


def test_label_and_export_in_the_console(console: tuple[Page, list[str], Runtime]) -> None:
    page, errors, runtime = console
    page.get_by_role("tab", name="Admin").click()
    sign_in(page, TOKEN)
    expect(page.locator("#admin-console")).to_be_visible()
    page.locator("#admin-hard-examples").get_by_text("Hard examples").first.click()
    page.locator("#admin-hard-text-refresh").click()
    table = page.locator("#admin-hard-text-table")
    expect(table).to_contain_text("unsure message two")
    expect(table).to_contain_text("unsure message one")
    expect(page.locator("#admin-hard-text-summary")).to_contain_text("2/5 kept")
    expect(page.locator("#admin-hard-text-text textarea")).to_have_value("unsure message two")  # most asked
    expect(page.locator("#admin-hard-text-details")).to_contain_text("Asked 2 times")
    page.locator("#admin-hard-text-label input").click()
    page.get_by_role("option", name="delivery").click()
    page.locator("#admin-hard-text-save").click()
    expect(page.locator("#admin-hard-text-result")).to_contain_text("labelled delivery")
    expect(table).to_contain_text("labelled")
    # The next pending example is shown for labelling.
    expect(page.locator("#admin-hard-text-text textarea")).to_have_value("unsure message one")
    shot(page, "hard-examples-labelled")
    page.locator("#admin-hard-text-export").click()
    link = page.locator("#admin-hard-text-file a")
    expect(link).to_have_attribute("href", re.compile(r"/hard-examples-text\.parquet$"))
    labelled = runtime.admin.hard_examples.listing("text", state="labelled")["examples"]
    assert [(e["text"], e["label"]) for e in labelled] == [("unsure message two", "delivery")]
    assert_no_page_errors(errors)
