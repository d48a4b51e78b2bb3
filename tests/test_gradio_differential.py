"""The cached-call shortcut and lean sessions against plain Gradio, request by request.

The same Blocks served twice from one runtime (one engine, the real models): `lean` as the
app serves it (ui.cached_calls in front of Gradio's routes, ui.lean_sessions), `plain` built
the same way without them (everything else of the app, its guard and limits included, is in
both). Every request of TABLE goes to both apps; the statuses, the headers clients act on
(CORS, content type, cache control, ...), the JSON bodies and the events of the result streams
must match, except for the short list INTENDED, and each of those must still differ (when
Gradio changes, the list must). This suite is what fails first on a Gradio upgrade.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.routing import Mount

from runtime import build_runtime
from testing.gradio_http import GradioHttpClient
from tests.conftest import free_port
from ui import server
from ui.cached_calls import CachedCalls
from ui.server import BackgroundServer, build_app
from ui.startup import ServingApp

HEARTBEAT_S = 0.2  # GRADIO_HEARTBEAT_INTERVAL for both apps: an open stream shows a heartbeat soon
WINDOW_S = 0.8  # how long a stream that stays open is read (4 heartbeats)
CACHED = "Where is my parcel? It was supposed to arrive on Monday."
JSON_TYPE = {"content-type": "application/json"}
FORM = {"content-type": "application/x-www-form-urlencoded"}  # curl -d
CROSS_SITE = {"host": "myspace.hf.space", "origin": "https://example.com"}  # Gradio allows it
LOCAL_FOREIGN = {"origin": "https://example.com"}  # Host 127.0.0.1: Gradio allows no other origin
LOCAL_LOCAL = {"origin": "http://localhost:3000"}
NULL_ORIGIN = {"origin": "null"}
BROTLI = {"accept-encoding": "br"}
PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
HEADERS = (
    "content-type", "content-encoding", "transfer-encoding", "cache-control", "vary", "allow", "location",
    "retry-after", "access-control-allow-origin", "access-control-allow-credentials",
    "access-control-allow-methods", "access-control-allow-headers", "access-control-max-age",
)  # fmt: skip
VOLATILE = {"latency_ms", "age_s"}
FILE_META = {"_type": "gradio.FileData"}
TEXT, TEXT_V2 = "/gradio_api/call/classify_text", "/gradio_api/call/v2/classify_text"
IMAGE, IMAGE_V2 = "/gradio_api/call/classify_image", "/gradio_api/call/v2/classify_image"


# ---- the two apps ----------------------------------------------------------------------


@dataclass
class Side:
    """One of the two apps, with what its requests refer to."""

    name: str
    url: str
    app: FastAPI
    upload: dict[str, Any] = field(default_factory=dict)  # chelsea.png uploaded here (answer cached)
    other_upload: dict[str, Any] = field(default_factory=dict)  # coffee.png uploaded here (evicted)
    fresh: str = ""  # the message of the case under test that no one asked before (evicted)

    @property
    def shortcut(self) -> CachedCalls:
        return self.app.state.cached_calls

    @property
    def blocks(self) -> Any:
        return next(r.app for r in self.app.routes if isinstance(r, Mount) and r.path == "").get_blocks()



def plain_app(runtime: Any) -> FastAPI:
    """The app without the shortcut and lean sessions: Gradio's own routes, queue and sessions."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server, "install_lean_sessions", lambda *args: None)
        app = build_app(runtime)
    app.state.cached_calls.enabled = False
    return app


@contextmanager
def served(runtime: Any, build: Callable[[Any], FastAPI]) -> Iterator[tuple[str, FastAPI]]:
    """`build(runtime)` behind the app's readiness gate (as `serve` runs it), on a free port."""
    built: list[FastAPI] = []

    def build_and_keep(built_from: Any) -> FastAPI:
        built.append(build(built_from))
        return built[-1]

    serving = ServingApp(runtime.settings, build_runtime=lambda _settings: runtime, build_app=build_and_keep,
                         close_runtime=False)  # fmt: skip
    with BackgroundServer(serving, port=free_port()) as background:
        deadline = time.monotonic() + 60
        while not serving.ready:
            assert serving.failure is None and time.monotonic() < deadline, serving.failure
            time.sleep(0.02)
        yield background.url, built[0]


