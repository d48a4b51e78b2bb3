"""Fuzzing the REST face (issue 23): hypothesis on Triton's binary tensor extension (the parser
directly, many examples, then a bounded number through HTTP), hypothesis image bytes through
/v2, and schemathesis on the app's OpenAPI schema (/v2 and /admin/api, with and without the
admin token), all against a served app over stand-in models and a real Redis.

While requests run through HTTP the server is watched: no 5xx, no traceback or error in its log
(uvicorn's own loggers included), `/healthz` polled concurrently with bounded latency, and the
process's RSS growth bounded.

`make test` runs a bounded number of examples. A longer run on demand:

    FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_fuzz_rest.py

FUZZ_EXAMPLES is the number of examples of each parser property (default 500, the file in about
a minute on 2 cores); each HTTP run takes a fifth of it, and the schema fuzzing a fiftieth per
operation, per generation mode (positive, negative) and per token state (at least 4).
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import schemathesis
import tritonclient.http as triton
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from PIL import Image
from schemathesis import GenerationMode

from api.errors import MAX_MESSAGE_CHARS, RequestRefused
from api.tensors import InferRequest, json_separators, parse_infer_request
from engine.inputs import CanonicalImage, canonicalize_image
from engine.models.base import Prediction
from runtime import Runtime
from storage.redis.embedded import EmbeddedRedis
from tests.conftest import CountingTextModel

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "500"))
HTTP_EXAMPLES = max(EXAMPLES // 5, 20)
SCHEMA_EXAMPLES = max(EXAMPLES // 50, 4)
TOKEN = "fuzz-operator-token"
MAX_ELEMENTS = 8  # the parser's element cap in the direct tests
UPLOAD_BYTES = 200_000  # the served app's MAX_UPLOAD_BYTES: big enough for the drawn images
# What a healthy server answers /healthz within while it is fuzzed, and how much its process may
# grow (RSS). Quiet: a few ms; fuzzed, on a shared 2-core machine, up to ~0.75 s, the full GC
# pauses (170-320 ms each) of this process, which also holds hypothesis, schemathesis and Gradio.
# The request that froze the server held it for 12 s.
HEALTHZ_MAX_S = 2.0
RSS_GROWTH_MAX_MB = 150
_LENGTH = struct.Struct("<I")
PYTHON_RECURSION_LIMIT = 1000  # CPython's default

_QUIET_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                 HealthCheck.function_scoped_fixture]  # fmt: skip
FUZZ_SETTINGS = settings(
    deadline=None,  # a shared 2-core machine: timing is the health watch's business
    database=None,  # nothing written into the checkout
    suppress_health_check=_QUIET_CHECKS,
)


def fuzz(examples: int, *, over_http: bool = False) -> settings:
    """Settings for a run of `examples`; over HTTP without shrinking (each step is a request)."""
    phases = [Phase.explicit, Phase.generate] if over_http else list(Phase)
    return settings(FUZZ_SETTINGS, max_examples=examples, phases=phases)


@contextmanager
def python_recursion_limit() -> Iterator[None]:
    """Python's default recursion limit, as the server runs: Hypothesis raises it while a test
    runs (by ~2,000 frames), which hid the 500 of a refusal quoting a list 1,000 deep."""
    raised = sys.getrecursionlimit()
    sys.setrecursionlimit(PYTHON_RECURSION_LIMIT)
    try:
        yield
    finally:
        sys.setrecursionlimit(raised)


# ---- the served app and its watchers ------------------------------------------------


class ImageStandIn:
    """Decodes like every image model (engine.inputs), answers a fixed prediction."""

    task = "image"
    kind = "image-classification"
    name = "image-stand-in"
    version = "image-standin-v1"
    device = "cpu"

    def canonicalize(self, raw: Any) -> CanonicalImage:
        return canonicalize_image(raw, max_bytes=UPLOAD_BYTES, max_pixels=1_000_000)

    def predict_batch(self, inputs: Sequence[CanonicalImage]) -> list[Prediction]:
        return [Prediction((("tabby", 0.75), ("tiger cat", 0.25))) for _ in inputs]


class ServerLog(logging.Handler):
    """Every record of the root and uvicorn loggers (uvicorn's do not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def failures(self) -> list[str]:
        return [f"{r.name} {r.levelname}: {r.getMessage()[:300]}" for r in self.records
                if r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]  # fmt: skip


@pytest.fixture
def server_log() -> Iterator[ServerLog]:
    handler = ServerLog()
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


def _prime_hypothesis() -> None:
    """Hypothesis's once-per-process start (it scans the project's sources for constants, and
    builds its Unicode tables): ~180 MB for a moment on a fresh checkout. Done before a watch
    starts, so that the RSS it watches is the server's."""

    @settings(FUZZ_SETTINGS, max_examples=1, phases=[Phase.generate])
    @given(st.text())
    def prime(_text: str) -> None:
        pass

    prime()


class HealthWatch:
    """Polls /healthz from its own thread while a run lasts; samples this process's RSS."""

    def __init__(self, url: str, *, every_s: float = 0.05) -> None:
        self._url = url + "/healthz"
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="healthz-watch", daemon=True)
        self._process = psutil.Process()
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self.rss_start = self.rss_peak = 0

    def __enter__(self) -> HealthWatch:
        _prime_hypothesis()
        self.rss_start = self.rss_peak = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.wait(self._every_s):
                started = time.perf_counter()
                try:
                    status = client.get(self._url).status_code
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                self.latencies_s.append(time.perf_counter() - started)
                if status != 200:
                    self.failures.append(f"/healthz answered {status}")
                self.rss_peak = max(self.rss_peak, self._process.memory_info().rss)

    def summary(self) -> str:
        lat = np.array(self.latencies_s or [0.0]) * 1000
        return (f"/healthz x{len(self.latencies_s)}: p50 {np.percentile(lat, 50):.1f} ms, p99 "
                f"{np.percentile(lat, 99):.1f} ms, max {lat.max():.1f} ms; RSS +"
                f"{(self.rss_peak - self.rss_start) / 2**20:.0f} MB")  # fmt: skip

    def check(self) -> None:
        print(self.summary())
        assert not self.failures, self.failures[:5]
        assert len(self.latencies_s) >= 3, "the watch barely ran"
        assert max(self.latencies_s) < HEALTHZ_MAX_S, self.summary()
        assert self.rss_peak - self.rss_start < RSS_GROWTH_MAX_MB * 2**20, self.summary()


