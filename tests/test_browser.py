"""End to end in headless Chromium: the real app (real models, real Redis) driven like a person.

Uses Debian's `chromium` package through Playwright's sync API (Playwright's own browser
downloads are never used). Screenshots of every step land in test-artifacts/.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from storage.redis.embedded import EmbeddedRedis
from tests.conftest import free_port
from ui.server import BackgroundServer, build_app

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CAT = re.compile(r"^(tabby|tiger cat|Egyptian cat)$")
# The first miss runs the model on CPU (2 cores in CI); hits and UI updates are fast.
MODEL_TIMEOUT_MS = 30_000
UI_TIMEOUT_MS = 15_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.is_file():
        pytest.fail(
            f"{CHROMIUM} not found: the browser tests drive Debian's Chromium. Install the Debian "
            "package `chromium` (`apt-get install -y chromium`, or run `make test` as root)."
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            headless=True,
        )
        yield browser
        browser.close()


ADMIN_TOKEN = "browser-test-admin-token"


@pytest.fixture
def app_url(make_runtime, real_models, redis_server: EmbeddedRedis) -> Iterator[str]:
    runtime = make_runtime(models=real_models, redis__url=redis_server.url, server__admin_token=ADMIN_TOKEN)
    server = BackgroundServer(build_app(runtime), port=free_port()).start()
    yield server.url
    server.close()


@pytest.fixture
def page_errors() -> list[str]:
    """Uncaught JavaScript errors of the page under test."""
    return []


@pytest.fixture
def page(browser: Browser, app_url: str, page_errors: list[str]) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 1100})
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    page.goto(app_url + "/", wait_until="domcontentloaded")
    expect(page.get_by_role("tab", name="Image")).to_be_visible(timeout=UI_TIMEOUT_MS)
    yield page
    context.close()


# Resolves once no short animation (a toast flying in) is running; long ones (a toast's timer bar)
# are ignored. Svelte chains its transitions, so this re-checks after each frame.
SETTLE_ANIMATIONS_JS = """async () => {
    const short = a => { const end = a.effect && a.effect.getComputedTiming().endTime;
                         return Number.isFinite(end) && end < 2000; };
    for (let i = 0; i < 20; i++) {
        await new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
        const running = document.getAnimations().filter(a => a.playState !== "finished" && short(a));
        if (running.length === 0) return;
        await Promise.all(running.map(a => a.finished.catch(() => null)));
    }
}"""


def shot(page: Page, name: str) -> None:
    # Viewport, not full_page: Chromium's full-page capture drops fixed elements such as toasts.
    ARTIFACTS.mkdir(exist_ok=True)
    page.evaluate(SETTLE_ANIMATIONS_JS)
    page.screenshot(path=str(ARTIFACTS / f"browser-{name}.png"))


def image_file_input(page: Page, page_errors: list[str]) -> Locator:
    """The <input type=file> inside the Photo component, with the page's errors if it never renders."""
    file_input = page.locator("#image-input input[type=file]")
    try:
        file_input.wait_for(state="attached", timeout=UI_TIMEOUT_MS)
    except PlaywrightTimeoutError:
        pytest.fail(
            "the Photo component (#image-input) did not render, so there is nowhere to upload. "
            f"JavaScript errors on the page: {page_errors}"
        )
    return file_input


def upload_image(page: Page, page_errors: list[str], path: Path) -> None:
    image_file_input(page, page_errors).set_input_files(str(path))


def top_class(page: Page, label_id: str) -> Locator:
    """The headline of a gr.Label: its top class."""
    return page.locator(f"#{label_id}").get_by_role("heading")


def assert_no_page_errors(errors: list[str]) -> None:
    assert not errors, f"JavaScript errors on the page: {errors}"


def test_page_loads_with_image_and_text_tabs(page: Page, page_errors: list[str]) -> None:
    expect(page.get_by_role("tab", name="Image")).to_be_visible()
    expect(page.get_by_role("tab", name="Text")).to_be_visible()
    expect(page.get_by_role("tab", name="Admin")).to_be_visible()
    image_file_input(page, page_errors)
    expect(page.locator("#image-input")).to_be_visible()
    expect(page.locator("#image-submit")).to_be_visible()
    shot(page, "01-loaded")
    assert_no_page_errors(page_errors)


def test_image_is_computed_then_served_from_memory(
    page: Page, page_errors: list[str], photo_dir: Path
) -> None:
    photo = photo_dir / "chelsea.png"
    upload_image(page, page_errors, photo)
    page.locator("#image-submit").click()
    expect(top_class(page, "image-label")).to_have_text(CAT, timeout=MODEL_TIMEOUT_MS)
    expect(page.locator("#image-badge")).to_contain_text("Computed on", timeout=UI_TIMEOUT_MS)
    shot(page, "02-image-computed")

    upload_image(page, page_errors, photo)
    # The new photo's upload check clears the last answer (its own event, outside the queue):
    # classified only once it has, or a hit answered faster than that check can be wiped by it.
    expect(top_class(page, "image-label")).to_have_count(0, timeout=UI_TIMEOUT_MS)
    page.locator("#image-submit").click()
    expect(page.locator("#image-badge")).to_contain_text("Served from memory", timeout=UI_TIMEOUT_MS)
    expect(top_class(page, "image-label")).to_have_text(CAT)
    shot(page, "03-image-from-memory")
    assert_no_page_errors(page_errors)