@pytest.fixture(scope="module")
def runtime(base_settings, real_models, tmp_path_factory) -> Iterator[Any]:
    settings = base_settings.changed(server__data_dir=tmp_path_factory.mktemp("differential"))
    with build_runtime(settings, models=real_models) as built:
        yield built


@pytest.fixture(scope="module")
def sides(runtime, photo_bytes) -> Iterator[dict[str, Side]]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GRADIO_HEARTBEAT_INTERVAL", str(HEARTBEAT_S))
        # One after the other: plain_app patches ui.server while it builds.
        with served(runtime, build_app) as (lean_url, lean_app), served(runtime, plain_app) as plain:
            both = {"lean": Side("lean", lean_url, lean_app), "plain": Side("plain", *plain)}
            for side in both.values():
                with GradioHttpClient(side.url) as client:
                    photos = ("chelsea.png", "coffee.png")
                    side.upload, side.other_upload = (client.upload_file(n, photo_bytes(n)) for n in photos)
                    client.call("classify_image", [side.upload]).outputs  # noqa: B018 (warms the cache)
                    client.call("classify_text", [CACHED]).outputs  # noqa: B018
            yield both


def forget_fresh(runtime: Any, photo_bytes: Callable[[str], bytes], fresh: str) -> None:
    """Evict what a case asked for the first time, so that the other app asks it afresh too."""
    engine = runtime.engine
    for task, raw in (("text", fresh), ("image", photo_bytes("coffee.png"))):
        engine.evict(engine.entry_key(task, raw))


# ---- what a request got -----------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One response, as a client acts on it."""

    status: int
    headers: tuple[tuple[str, str], ...]
    content: Any  # JSON (event ids masked), the stream's events (heartbeats apart), or text
    ended: str  # "closed", "broken" (the server broke the stream off) or "open" (read for WINDOW_S)
    heartbeat: bool = False  # a stream left open sent a heartbeat


def sse_events(text: str) -> list[tuple[str, Any]]:
    events, name = [], None
    for line in text.splitlines():
        if line.startswith("event:"):
            name = line[len("event:") :].strip()
        elif line.startswith("data:"):
            data = json.loads(line[len("data:") :].strip() or "null")
            events.append((name, data))
            name = None
    return events


def stable(value: Any) -> Any:
    """`value` without what differs from call to call: event ids, cache_info's timings."""
    if isinstance(value, dict):
        kept = {k: v for k, v in value.items() if k not in VOLATILE}
        return {k: "<id>" if k == "event_id" and v else stable(v) for k, v in kept.items()}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def exchange(
    side: Side,
    method: str,
    path: str,
    *,
    body: bytes | Iterator[bytes] | None = None,
    headers: Mapping[str, str] | None = None,
    window: bool = False,
) -> tuple[Exchange, Any]:
    """Send one request to `side`; what came back, and the JSON body (None if not JSON)."""
    wait_s = WINDOW_S if window else 120
    deadline = time.monotonic() + wait_s
    chunks, ended = [], "closed"
    with httpx.Client(base_url=side.url, timeout=httpx.Timeout(120, read=wait_s)) as http:
        try:
            with http.stream(method, path, content=body, headers=dict(headers or {})) as response:
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        ended = "open"
                        break
        except httpx.ReadTimeout:
            ended = "open"
        except httpx.RemoteProtocolError:
            ended = "broken"
    text = b"".join(chunks).decode("utf-8", "replace")
    present = ((k, response.headers.get(k)) for k in HEADERS)
    kept = tuple((k, v.replace(side.url, "<url>")) for k, v in present if v is not None)
    parsed: Any = None
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(text)
        content = [(name, stable(payload)) for name, payload in events if name != "heartbeat"]
        seen = ended == "open" and any(e[0] == "heartbeat" for e in events)
        return Exchange(response.status_code, kept, content, ended, seen), None
    try:
        parsed = json.loads(text)
        content = stable(parsed)
    except ValueError:
        content = text
    return Exchange(response.status_code, kept, content, ended), parsed