@dataclass
class Fuzzed:
    url: str
    runtime: Runtime
    log: ServerLog

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        with python_recursion_limit():  # the server runs in this process
            return httpx.post(self.url + path, timeout=30, **kwargs)


@pytest.fixture
def fuzzed(serve, redis_server: EmbeddedRedis, server_log: ServerLog) -> Iterator[Fuzzed]:
    """A served app (stand-in models, real Redis, an admin token). The log must stay clean."""
    url, runtime = serve(models={"text": CountingTextModel(), "image": ImageStandIn()},
                         redis__url=redis_server.url, server__admin_token=TOKEN,
                         limits__max_upload_bytes=UPLOAD_BYTES)  # fmt: skip
    served = Fuzzed(url, runtime, server_log)
    yield served
    assert not server_log.failures(), server_log.failures()[:5]


def assert_refusal_or_answer(response: httpx.Response, *, allowed: tuple[int, ...]) -> None:
    assert response.status_code in allowed, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert len(error) <= MAX_MESSAGE_CHARS and "Traceback" not in error


# ---- strategies: Triton's binary tensor extension --------------------------------------

# Any JSON value, NaN and huge integers included (the standard parser's fallback takes them).
_SCALARS = st.none() | st.booleans() | st.floats() | st.integers() | st.integers(2**63, 10**400)
JSON_VALUES = st.recursive(
    _SCALARS | st.text(max_size=20),
    lambda items: st.lists(items, max_size=4) | st.dictionaries(st.text(max_size=8), items, max_size=4),
    max_leaves=12,
)
DEEP = "<<deeply nested>>"  # replaced by a list nested this deep once encoded
NAMES = st.sampled_from(["input", "INPUT", "", "input\x00"]) | JSON_VALUES | st.just(DEEP)
DATATYPES = st.sampled_from(["BYTES", "FP32", "INT64", "bytes"]) | JSON_VALUES | st.just(DEEP)
DIMENSIONS = st.integers(-2, 70) | st.sampled_from([2**31, 2**62 + 1, 2**64 - 1, 2**64 + 1, 10**2200])
SHAPES = (
    st.lists(DIMENSIONS, max_size=10)
    | st.lists(st.integers(1, 3), min_size=1, max_size=3)
    | st.just([2**62 + 1] * 9_000)  # the frozen server, smaller
    | JSON_VALUES
)


# Header values a client can send (h11 refuses surrounding spaces) that are no byte count.
HEADER_LENGTH_JUNK = ["", "1 2", "+12", "1e3", "²", "9" * 5000, "0" * 5000 + "1", "-1"]


def encode_header(header: Any, depth: int) -> bytes:
    text = json.dumps(header, allow_nan=True)
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode("utf-8", "surrogatepass")


