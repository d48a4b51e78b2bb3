"""Fuzzing Gradio's HTTP API of the served app (real models, real HTTP) with hypothesis.

Three runs: bodies of the two-step call (`POST /gradio_api/call/classify_text|classify_image`,
JSON of every shape, file references to anything, raw and truncated bytes, chunked or not),
bodies of `/gradio_api/queue/join` (the browser's protocol; any fn_index but the Admin
tab's), and image files (PNG, JPEG, BMP, WebP and GIF with flipped bytes, cut short, or
declaring huge dimensions) uploaded and classified. Over each run: no answer is a 5xx, no
traceback reaches the log (log records or stderr), /healthz polled all along answers
fast (p99 under 0.5 s), and the process's memory grows by a bounded amount.

FUZZ_EXAMPLES sets the examples per run (default 120, under a minute for the file here);
a longer run on demand: `FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_fuzz_gradio.py`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from faults.scenarios_abandoned import WRONG_VALUES
from settings import Settings
from tests.served_app import HealthWatch, Served, rss_bytes, served_app

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "120"))
FILE_META = {"_type": "gradio.FileData"}
MIB = 2**20
# The app under test decodes at most 4 MP (12 MB of RGB) per image. Memory may grow while
# decoders, the models and Gradio allocate on first use (the first half of a run); in the
# second half a leak of anything the size of an input would pass the steady bound.
MAX_PIXELS = 4_000_000
RSS_GROWTH_LIMIT = 400 * MIB
RSS_STEADY_LIMIT = 150 * MIB
HEALTHZ_P99_S = 0.5  # quiet: a few milliseconds; the machine is shared with the fuzzer itself
HEALTHZ_MAX_S = 3.0
FUZZED_EVENTS = ("classify_text", "classify_image", "load_example", "load_example_1")


@pytest.fixture(scope="module")
def served(base_settings: Settings, real_models, tmp_path_factory) -> Iterator[Served]:
    with served_app(
        base_settings, real_models, tmp_path_factory.mktemp("fuzz"), limits__max_image_pixels=MAX_PIXELS
    ) as app:
        yield app


@pytest.fixture(scope="module")
def events(served: Served) -> dict[str, int]:
    """fn_index of each event by API name (the page's config)."""
    return {d["api_name"]: d["id"] for d in served.http.get("/config").json()["dependencies"]}


@pytest.fixture(scope="module")
def uploaded(served: Served, photo_bytes) -> dict[str, Any]:
    """A FileData of a real upload (a valid reference the fuzzer may mix in), classified once
    so that both models have run (a first pass allocates for good) before memory is measured."""
    photo = {"files": ("cat.png", photo_bytes("chelsea.png"))}
    reference = {
        "path": served.http.post("/gradio_api/upload", files=photo).json()[0],
        "meta": dict(FILE_META),
    }
    for api_name, item in (("classify_image", reference), ("classify_text", "Where is my parcel?")):
        result_stream(
            served, api_name, served.http.post(f"/gradio_api/call/{api_name}", json={"data": [item]})
        )
    return reference


class Run:
    """What one fuzz run reached (a tally, printed with pytest -s), and the process's memory
    when it starts, half-way through its examples (the first-use allocations of decoders
    and of Gradio are done by then) and at its end."""

    def __init__(self) -> None:
        self.tally: Counter[str] = Counter()
        self.rss = [rss_bytes()]

    def count(self, outcome: str) -> None:
        self.tally[outcome] += 1
        if sum(self.tally.values()) == EXAMPLES // 2:
            self.rss.append(rss_bytes())


@pytest.fixture
def run(served: Served, caplog, capfd) -> Iterator[Run]:
    """Around one fuzz run: /healthz watched, memory measured, the log read for tracebacks."""
    caplog.set_level(logging.WARNING)  # what is kept is what is checked: INFO lines add up over a long run
    watch = Run()
    with HealthWatch(served.url) as health:
        yield watch
    start, half, end = watch.rss[0], watch.rss[-1], rss_bytes()  # half is start if the run stopped early
    first, second = (half - start) / MIB, (end - half) / MIB
    with capfd.disabled():
        print(
            f"\n{dict(watch.tally)}; RSS +{first:.0f}, +{second:.0f} MiB; /healthz p99 {health.p99_s:.2f} s"
        )
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [f"{r.name}: {r.getMessage()[:300]}" for r in errors[:5]]
    stderr = capfd.readouterr().err
    assert "Traceback" not in stderr, stderr[stderr.index("Traceback") :][:3000]
    assert not health.failures, health.failures[:3]
    assert health.p99_s < HEALTHZ_P99_S and health.slowest_s < HEALTHZ_MAX_S, (health.p99_s, health.slowest_s)
    assert end - start < RSS_GROWTH_LIMIT and end - half < RSS_STEADY_LIMIT, (
        (half - start) / MIB,
        (end - half) / MIB,
    )


def fuzz(strategy: st.SearchStrategy[Any]) -> Callable[[Callable[[Any], None]], Callable[[], None]]:
    """Run the decorated check on EXAMPLES values of `strategy` (one server for all)."""
    return lambda check: settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )(given(strategy)(check))