# ---- the table -------------------------------------------------------------------------

Body = bytes | Callable[[Side], Any] | None


@dataclass(frozen=True)
class Case:
    """A request sent to both apps. `body`: bytes as they are, or a function of the app
    returning JSON (its upload, a fresh message). After a POST that queued a call, `then`
    reads its result: "get" (the stream), "again" (a second GET, left open), "after" (a GET
    once that second client left), "v2get" / "otherget" (through the v2 route, another API)."""

    name: str
    path: str
    body: Body = None
    headers: Mapping[str, str] = field(default_factory=lambda: JSON_TYPE)
    method: str = "POST"
    shortcut: bool = False  # the lean app answers it itself
    then: tuple[str, ...] = ("get",)

    def payload(self, side: Side) -> bytes | Iterator[bytes] | None:
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        made = self.body(side)
        if isinstance(made, Chunked):
            return iter([made.data[:7], made.data[7:]])  # no Content-Length: sent chunked
        return made if isinstance(made, bytes) else json.dumps(made).encode()


@dataclass(frozen=True)
class Chunked:
    data: bytes


def data(*items: Any) -> Callable[[Side], Any]:
    return lambda side: {"data": list(items)}


def cached_text(**extra: Any) -> Callable[[Side], Any]:
    return lambda side: {"data": [CACHED], **extra}


def fresh_text(side: Side) -> Any:
    return {"data": [side.fresh]}


def upload(side: Side) -> Any:
    return {"data": [side.upload]}


def with_cached(headers: Mapping[str, str]) -> dict[str, str]:
    return {**JSON_TYPE, **headers}