def bytes_elements(elements: list[bytes]) -> bytes:
    return b"".join(_LENGTH.pack(len(e)) + e for e in elements)


@st.composite
def binary_sections(draw: st.DrawFn) -> bytes:
    """Binary tensor data: BYTES elements, FP32 values, or either cut, padded or corrupted."""
    kind = draw(st.sampled_from(["bytes", "fp32", "raw"]))
    if kind == "bytes":
        raw = bytes_elements(draw(st.lists(st.binary(max_size=40), max_size=12)))
    elif kind == "fp32":
        raw = np.asarray(draw(st.lists(st.floats(width=32), max_size=12)), dtype="<f4").tobytes()
    else:
        raw = draw(st.binary(max_size=200))
    damage = draw(st.sampled_from(["none", "cut", "pad", "length"]))
    if damage == "cut" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif damage == "pad":
        raw += draw(st.binary(min_size=1, max_size=8))
    elif damage == "length" and len(raw) >= 4:
        raw = _LENGTH.pack(draw(st.integers(0, 2**32 - 1))) + raw[4:]
    return raw


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """(body, Inference-Header-Content-Length): a binary-extension request, mostly malformed."""
    raw = draw(binary_sections())
    parameters = draw(st.fixed_dictionaries({}, optional={
        "binary_data_size": st.just(len(raw)) | st.integers(-1, 2**65) | JSON_VALUES,
        "content_type": st.sampled_from(["str", "base64", "np"]) | JSON_VALUES,
    }))  # fmt: skip
    tensor = {"name": draw(NAMES), "shape": draw(SHAPES), "datatype": draw(DATATYPES)}
    tensor["parameters"] = parameters
    if draw(st.booleans()):
        tensor["data"] = draw(JSON_VALUES)
    inputs = st.just([tensor]) | st.just([tensor, tensor]) | JSON_VALUES
    optional = {"id": JSON_VALUES, "outputs": JSON_VALUES, "parameters": JSON_VALUES}
    header = draw(st.fixed_dictionaries({"inputs": inputs}, optional=optional))
    head = encode_header(header, draw(st.sampled_from([1, 500, 1000, 1100, 20_000])))
    length = draw(st.sampled_from(["exact", "none", "off", "junk"]))
    header_length: str | None = str(len(head)) if length == "exact" else None
    if length == "off":
        header_length = str(len(head) + draw(st.integers(-len(head) - 2, len(raw) + 2)))
    elif length == "junk":
        header_length = draw(st.sampled_from(HEADER_LENGTH_JUNK))
    return head + raw, header_length


@st.composite
def well_formed_requests(draw: st.DrawFn) -> tuple[bytes, str | None, list[bytes]]:
    """(body, header length, elements) as tritonclient encodes them, binary or JSON."""
    binary = draw(st.booleans())
    if binary:
        elements = draw(st.lists(st.binary(max_size=60), min_size=1, max_size=MAX_ELEMENTS))
    else:
        texts = draw(st.lists(st.text(max_size=30), min_size=1, max_size=MAX_ELEMENTS))
        elements = [t.encode() for t in texts]
    tensor = triton.InferInput("input", [len(elements)], "BYTES")
    tensor.set_data_from_numpy(np.array(elements, dtype=np.object_), binary_data=binary)
    outputs = [triton.InferRequestedOutput(name, binary_data=draw(st.booleans()))
               for name in draw(st.sampled_from([[], ["label"], ["score", "label"]]))]  # fmt: skip
    request_id = draw(st.text(max_size=12))
    body, json_size = triton.InferenceServerClient.generate_request_body(
        [tensor], outputs=outputs or None, request_id=request_id
    )
    return body, (None if json_size is None else str(json_size)), elements


# ---- the parser, directly: many examples ---------------------------------------------------


def parse(body: bytes, header_length: str | None) -> InferRequest:
    with python_recursion_limit():
        return parse_infer_request(body, header_length, input_name="input", max_elements=MAX_ELEMENTS)


@fuzz(EXAMPLES)
@given(request=hostile_requests())
def test_the_parser_refuses_with_a_400_or_parses(request: tuple[bytes, str | None]) -> None:
    try:
        parsed = parse(*request)
    except RequestRefused as refused:
        assert refused.status == 400
        assert len(refused.message) <= MAX_MESSAGE_CHARS
        refused.message.encode()  # the error body is UTF-8: no lone surrogate
        return
    assert 1 <= len(parsed.elements) <= MAX_ELEMENTS