# ---- strategies ---------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", " ", "\ud800", "\x00", "é" * 300, "Where is my parcel?"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def file_references(app_url: str, uploaded: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    named = [uploaded["path"], f"{app_url}/gradio_api/file={uploaded['path']}", f"{app_url}/healthz"]
    named += [
        "http://127.0.0.1:1/x.png",
        "https://example.invalid/a.png",
        "file:///etc/passwd",
        "/etc/passwd",
    ]
    named += ["../../etc/passwd", "x.png", "", "data:image/png;base64,iVBORw0KGgo="]
    paths = st.sampled_from(named) | st.text(max_size=30)
    metas = st.sampled_from([FILE_META, {"_type": 5}, {}, {"_type": "gradio.FileData", "x": 1}]) | json_values
    optional = {"url": paths | json_values, "size": scalars, "orig_name": scalars, "mime_type": scalars,
                "is_stream": scalars}  # fmt: skip
    return st.fixed_dictionaries({"path": paths | scalars, "meta": metas}, optional=optional)


def data_lists(app_url: str, uploaded: dict[str, Any]) -> st.SearchStrategy[Any]:
    item = json_values | file_references(app_url, uploaded) | st.just(uploaded)
    return st.lists(item, max_size=3) | json_values


def encoded(bodies: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """JSON bytes of `bodies`, sometimes cut short, or any bytes at all."""
    as_json = bodies.map(lambda body: json.dumps(body).encode())
    cut = st.tuples(as_json, st.integers(min_value=0, max_value=200)).map(lambda pair: pair[0][: pair[1]])
    return mostly(as_json, cut | st.binary(max_size=300))


def mostly(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`usual` three times in four: enough well-formed requests get past the first check."""
    return st.one_of(usual, usual, usual, odd)


def call_bodies(app_url: str, uploaded: dict[str, Any]) -> st.SearchStrategy[bytes]:
    extra = {"session_hash": mostly(st.text(max_size=20), scalars), "event_data": json_values,
             "fn_index": scalars, "trigger_id": scalars}  # fmt: skip
    one_item = st.lists(json_values | file_references(app_url, uploaded), min_size=1, max_size=1)
    data = mostly(one_item, data_lists(app_url, uploaded))
    return encoded(mostly(st.fixed_dictionaries({"data": data}, optional=extra), json_values))


def join_bodies(app_url: str, uploaded: dict[str, Any], events: dict[str, int]) -> st.SearchStrategy[bytes]:
    fuzzed = [events[name] for name in FUZZED_EVENTS]
    # Any fn_index but the Admin tab's events: their widgets (radios, state) take what the page sends.
    others = set(events.values()) - set(fuzzed)
    fn_index = mostly(
        st.sampled_from(fuzzed), st.integers().filter(lambda i: i not in others) | st.text(max_size=5)
    )
    session = mostly(st.text(min_size=1, max_size=20), scalars)
    one_item = st.lists(json_values | file_references(app_url, uploaded), min_size=1, max_size=1)
    body = st.fixed_dictionaries(
        {
            "data": mostly(one_item, data_lists(app_url, uploaded)),
            "fn_index": fn_index,
            "session_hash": session,
        },
        optional={
            "event_data": json_values,
            "trigger_id": mostly(st.integers(), scalars),
            "batched": mostly(st.booleans(), scalars),
            "event_id": mostly(st.text(max_size=8), scalars),
        },
    )
    return encoded(body)


# ---- image files --------------------------------------------------------------------


def image_files() -> dict[str, bytes]:
    photo = Image.linear_gradient("L").resize((64, 48)).convert("RGB")
    files = {}
    for fmt in ("PNG", "JPEG", "BMP", "WEBP", "GIF"):
        buffer = io.BytesIO()
        photo.save(buffer, fmt)
        files[fmt] = buffer.getvalue()
    return files


BASE_IMAGES = image_files()


def declare_size(data: bytes, fmt: str, width: int, height: int) -> bytes:
    """The file with its header claiming width x height (PNG's CRC recomputed, so that
    the decoder believes it)."""
    out = bytearray(data)
    if fmt == "PNG":
        out[16:24] = struct.pack(">II", width % 2**31, height % 2**31)
        out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])))
    elif fmt == "BMP":
        out[18:26] = struct.pack("<ii", width % 2**31, height % 2**31)
    elif fmt == "GIF":
        out[6:10] = struct.pack("<HH", width % 2**16, height % 2**16)
    elif fmt == "JPEG" and (sof := data.find(b"\xff\xc0")) > 0:
        out[sof + 5 : sof + 9] = struct.pack(">HH", height % 2**16, width % 2**16)
    elif fmt == "WEBP":
        out[26:30] = struct.pack("<HH", width % 2**14, height % 2**14)
    return bytes(out)


@st.composite
def mutated_images(draw: st.DrawFn) -> tuple[str, bytes]:
    fmt = draw(st.sampled_from(sorted(BASE_IMAGES)))
    data = BASE_IMAGES[fmt]
    how = draw(st.sampled_from(["flip", "truncate", "size", "size+flip", "none"]))
    if how.startswith("size"):
        huge = st.integers(min_value=0, max_value=2**31 - 1) | st.sampled_from(
            [0, 1, 65535, 100_000, 2**31 - 1]
        )
        data = declare_size(data, fmt, draw(huge), draw(huge))
    if how.endswith("flip"):
        out = bytearray(data)
        for _ in range(draw(st.integers(min_value=1, max_value=12))):
            out[draw(st.integers(min_value=0, max_value=len(out) - 1))] = draw(st.integers(0, 255))
        data = bytes(out)
    if how == "truncate":
        data = data[: draw(st.integers(min_value=0, max_value=len(data)))]
    return fmt, data


# ---- the runs ----------------------------------------------------------------------


def result_stream(served: Served, api_name: str, queued: httpx.Response) -> str:
    """Read a queued call's result to its end: "complete" or "error"."""
    event_id = queued.json()["event_id"]
    stream = served.http.get(f"/gradio_api/call/{api_name}/{event_id}")
    assert stream.status_code == 200, stream.text[:300]
    assert "event: complete" in stream.text or "event: error" in stream.text, stream.text[:300]
    return "complete" if "event: complete" in stream.text else "error"


def queue_result(served: Served, session_hash: str) -> None:
    """Read a session's queue stream until its call completes (or the stream closes). A hash
    that cannot travel in a URL (a lone surrogate) names a session no client can read."""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in session_hash):
        return
    params = {"session_hash": session_hash}
    with served.http.stream("GET", "/gradio_api/queue/data", params=params, timeout=30) as stream:
        assert stream.status_code < 500
        for line in stream.iter_lines():
            if "process_completed" in line or "close_stream" in line:
                return


def test_call_bodies(served: Served, uploaded: dict[str, Any], run: Run) -> None:
    kinds = st.sampled_from(["application/json"] * 4 + ["application/x-www-form-urlencoded", "text/plain"])

    @fuzz(st.tuples(st.sampled_from(["classify_text", "classify_image"]), call_bodies(served.url, uploaded),
                    kinds, st.booleans()))  # fmt: skip
    def one(case: tuple[str, bytes, str, bool]) -> None:
        api_name, body, content_type, chunked = case
        content: Any = iter([body[: len(body) // 2], body[len(body) // 2 :]]) if chunked else body
        queued = served.http.post(f"/gradio_api/call/{api_name}", content=content,
                                  headers={"content-type": content_type})  # fmt: skip
        assert queued.status_code < 500, (queued.status_code, body[:300], queued.text[:300])
        run.count(f"{api_name} {queued.status_code}")
        if queued.status_code == 200:
            result_stream(served, api_name, queued)

    one()


def test_queue_join_bodies(
    served: Served, uploaded: dict[str, Any], events: dict[str, int], run: Run
) -> None:

    @fuzz(join_bodies(served.url, uploaded, events))
    def one(body: bytes) -> None:
        queued = served.http.post(
            "/gradio_api/queue/join", content=body, headers={"content-type": "application/json"}
        )
        assert queued.status_code < 500, (queued.status_code, body[:300], queued.text[:300])
        run.count(f"queue/join {queued.status_code}")
        if queued.status_code == 200:
            queue_result(served, json.loads(body)["session_hash"])

    one()


def test_image_files(served: Served, run: Run) -> None:

    @fuzz(mutated_images())
    def one(image: tuple[str, bytes]) -> None:
        fmt, data = image
        name = f"fuzz.{fmt.lower()}"
        upload = served.http.post("/gradio_api/upload", files={"files": (name, data, f"image/{fmt.lower()}")})
        assert upload.status_code == 200, upload.text[:300]
        reference = {"path": upload.json()[0], "meta": dict(FILE_META), "orig_name": name}
        queued = served.http.post("/gradio_api/call/classify_image", json={"data": [reference]})
        assert queued.status_code == 200, queued.text[:300]
        run.count(f"{fmt} {result_stream(served, 'classify_image', queued)}")

    one()


# ---- every event of the page, with wrong values ------------------------------------------

def test_every_event_of_the_page_with_wrong_values_is_refused_without_a_traceback(
    served: Served, run: Run
) -> None:
    """Each function in /config, front-end-only ones (`js`, no server function) included, is
    sent every wrong value on each of its inputs, with and without a trigger_id: a clear refusal
    or Gradio's error event, never a 5xx or a traceback (the `run` fixture reads the log)."""
    dependencies = served.http.get("/config").json()["dependencies"]
    assert any(not d.get("backend_fn", True) for d in dependencies)  # a browser-only event is walked
    for dependency in dependencies:
        inputs = len(dependency["inputs"])
        for n, wrong in enumerate(WRONG_VALUES):
            body = {"data": [wrong] * max(inputs, 1), "fn_index": dependency["id"],
                    "session_hash": f"walk-{dependency['id']}-{n}"}  # fmt: skip
            if n % 2:
                body["trigger_id"] = dependency["targets"][0][0] if dependency["targets"] else 10**9
            queued = served.http.post("/gradio_api/queue/join", content=json.dumps(body).encode(),
                                      headers={"content-type": "application/json"})  # fmt: skip
            assert queued.status_code < 500, (dependency["id"], wrong, queued.text[:300])
            run.count(f"event {queued.status_code}")
            if queued.status_code == 200:
                queue_result(served, body["session_hash"])
