"""Honest UI states in headless Chromium, with the real models: an error clears the previous
answer and says what happened where the answer was (not only in a toast that fades); a file
the model cannot read is named as such as soon as it is chosen; a console panel whose feature
is off says so and how to turn it on, its buttons disabled; at a phone's width every chart
title fits its chart and the "Use via API" link is there."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect

from runtime import Runtime
from storage.redis.embedded import free_port
from tests.test_browser import (
    MODEL_TIMEOUT_MS,
    UI_TIMEOUT_MS,
    assert_no_page_errors,
    browser,
    shot,
    sign_in,
    top_class,
    upload_image,
)
from ui.server import BackgroundServer, build_app

pytestmark = pytest.mark.browser
__all__ = ["browser"]  # the module-scoped Chromium fixture, shared with test_browser
TOKEN = "browser-states-token"
PHONE = {"width": 390, "height": 844}
# Each drawn chart's title box against its chart's box (plotly never wraps a title: a long
# one runs past the chart's edge, where the chart's SVG cuts it off).
TITLES_JS = """() => [...document.querySelectorAll('.js-plotly-plot')]
    .filter(plot => plot.offsetParent !== null)
    .map(plot => {
        const box = plot.querySelector('.main-svg').getBoundingClientRect();
        const title = plot.querySelector('.gtitle');
        const t = title ? title.getBoundingClientRect() : null;
        return {id: plot.closest('[id]') && plot.closest('[id]').id, text: title ? title.textContent : null,
                inside: !!t && t.left >= box.left - 0.5 && t.right <= box.right + 0.5 && t.width > 0};
    })"""


@pytest.fixture
def app_url(make_runtime: Callable[..., Runtime], real_models) -> Iterator[str]:
    # The defaults of a first run: no Redis, HARD_EXAMPLES_SIZE=0, WARM_SET_SIZE=0 (and the
    # tests' SHADOW_SAMPLE_RATE=0).
    runtime = make_runtime(models=real_models, server__admin_token=TOKEN)
    server = BackgroundServer(build_app(runtime), port=free_port()).start()
    yield server.url
    server.close()


@pytest.fixture
def page_errors() -> list[str]:
    return []


def open_page(browser: Browser, url: str, errors: list[str], viewport: dict[str, int]) -> Page:
    context = browser.new_context(viewport=viewport)
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(url + "/", wait_until="domcontentloaded")
    expect(page.get_by_role("tab", name="Image")).to_be_visible(timeout=UI_TIMEOUT_MS)
    return page


@pytest.fixture
def page(browser: Browser, app_url: str, page_errors: list[str]) -> Iterator[Page]:
    page = open_page(browser, app_url, page_errors, {"width": 1280, "height": 1100})
    yield page
    page.context.close()


def test_an_error_replaces_the_previous_answer(page: Page, page_errors: list[str]) -> None:
    page.get_by_role("tab", name="Text").click()
    page.locator("#text-input textarea").fill("I was charged twice for the same order")
    page.locator("#text-submit").click()
    expect(page.locator("#text-badge")).to_contain_text("Computed on", timeout=MODEL_TIMEOUT_MS)
    expect(top_class(page, "text-label")).to_have_text("payment_problem")

    page.locator("#text-input textarea").fill("   ")
    page.locator("#text-submit").click()
    # Where the answer was: what happened, and nothing left of the previous answer.
    expect(page.locator("#text-badge")).to_contain_text("Not classified", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#text-badge")).to_contain_text("The message is empty")
    expect(page.locator("#text-badge")).not_to_contain_text("Computed on")
    expect(top_class(page, "text-label")).to_have_count(0)
    expect(page.locator("#text-info")).not_to_contain_text("payment_problem")
    shot(page, "states-01-empty-message")
    assert_no_page_errors(page_errors)


def test_an_unreadable_file_is_named_when_chosen_then_on_classify(
    page: Page, page_errors: list[str], photo_dir: Path, tmp_path: Path
) -> None:
    upload_image(page, page_errors, photo_dir / "chelsea.png")
    page.locator("#image-submit").click()
    expect(page.locator("#image-badge")).to_contain_text("Computed on", timeout=MODEL_TIMEOUT_MS)

    fake = tmp_path / "holiday.png"
    fake.write_bytes(b"this is a text file, not a picture\n")
    upload_image(page, page_errors, fake)
    # Before Classify is pressed: the file is named unreadable, the previous answer gone.
    badge = page.locator("#image-badge")
    expect(badge).to_contain_text("This file is not an image we can read", timeout=UI_TIMEOUT_MS)
    expect(badge).not_to_contain_text("Computed on")
    expect(top_class(page, "image-label")).to_have_count(0)
    shot(page, "states-02-unreadable-chosen")

    page.locator("#image-submit").click()
    expect(badge).to_contain_text("Not classified", timeout=MODEL_TIMEOUT_MS)
    expect(badge).to_contain_text("not an image we can read")
    # An empty file: named at once too.
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    upload_image(page, page_errors, empty)
    expect(badge).to_contain_text("This file is not an image this app can read (The uploaded file is empty")
    shot(page, "states-03-unreadable-classified")

    # A readable file chosen again: the message goes.
    upload_image(page, page_errors, photo_dir / "coffee.png")
    expect(badge).not_to_contain_text("not an image", timeout=UI_TIMEOUT_MS)
    page.locator("#image-submit").click()
    expect(badge).to_contain_text("Computed on", timeout=MODEL_TIMEOUT_MS)
    assert_no_page_errors(page_errors)


def test_console_panels_that_are_off_say_so(page: Page, page_errors: list[str]) -> None:
    page.get_by_role("tab", name="Admin").click()
    sign_in(page, TOKEN)
    expect(page.locator("#admin-console")).to_be_visible(timeout=UI_TIMEOUT_MS)
    panels = {  # accordion: (what it says, how to turn it on, its buttons)
        "admin-hard-examples": ("Hard examples are off", "HARD_EXAMPLES_SIZE",
                                ["Refresh", "Save label", "Skip", "Delete", "Export"]),
        "admin-warmup": ("Warm-up is off", "WARM_SET_SIZE", ["Refresh progress"]),
        "admin-shadow": ("Shadow verification is off", "SHADOW_SAMPLE_RATE", ["Refresh"]),
    }  # fmt: skip
    for panel, (off, setting, buttons) in panels.items():
        accordion = page.locator(f"#{panel}")
        accordion.get_by_role("button").first.click()  # open it
        expect(accordion).to_contain_text(off)
        expect(accordion).to_contain_text(setting)
        expect(accordion).to_contain_text("restart the app")
        for name in buttons:
            button = accordion.get_by_role("button", name=name, exact=True)
            expect(button.first).to_be_disabled()
    shot(page, "states-04-console-off")
    assert_no_page_errors(page_errors)


def test_phone_width_keeps_chart_titles_and_the_api_link(
    browser: Browser, app_url: str, page_errors: list[str]
) -> None:
    page = open_page(browser, app_url, page_errors, PHONE)
    try:
        expect(page.get_by_text("Use via API")).to_be_visible()
        page.get_by_role("tab", name="Text").click()
        page.locator("#text-input textarea").fill("Where is my order?")
        page.locator("#text-submit").click()
        expect(page.locator("#text-badge")).to_contain_text("Computed on", timeout=MODEL_TIMEOUT_MS)

        page.get_by_role("tab", name="Admin").click()
        sign_in(page, TOKEN)
        expect(page.locator("#admin-console")).to_be_visible(timeout=UI_TIMEOUT_MS)
        for plot in ("admin-hit-rate", "admin-tiers", "admin-latency", "admin-hot-keys"):
            expect(page.locator(f"#{plot} .js-plotly-plot .gtitle")).to_be_attached(timeout=UI_TIMEOUT_MS)
        for accordion in page.locator("#admin-console .label-wrap").all():  # sizing curves etc.
            if accordion.get_attribute("class") and "open" not in (accordion.get_attribute("class") or ""):
                accordion.click()
        page.wait_for_timeout(1000)  # plotly lays out a chart as it comes into view
        titles = page.evaluate(TITLES_JS)
        assert len(titles) >= 4, titles
        cut = [t for t in titles if not t["inside"]]
        assert not cut, f"chart titles cut off at {PHONE['width']} px: {cut}"
        shot(page, "states-05-phone-charts")
        link = page.get_by_text("Use via API")
        link.scroll_into_view_if_needed()
        expect(link).to_be_in_viewport()
        link.click()
        expect(page.get_by_text("API documentation")).to_be_visible()
        shot(page, "states-06-phone-api-page")
        assert_no_page_errors(page_errors)
    finally:
        page.context.close()