@fuzz(EXAMPLES)
@given(request=well_formed_requests())
def test_what_tritonclient_sends_parses_back_exactly(request: tuple[bytes, str | None, list[bytes]]) -> None:
    body, header_length, elements = request
    parsed = parse(body, header_length)
    assert [e.encode() if isinstance(e, str) else e for e in parsed.elements] == elements


NEAR_SEPARATORS = b',[{]}"a\x0c\x1b\xdb\xfb'  # the separators, and bytes a bit away from them


@fuzz(EXAMPLES)
@given(data=st.binary(max_size=300) | st.lists(st.sampled_from(NEAR_SEPARATORS), max_size=300).map(bytes))
def test_the_value_bound_counts_commas_and_opening_brackets(data: bytes) -> None:
    # The bound that decides whether a body is parsed on the event loop, and refuses one with
    # too many values: a byte-wise count, whatever the bytes (0xDB, 0xFB: "[", "{" with bit 7 set).
    assert json_separators(data) == data.count(b",") + data.count(b"[") + data.count(b"{")


def test_hostile_bodies_cost_milliseconds() -> None:
    """Issue 23: `"shape": [2**62+1] * 60000` (1.26 MB) held the server 12 s under the GIL; 27 MB
    of `[],` took orjson 2.7 s and 650 MB. Both are refused before that work (this thread's CPU)."""
    frozen = {"name": "input", "datatype": "BYTES", "shape": [2**62 + 1] * 60_000, "data": ["a"]}
    cases = [
        (json.dumps({"inputs": [frozen]}).encode(), 0.05, "at most 8"),
        (b'{"inputs": [' + b"[]," * 9_000_000 + b"[]]}", 0.5, "too many values"),
        (b'{"inputs": [{"name": "input", "shape": [' + b"1" * 4_000 + b"]}]}", 0.05, "4,000 digits"),
    ]
    for body, limit_s, message in cases:
        started = time.thread_time()
        with pytest.raises(RequestRefused) as refused:
            parse(body, None)
        spent = time.thread_time() - started
        print(f"{len(body):,} bytes refused in {spent * 1000:.1f} ms of CPU: {refused.value.message[:60]}")
        assert message in refused.value.message and spent < limit_s


# ---- through HTTP, watched -------------------------------------------------------------------


def test_binary_requests_through_http(fuzzed: Fuzzed) -> None:
    requests = st.one_of(hostile_requests(), well_formed_requests().map(lambda r: r[:2]))

    @fuzz(HTTP_EXAMPLES, over_http=True)
    @given(request=requests, task=st.sampled_from(["text", "image"]), gzipped=st.booleans())
    def post(request: tuple[bytes, str | None], task: str, gzipped: bool) -> None:
        body, header_length = request
        headers = {}
        if header_length is not None:
            headers[b"Inference-Header-Content-Length"] = header_length.encode("latin-1")
        if gzipped:
            body = gzip.compress(body)
            headers[b"Content-Encoding"] = b"gzip"
        response = fuzzed.post(f"/v2/models/{task}/infer", content=body, headers=headers)
        assert_refusal_or_answer(response, allowed=(200, 400, 413))

    with HealthWatch(fuzzed.url) as watch:
        post()
    watch.check()


IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "WEBP", "TIFF", "ICO", "PPM")


@st.composite
def image_files(draw: st.DrawFn) -> bytes:
    """A small image in one of PIL's formats, whole or cut or with a byte flipped."""
    mode = draw(st.sampled_from(["RGB", "L", "RGBA", "P", "1", "I;16", "CMYK"]))
    size = (draw(st.integers(1, 48)), draw(st.integers(1, 48)))
    image = Image.new(mode, size, color=draw(st.integers(0, 255)))
    out = io.BytesIO()
    try:
        image.save(out, format=draw(st.sampled_from(IMAGE_FORMATS)))
    except (OSError, ValueError, KeyError):  # a mode this format cannot hold
        image.convert("RGB").save(out, format="PNG")
    data = bytearray(out.getvalue())
    damage = draw(st.sampled_from(["none", "cut", "flip"]))
    if damage == "cut":
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif damage == "flip":
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    return bytes(data)


