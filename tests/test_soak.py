"""The soak: a mixed load through the real app over HTTP, for SOAK_MINUTES (default 30).

Run with `make soak`, or `SOAK_MINUTES=1 make soak` for a short proof that it works.

One `python app.py` (the real entry point: both real models, a real redis-server, the SQLite
request log) serves four client threads for the whole run:

- a browser-like Gradio client: it keeps a `session_hash`, and opens a new one every
  `CALLS_PER_SESSION` calls, as tabs come and go;
- a curl-like Gradio client: no `session_hash`, so every call is its own one-shot session;
- a REST client: `POST /v2/models/{task}/infer`, JSON, images base64-encoded;
- a client that picks one of those three doors at random for each request.

Each request is text (60 %) or an image (40 %); a hit (one of the inputs answered during the
warm-up, 80 %) or a new input (20 %): a message never sent before, or a crop of a photo never
sent before. Images are uploaded with every Gradio call, as a client does.

Reported (printed, and written to test-artifacts/soak.txt): the app's resident memory (RSS,
sampled every `RSS_SAMPLE_S`), and the end-to-end latency percentiles of the first and the last
window (`WINDOW_MIN` minutes each, or a third of a shorter run), for all requests, hits and
new inputs.

Asserted (the bounds docs/DEVELOPMENT.md states):

- every request is answered, and a hit's top label is the one the warm-up got;
- RSS: the median of the last window is at most `RSS_GROWTH_MAX_MB` above the first's;
- latency of all requests: p50 of the last window at most `P50_DRIFT_MAX` x the first's +
  `P50_SLACK_S`, p99 at most `P99_DRIFT_MAX` x the first's + `P99_SLACK_S`. The factors absorb a
  shared machine's noise; what grows per request (sessions, event bookkeeping, a queue without
  a bound) grows past them over half an hour.
"""

from __future__ import annotations

import base64
import io
import itertools
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from faults.processes import AppProcess
from storage.redis.embedded import EmbeddedRedis
from testing.gradio_http import GradioHttpClient

SOAK_MINUTES = float(os.environ.get("SOAK_MINUTES", "30"))
WINDOW_MIN = 5.0
RSS_SAMPLE_S = 2.0
RSS_GROWTH_MAX_MB = 128.0
P50_DRIFT_MAX, P50_SLACK_S = 2.0, 0.05
P99_DRIFT_MAX, P99_SLACK_S = 3.0, 0.25

TEXT_SHARE = 0.6
NEW_INPUT_SHARE = 0.2
CALLS_PER_SESSION = 40
THINK_S = 0.05  # between one client's requests: a busy app, not a saturated one
REQUEST_TIMEOUT_S = 60.0
PHOTOS = ("chelsea.png", "coffee.png", "astronaut.png", "motorcycle_right.png", "rocket.jpg")
CROP = 240
TEXT_TEMPLATES = (
    "Where is my order {n}? It has not arrived yet.",
    "I want a refund for order {n}, the item was broken.",
    "How do I change the delivery address of order {n}?",
    "Please cancel order {n}, I ordered it by mistake.",
    "Can I speak to a human about order {n}?",
)
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

pytestmark = [pytest.mark.soak, pytest.mark.redis]


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the load began, at the answer
    latency_s: float
    door: str
    task: str
    new: bool


@dataclass(frozen=True)
class Case:
    task: str
    payload: bytes | str  # image file bytes, or the message
    name: str = ""