BIG = "x" * 70_000  # over the shortcut's 64 KB: it passes such a body on as it came
TABLE = [
    # -- the classic route, text: cached, uncached, and every body shape
    Case("text cached", TEXT, cached_text(), shortcut=True),
    Case("text cached, trailing slash", TEXT + "/", cached_text(), shortcut=True),
    Case("text cached, read twice", TEXT, cached_text(), shortcut=True, then=("get", "again", "after")),
    Case("text cached, read via v2", TEXT, cached_text(), shortcut=True, then=("v2get",)),
    Case("text cached, read via another API", TEXT, cached_text(), shortcut=True, then=("otherget",)),
    Case("text uncached", TEXT, fresh_text, shortcut=True),
    Case("text uncached, read twice", TEXT, fresh_text, shortcut=True, then=("get", "again", "after")),
    Case("text not JSON", TEXT, b"hello"),
    Case("text {}", TEXT, b"{}"),
    Case("text []", TEXT, b"[]"),
    Case("text null", TEXT, b"null"),
    Case('text {"data": "x"}', TEXT, b'{"data": "x"}'),
    Case("text truncated JSON", TEXT, b'{"data": ["Where is'),
    Case("text invalid UTF-8", TEXT, b'{"data": ["\xff"]}'),
    Case("text empty body", TEXT, b""),
    Case('text {"data": []}', TEXT, data()),
    Case("text None", TEXT, data(None)),
    Case("text blank", TEXT, data("   "), shortcut=True),  # the engine refuses it
    Case("text a number", TEXT, lambda side: {"data": [int(side.fresh)]}),
    Case("text an extra item", TEXT, data(CACHED, "extra")),
    Case("text cached, session hash", TEXT, cached_text(session_hash="a-session"), shortcut=True),
    Case("text session hash 5", TEXT, cached_text(session_hash=5)),
    Case("text empty session hash", TEXT, cached_text(session_hash="")),
    Case("text form content type", TEXT, cached_text(), FORM),
    Case("text text/plain", TEXT, cached_text(), {"content-type": "text/plain"}),
    Case("text no content type", TEXT, cached_text(), {}),
    Case("text json; charset", TEXT, cached_text(), {"content-type": "application/json; charset=utf-8"},
         shortcut=True),
    Case("text +json", TEXT, cached_text(), {"content-type": "application/vnd.api+json"}, shortcut=True),
    Case("text chunked, cached", TEXT, lambda side: Chunked(json.dumps({"data": [CACHED]}).encode()),
         shortcut=True),
    Case('text chunked {"data": []}', TEXT, lambda side: Chunked(b'{"data": []}')),
    Case("text over 64 KB", TEXT, data(BIG)),
    Case("text over the body limit", TEXT, data("x" * 2_000_000)),
    Case("unknown API", "/gradio_api/call/classify_nope", data("x")),
    # -- CORS: Host and Origin as Gradio's CustomCORSMiddleware judges them
    Case("text cached, cross-site", TEXT, cached_text(), with_cached(CROSS_SITE), shortcut=True),
    Case("text uncached, cross-site", TEXT, fresh_text, with_cached(CROSS_SITE), shortcut=True),
    Case("text cached, foreign origin on localhost", TEXT, cached_text(), with_cached(LOCAL_FOREIGN),
         shortcut=True),
    Case("text cached, local origin", TEXT, cached_text(), with_cached(LOCAL_LOCAL), shortcut=True),
    Case("text cached, null origin", TEXT, cached_text(), with_cached(NULL_ORIGIN), shortcut=True),
    Case("text refused, cross-site", TEXT, data(), with_cached(CROSS_SITE)),
    Case("preflight, cross-site", TEXT, None, {**CROSS_SITE, **PREFLIGHT}, "OPTIONS"),
    Case("preflight, foreign origin on localhost", TEXT, None, {**LOCAL_FOREIGN, **PREFLIGHT}, "OPTIONS"),
    Case("OPTIONS without a preflight", TEXT, None, CROSS_SITE, "OPTIONS"),
    # -- the named-parameter route ("Use via API")
    Case("v2 text cached", TEXT_V2, lambda side: {"message": CACHED}, shortcut=True),
    Case("v2 text cached, cross-site", TEXT_V2, lambda side: {"message": CACHED}, with_cached(CROSS_SITE),
         shortcut=True),
    Case("v2 text cached, read twice", TEXT_V2, lambda side: {"message": CACHED}, shortcut=True,
         then=("get", "again", "after")),
    Case("v2 text uncached", TEXT_V2, lambda side: {"message": side.fresh}, shortcut=True),
    Case("v2 text None", TEXT_V2, lambda side: {"message": None}),
    Case("v2 text no parameter", TEXT_V2, lambda side: {}),
    Case("v2 text unknown parameter", TEXT_V2, lambda side: {"message": CACHED, "foo": 1}),
    Case("v2 text session_hash", TEXT_V2, lambda side: {"message": CACHED, "session_hash": "s"}),
    Case("v2 text oauth_token", TEXT_V2, lambda side: {"message": CACHED, "oauth_token": "t"}, shortcut=True),
    Case("v2 text a list", TEXT_V2, b"[1]"),
    Case("v2 text not JSON", TEXT_V2, b"x{"),
    Case("v2 text form content type", TEXT_V2, lambda side: {"message": CACHED}, FORM),
    Case("v2 unknown API", "/gradio_api/call/v2/classify_nope", lambda side: {"message": "x"}),
    Case("v2 a private API", "/gradio_api/call/v2/admin_sign_in", lambda side: {"token": "x"}),
    Case("v2 image cached", IMAGE_V2, lambda side: {"image": side.upload}, shortcut=True),
    Case("v2 image not a file", IMAGE_V2, lambda side: {"image": {"foo": 1}}),
    # -- the classic route, image references
    Case("image cached", IMAGE, upload, shortcut=True),
    Case("image cached, no FileData marker", IMAGE, lambda side: {"data": [{"path": side.upload["path"]}]},
         shortcut=True),
    Case("image uncached", IMAGE, lambda side: {"data": [side.other_upload]}, shortcut=True),
    Case("image an extra item", IMAGE, lambda side: {"data": [side.upload, 1]}),
    Case('image {"foo": 1}', IMAGE, data({"foo": 1})),
    Case("image None", IMAGE, data(None)),
    Case("image a number", IMAGE, data(5)),
    Case("image a path string", IMAGE, data("/etc/passwd")),
    Case("image a data URL", IMAGE, data("data:image/png;base64,iVBORw0KGgo=")),
    Case("image a path not uploaded", IMAGE, data({"path": "/etc/passwd", "meta": FILE_META})),
    Case("image a path that is a number", IMAGE, data({"path": 5, "meta": FILE_META})),
    Case("image a URL path", IMAGE, data({"path": "http://127.0.0.1:9/x.png", "meta": FILE_META})),
    Case("image a URL only", IMAGE, data({"url": "http://127.0.0.1:9/x.png", "meta": FILE_META})),
    Case("image over 64 KB", IMAGE, data(BIG)),
    Case('image {"data": []}', IMAGE, data()),
    # -- result streams Gradio does not know, and the other methods
    Case("GET an unknown event id", f"{TEXT}/{'0' * 32}", method="GET"),
    Case("GET an unknown event id via v2", f"{TEXT_V2}/{'0' * 32}", method="GET"),
    Case("GET an unknown event id, cross-site", f"{TEXT}/{'0' * 32}", None, CROSS_SITE, "GET"),
    # A path Gradio's compression middleware takes for JSON: it compresses a stream it sees as one.
    Case("GET an unknown event id, compressed", f"{TEXT}/{'0' * 27}.json", None, BROTLI, "GET"),
    Case("GET an unknown session's queue", "/gradio_api/queue/data?session_hash=nobody", method="GET"),
    Case("GET the queue without a session", "/gradio_api/queue/data", method="GET"),
    Case("GET with a trailing slash", f"{TEXT}/{'0' * 32}/", method="GET"),
    Case("GET the POST route", TEXT, method="GET"),
    Case("HEAD a result stream", f"{TEXT}/{'0' * 32}", method="HEAD"),
]