def test_text_message_shows_its_intent(page: Page, page_errors: list[str]) -> None:
    page.get_by_role("tab", name="Text").click()
    page.get_by_text("Can I talk to a real person please?").click()  # one of the examples
    expect(page.locator("#text-input textarea")).to_have_value("Can I talk to a real person please?")
    page.locator("#text-submit").click()
    expect(top_class(page, "text-label")).to_have_text("human_agent", timeout=MODEL_TIMEOUT_MS)
    expect(page.locator("#text-badge")).to_contain_text("Computed on", timeout=UI_TIMEOUT_MS)
    page.locator("#text-input textarea").fill("Where is my parcel?")
    page.locator("#text-submit").click()
    expect(top_class(page, "text-label")).to_have_text("order_status", timeout=MODEL_TIMEOUT_MS)
    expect(page.locator("#text-badge")).to_contain_text("Computed on", timeout=UI_TIMEOUT_MS)
    shot(page, "04-text-intent")
    assert_no_page_errors(page_errors)


def test_bad_upload_shows_a_readable_error(page: Page, page_errors: list[str], tmp_path: Path) -> None:
    fake = tmp_path / "not-really.png"
    fake.write_bytes(b"this is a text file, not a picture\n")
    upload_image(page, page_errors, fake)
    page.locator("#image-submit").click()
    # Said in the answer area (and in a toast).
    expect(page.locator("#image-badge")).to_contain_text("not an image we can read", timeout=MODEL_TIMEOUT_MS)
    shot(page, "05-bad-upload")
    expect(page.locator("body")).not_to_contain_text("Traceback")
    expect(page.locator("#image-badge")).not_to_contain_text("Computed on")
    assert_no_page_errors(page_errors)


PLOT_DATA_JS = """(id) => {
    const plot = document.querySelector(`#${id} .js-plotly-plot`);
    if (!plot || !plot.data) return null;
    const values = trace => (trace.orientation === "h" ? trace.x : trace.y) || [];
    return plot.data.map(trace => Array.from(values(trace)).reduce((a, b) => a + Number(b || 0), 0));
}"""


def sign_in(page: Page, token: str) -> None:
    page.locator("#admin-token input").fill(token)
    page.locator("#admin-signin").click()


def test_admin_console_signs_in_charts_and_flushes(
    page: Page, page_errors: list[str], photo_dir: Path
) -> None:
    photo = photo_dir / "chelsea.png"
    upload_image(page, page_errors, photo)
    page.locator("#image-submit").click()
    expect(page.locator("#image-badge")).to_contain_text("Computed on", timeout=MODEL_TIMEOUT_MS)
    page.locator("#image-submit").click()
    expect(page.locator("#image-badge")).to_contain_text("Served from memory", timeout=UI_TIMEOUT_MS)

    page.get_by_role("tab", name="Admin").click()
    sign_in(page, "not-the-token")
    expect(page.locator("#admin-login-msg")).to_contain_text("not right", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#admin-console")).to_be_hidden()
    shot(page, "06-admin-refused")

    sign_in(page, ADMIN_TOKEN)
    expect(page.locator("#admin-console")).to_be_visible(timeout=UI_TIMEOUT_MS)
    expect(page.locator("#admin-cards")).to_contain_text("Hit rate", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#admin-cards")).to_contain_text("50.0%")
    for plot in ("admin-hit-rate", "admin-tiers", "admin-latency", "admin-hot-keys"):
        expect(page.locator(f"#{plot} .js-plotly-plot")).to_be_attached(timeout=UI_TIMEOUT_MS)
        totals = page.evaluate(PLOT_DATA_JS, plot)
        assert totals and sum(totals) > 0, f"{plot} has no data: {totals}"
    tiers = page.evaluate(PLOT_DATA_JS, "admin-tiers")
    assert tiers[:1] == [1] and sum(tiers) == 2  # one L1 hit, one miss (stacked traces: l1 first)
    shot(page, "07-admin-console")

    page.locator("#admin-flush-confirm input").check()
    page.locator("#admin-flush").click()
    expect(page.locator("#admin-action-result")).to_contain_text("Flushed all", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#admin-audit")).to_contain_text("flush", timeout=UI_TIMEOUT_MS)
    shot(page, "08-admin-flushed")

    page.get_by_role("tab", name="Image").click()
    page.locator("#image-submit").click()
    expect(page.locator("#image-badge")).to_contain_text("Computed on", timeout=MODEL_TIMEOUT_MS)
    assert_no_page_errors(page_errors)


def test_how_it_works_shows_the_live_hit_rate(page: Page, page_errors: list[str]) -> None:
    page.get_by_role("tab", name="Text").click()
    for message in ("I was charged twice for the same order", "I was charged  TWICE for the same order"):
        page.locator("#text-input textarea").fill(message)
        page.locator("#text-submit").click()
        expect(top_class(page, "text-label")).to_have_text("payment_problem", timeout=MODEL_TIMEOUT_MS)
    expect(page.locator("#text-badge")).to_contain_text("Served from memory", timeout=UI_TIMEOUT_MS)
    page.get_by_role("tab", name="How it works").click()
    # Refreshed every 5 s by a timer: 2 answers, one of them a hit.
    expect(page.locator("#live-stats")).to_contain_text("hit rate 50.0%", timeout=UI_TIMEOUT_MS)
    shot(page, "09-how-it-works")
    assert_no_page_errors(page_errors)