class Inputs:
    """Hot inputs (answered in the warm-up) and a source of inputs never sent before."""

    def __init__(self, photo_dir: Path) -> None:
        self._photos = [np.asarray(Image.open(photo_dir / name).convert("RGB")) for name in PHOTOS]
        self._serial = itertools.count()  # next() is atomic in CPython: safe across threads
        self.hot_texts = [t.format(n=n) for t in TEXT_TEMPLATES for n in range(8)]
        self.hot_images = [self._image(next(self._serial)) for _ in range(12)]

    def _image(self, n: int) -> bytes:
        photo = self._photos[n % len(self._photos)]
        rows, cols = photo.shape[0] - CROP, photo.shape[1] - CROP
        rng = random.Random(n)
        y, x = rng.randrange(rows), rng.randrange(cols)
        crop = photo[y : y + CROP, x : x + CROP].copy()
        crop[0, 0] = [n % 256, (n // 256) % 256, (n // 65536) % 256]  # unique pixels: a new key
        out = io.BytesIO()
        Image.fromarray(crop).save(out, format="PNG")
        return out.getvalue()

    def pick(self, rng: random.Random) -> tuple[Case, bool]:
        new = rng.random() < NEW_INPUT_SHARE
        if rng.random() < TEXT_SHARE:
            if new:
                text = rng.choice(TEXT_TEMPLATES).format(n=f"N{next(self._serial)}")
            else:
                text = rng.choice(self.hot_texts)
            return Case("text", text), new
        image = self._image(next(self._serial)) if new else rng.choice(self.hot_images)
        return Case("image", image, "photo.png"), new


class Doors:
    """One client's three ways in. Each answer is (top label, tier)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.session = GradioHttpClient(url, timeout_s=REQUEST_TIMEOUT_S)
        self.oneshot = GradioHttpClient(url, timeout_s=REQUEST_TIMEOUT_S)
        self.rest = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)
        self._session_calls = 0
        self._sessions = itertools.count()

    def gradio_session(self, case: Case) -> tuple[str, str]:
        if self._session_calls % CALLS_PER_SESSION == 0:  # a new tab
            self.session.session_hash = f"soak{threading.get_ident()}x{next(self._sessions)}"
        self._session_calls += 1
        return self._gradio(self.session, case)

    def gradio_oneshot(self, case: Case) -> tuple[str, str]:
        return self._gradio(self.oneshot, case)

    @staticmethod
    def _gradio(client: GradioHttpClient, case: Case) -> tuple[str, str]:
        if isinstance(case.payload, bytes):
            data: list[Any] = [client.upload_file(case.name, case.payload, "image/png")]
        else:
            data = [case.payload]
        label, info = client.call(f"classify_{case.task}", data).outputs
        return label["label"], info["tier"]

    def rest_call(self, case: Case) -> tuple[str, str]:
        if isinstance(case.payload, bytes):
            element = base64.b64encode(case.payload).decode()
            extra: dict[str, Any] = {"parameters": {"content_type": "base64"}}
        else:
            element, extra = case.payload, {}
        body = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": [element], **extra}]}
        response = self.rest.post(f"/v2/models/{case.task}/infer", json=body)
        response.raise_for_status()
        answer = response.json()
        labels = next(o for o in answer["outputs"] if o["name"] == "label")["data"]
        return labels[0], answer["parameters"]["tier"]

    def by_name(self) -> dict[str, Callable[[Case], tuple[str, str]]]:
        return {"gradio-session": self.gradio_session, "gradio-oneshot": self.gradio_oneshot,
                "rest": self.rest_call}  # fmt: skip

    def close(self) -> None:
        self.session.close()
        self.oneshot.close()
        self.rest.close()


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@pytest.fixture
def app(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[AppProcess]:
    process = AppProcess("soak", data_dir=tmp_path / "app", redis_url=redis_server.url)
    process.start()
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.mark.timeout(int(SOAK_MINUTES * 60) + 900)
def test_soak_memory_and_latency_hold_under_mixed_load(app: AppProcess, photo_dir: Path) -> None:
    assert app.pid is not None
    pid: int = app.pid
    inputs = Inputs(photo_dir)
    # Warm-up: every hot input answered once (the caches are shared by every door).
    expected: dict[str | bytes, str] = {}
    warm = Doors(app.url)
    try:
        for text in inputs.hot_texts:
            expected[text] = warm.rest_call(Case("text", text))[0]
        for image in inputs.hot_images:
            expected[image] = warm.gradio_oneshot(Case("image", image, "photo.png"))[0]
    finally:
        warm.close()

    duration_s = SOAK_MINUTES * 60
    window_s = min(WINDOW_MIN * 60, duration_s / 3)
    samples: list[Sample] = []
    failures: list[str] = []
    rss: list[tuple[float, float]] = []
    stop = threading.Event()
    started = time.monotonic()

    def client(n: int, door: str | None) -> None:
        rng = random.Random(n)
        doors = Doors(app.url)
        calls = doors.by_name()
        try:
            while not stop.is_set():
                case, new = inputs.pick(rng)
                name = door or rng.choice(sorted(calls))
                sent = time.monotonic()
                try:
                    label, tier = calls[name](case)
                except Exception as exc:  # any failure of a request is a finding
                    failures.append(f"{name} {case.task}: {type(exc).__name__}: {str(exc)[:200]}")
                else:
                    done = time.monotonic()
                    samples.append(Sample(done - started, done - sent, name, case.task, new))
                    if not new and (label != expected[case.payload] or tier != "l1"):
                        failures.append(f"{name} {case.task} hit: {label} from {tier}, "
                                        f"warm-up said {expected[case.payload]}")  # fmt: skip
                stop.wait(THINK_S)
        finally:
            doors.close()

    def sample_rss() -> None:
        while not stop.is_set():
            rss.append((time.monotonic() - started, rss_mb(pid)))
            stop.wait(RSS_SAMPLE_S)

    threads = [
        threading.Thread(target=client, args=(n, door), name=f"soak-{n}", daemon=True)
        for n, door in enumerate(("gradio-session", "gradio-oneshot", "rest", None))
    ]
    threads.append(threading.Thread(target=sample_rss, name="soak-rss", daemon=True))
    for thread in threads:
        thread.start()
    try:
        stop.wait(duration_s)
    finally:
        stop.set()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S + 5)
    assert [t.name for t in threads if t.is_alive()] == [], "a soak client never finished"
    end = max((s.t for s in samples), default=duration_s)

    def window(first: bool) -> list[Sample]:
        return [s for s in samples if (s.t < window_s if first else s.t >= end - window_s)]

    def rss_median(first: bool) -> float:
        return statistics.median(mb for t, mb in rss if (t < window_s if first else t >= end - window_s))

    first, last = window(True), window(False)
    lines = [
        f"soak: {SOAK_MINUTES:g} min, {len(samples):,} requests ({len(samples) / end:.1f}/s), "
        f"{len(failures)} failed; windows of {window_s / 60:.1f} min",
        f"by door: { {d: sum(s.door == d for s in samples) for d in sorted({s.door for s in samples})} }",
        f"RSS MB: first window median {rss_median(True):.0f}, last {rss_median(False):.0f}, "
        f"max {max(mb for _, mb in rss):.0f} (bound: +{RSS_GROWTH_MAX_MB:.0f})",
        f"{'latency ms':<22}{'first p50':>10}{'last p50':>10}{'first p99':>11}{'last p99':>10}{'n first':>9}",
    ]
    groups: dict[str, Callable[[Sample], bool]] = {
        "all": lambda s: True,
        "hits": lambda s: not s.new,
        "new inputs": lambda s: s.new,
        "text": lambda s: s.task == "text",
        "image": lambda s: s.task == "image",
    }
    for label, keep in groups.items():
        a = [s.latency_s * 1000 for s in first if keep(s)]
        b = [s.latency_s * 1000 for s in last if keep(s)]
        lines.append(f"{label:<22}{percentile(a, 50):>10.1f}{percentile(b, 50):>10.1f}"
                     f"{percentile(a, 99):>11.1f}{percentile(b, 99):>10.1f}{len(a):>9}")  # fmt: skip
    report = "\n".join(lines)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "soak.txt").write_text(report + "\n" + "\n".join(failures[:50]) + "\n")
    print("\n" + report)

    assert failures == [], failures[:10]
    assert len(first) >= 20 and len(last) >= 20, "too few requests to judge drift"
    assert {s.door for s in samples} == {"gradio-session", "gradio-oneshot", "rest"}
    assert rss_median(False) <= rss_median(True) + RSS_GROWTH_MAX_MB, report
    p50 = [percentile([s.latency_s for s in w], 50) for w in (first, last)]
    p99 = [percentile([s.latency_s for s in w], 99) for w in (first, last)]
    assert p50[1] <= P50_DRIFT_MAX * p50[0] + P50_SLACK_S, report
    assert p99[1] <= P99_DRIFT_MAX * p99[0] + P99_SLACK_S, report