# The differences kept on purpose: case -> the one field of its exchanges that differs, and why.
INTENDED = {
    # Gradio answers a result stream of an id or session it does not know with its 404 event,
    # then breaks the stream off (an exception after the response started) and logs a
    # ~40-line traceback: a log-flooding lever. The lean app sends the same event and closes
    # the stream cleanly, with one log line per client per minute.
    "GET an unknown event id": "ended",
    "GET an unknown event id via v2": "ended",
    "GET an unknown event id, cross-site": "ended",
    "GET an unknown event id, compressed": "ended",
    "GET an unknown session's queue": "ended",
    # The same, for a GET once the client of a second GET left (Gradio then drops the session).
    "text cached, read twice": "ended",
    "text uncached, read twice": "ended",
    "v2 text cached, read twice": "ended",
}


def run_case(side: Side, case: Case) -> list[Exchange]:
    first, parsed = exchange(side, case.method, case.path, body=case.payload(side), headers=case.headers)
    exchanges = [first]
    event_id = parsed.get("event_id") if isinstance(parsed, dict) and first.status == 200 else None
    if case.method != "POST" or event_id is None:
        return exchanges
    route = case.path.rstrip("/")
    get_headers = {k: v for k, v in case.headers.items() if k in ("host", "origin")}
    for step in case.then:
        path = {
            "v2get": f"{TEXT_V2}/{event_id}",
            "otherget": f"{IMAGE}/{event_id}",
        }.get(step, f"{route}/{event_id}")
        if step == "after":
            time.sleep(5 * HEARTBEAT_S)  # Gradio notices the second client left at its next heartbeat
        window = step in ("again", "after")
        exchanges.append(exchange(side, "GET", path, headers=get_headers, window=window)[0])
    return exchanges