@pytest.mark.filterwarnings("ignore::UserWarning:PIL.TiffImagePlugin")  # "Corrupt EXIF data": as drawn
def test_image_bytes_through_http(fuzzed: Fuzzed) -> None:
    @fuzz(HTTP_EXAMPLES, over_http=True)
    @given(files=st.lists(image_files(), min_size=1, max_size=3))
    def post(files: list[bytes]) -> None:
        raw = bytes_elements(files)
        tensor = {"name": "input", "shape": [len(files)], "datatype": "BYTES",
                  "parameters": {"binary_data_size": len(raw)}}  # fmt: skip
        head = json.dumps({"inputs": [tensor]}).encode()
        response = fuzzed.post("/v2/models/image/infer", content=head + raw,
                               headers={"Inference-Header-Content-Length": str(len(head))})  # fmt: skip
        assert_refusal_or_answer(response, allowed=(200, 400))

    with HealthWatch(fuzzed.url) as watch:
        post()
    watch.check()


# ---- the OpenAPI schema, with and without the token -----------------------------------------


def fuzz_schema(fuzzed: Fuzzed, *, token: str | None, check: Callable[[Any, Any], None]) -> int:
    """Every /v2 and /admin/api operation, positive and negative cases; returns the calls made."""
    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    schema = schema.include(path_regex=r"^/(v2|admin/api)")
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @fuzz(SCHEMA_EXAMPLES, over_http=True)
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case: Any) -> None:
                nonlocal calls
                calls += 1
                with python_recursion_limit():
                    response = case.call(headers=headers, timeout=30)
                assert response.status_code < 500, (response.status_code, response.text[:300],
                                                    case.as_curl_command(headers=headers))  # fmt: skip
                check(case, response)

            try:
                call()
            except Unsatisfiable:  # a negative case of an operation with nothing to get wrong
                assert mode is GenerationMode.NEGATIVE
    return calls


def test_the_schema_with_the_admin_token(fuzzed: Fuzzed) -> None:
    # A fuzzed flush, bump or evict may change the cache: this app is the test's own.
    def check(case: Any, response: Any) -> None:
        if case.path.startswith("/admin/api"):
            assert response.status_code not in (401, 429), response.text[:300]

    with HealthWatch(fuzzed.url) as watch:
        calls = fuzz_schema(fuzzed, token=TOKEN, check=check)
    print(f"{calls} calls")
    watch.check()


def test_the_schema_without_the_token_changes_nothing(fuzzed: Fuzzed) -> None:
    engine = fuzzed.runtime.engine
    engine.classify("text", "kept across the run")
    generation = engine.cache_state()["generation"]

    def check(case: Any, response: Any) -> None:
        if case.path.startswith("/admin/api"):  # 429 once a client has failed 5 times
            assert response.status_code in (401, 429), (response.status_code, response.text[:300])

    with HealthWatch(fuzzed.url) as watch:
        calls = fuzz_schema(fuzzed, token=None, check=check)
    print(f"{calls} calls")
    watch.check()
    assert engine.cache_state()["generation"] == generation
    assert engine.classify("text", "kept across the run").tier == "l1"


# ---- regressions: what review and fuzzing found -----------------------------------------------


ADMIN_POSTS = ["/admin/api/flush", "/admin/api/bump-version", "/admin/api/inspect", "/admin/api/evict",
               "/admin/api/l2/cleanup", "/admin/api/models/text/reload"]  # fmt: skip


def test_admin_bodies_through_http(fuzzed: Fuzzed) -> None:
    """Any body to every admin action, with the token: a clear 4xx or the action, never a 5xx."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # Found by review: Starlette's request.json() raised RecursionError (not a ValueError), a 500.
    # Garbage is refused as such (admin.bodies), never taken as an empty body.
    for path in ("/admin/api/flush", "/admin/api/inspect", "/admin/api/bump-version"):
        response = fuzzed.post(path, content=b"[" * 10_000, headers=auth)
        assert response.status_code == 400, response.text[:300]
        assert "not valid JSON" in response.json()["error"]

    bodies = st.one_of(
        JSON_VALUES.map(lambda value: json.dumps(value).encode()),
        st.fixed_dictionaries({}, optional={"tier": JSON_VALUES, "task": JSON_VALUES, "input": JSON_VALUES,
                                            "input_base64": JSON_VALUES, "note": JSON_VALUES,
                                            "dry_run": JSON_VALUES}).map(lambda d: json.dumps(d).encode()),
        st.sampled_from([1, 500, 1000, 5000]).map(lambda n: b'{"task": "text", "input": ' + b"[" * n),
        st.binary(max_size=64),
    )  # fmt: skip

    @fuzz(HTTP_EXAMPLES, over_http=True)
    @given(path=st.sampled_from(ADMIN_POSTS), body=bodies)
    def post(path: str, body: bytes) -> None:
        response = fuzzed.post(path, content=body, headers=auth)
        assert response.status_code < 500, (path, body[:200], response.status_code, response.text[:300])

    with HealthWatch(fuzzed.url) as watch:
        post()
    watch.check()