class Tracebacks(logging.Handler):
    """Log records with a traceback or at ERROR, from any logger (uvicorn's do not propagate)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def tracebacks() -> Iterator[Tracebacks]:
    handler = Tracebacks()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error"), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.mark.parametrize("case", TABLE, ids=[case.name for case in TABLE])
def test_the_lean_app_answers_as_gradio_does(
    sides: dict[str, Side], case: Case, runtime, photo_bytes, tracebacks, capfd
) -> None:
    lean, plain = sides["lean"], sides["plain"]
    lean.fresh = plain.fresh = str(uuid.uuid4().int)  # digits: a message, and a number for "text a number"
    answered = lean.shortcut.answered
    capfd.readouterr()
    got = run_case(lean, case)
    time.sleep(0.05)  # a traceback is logged as the stream breaks: give it the time to land
    printed = capfd.readouterr().err
    assert not tracebacks.records and "Traceback" not in printed, (
        f"the lean app logged a traceback for {case.name}: {tracebacks.records} {printed[-2000:]}"
    )
    assert lean.shortcut.answered - answered == (1 if case.shortcut else 0), "the shortcut's share"
    forget_fresh(runtime, photo_bytes, lean.fresh)
    expected = run_case(plain, case)
    forget_fresh(runtime, photo_bytes, lean.fresh)
    assert all(e.status < 500 for e in got), got  # a client's request is never a server error
    differs = INTENDED.get(case.name)
    assert differences(got, expected, ignoring=differs) == []
    if differs is not None:
        assert [getattr(e, differs) for e in got] != [getattr(e, differs) for e in expected], (
            f"{case.name}: {differs} no longer differs from Gradio; drop it from INTENDED"
        )


def differences(got: list[Exchange], expected: list[Exchange], *, ignoring: str | None) -> list[str]:
    """What differs, exchange by exchange and field by field (readable where == is not)."""
    if len(got) != len(expected):
        return [f"{len(got)} exchanges, Gradio {len(expected)}: {got} / {expected}"]
    found = []
    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        for name in vars(ours):
            mine, gradio = getattr(ours, name), getattr(theirs, name)
            if name != ignoring and mine != gradio:
                found.append(f"exchange {index} {name}: {mine!r:.1500} / Gradio: {gradio!r:.1500}")
    return found


def test_the_table_covers_what_the_issue_lists() -> None:
    names = {case.name for case in TABLE}
    assert set(INTENDED) <= names
    for path in (TEXT, TEXT_V2, IMAGE, IMAGE_V2):
        assert any(case.path == path and case.shortcut for case in TABLE), path


def test_a_cached_call_while_the_queue_is_full(sides: dict[str, Side]) -> None:
    """Intended difference: Gradio refuses every call with 503 while its queue is full, its
    cache probe's hits included; the lean app answers hits (docs/DESIGN.md says why)."""
    replies = {}
    for name, side in sides.items():
        queue = side.blocks._queue
        size, queue.max_size = queue.max_size, 0
        try:
            calls = ((TEXT, {"data": [CACHED]}), (TEXT_V2, {"message": CACHED}), (TEXT, {"data": ["a miss"]}))
            replies[name] = [
                exchange(side, "POST", path, body=json.dumps(body).encode(), headers=JSON_TYPE)[0]
                for path, body in calls
            ]
        finally:
            queue.max_size = size
    lean, plain = replies["lean"], replies["plain"]
    assert [e.status for e in plain] == [503, 503, 503] and "Queue is full" in plain[0].content["detail"]
    assert [e.status for e in lean] == [200, 200, 503]  # hits answered; a miss refused as Gradio does
    assert lean[2] == plain[2]
