"""Hostile HTTP against the served app: request heads and bodies are bounded, and requests
that Gradio would answer with a 500 are refused with a 4xx in front of it (ui.limits,
ui.gradio_guard)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from settings import Settings, SettingsError
from storage.redis.embedded import free_port
from tests.served_app import HealthWatch, Served, rss_bytes, served_app
from ui.asgi import respond
from ui.limits import UPLOAD_FORM_ALLOWANCE, BodyLimits, HeaderLimits, _HeldHead, _OneWriteCycle
from ui.server import BackgroundServer

UPLOAD_LIMIT = 2 * 2**20  # MAX_UPLOAD_BYTES of the app under test: an upload flood stays quick
FILE_META = {"_type": "gradio.FileData"}
MIB = 2**20
JSON = "application/json"
ADMIN_TOKEN = "hostile-test-admin-token"
# /healthz answers in milliseconds here; 2 s leaves room for a machine shared with other
# tests. Before the limits, a header flood made every /healthz time out (5 s).
HEALTHZ_MAX_S = 2.0


@pytest.fixture(scope="module")
def served(base_settings: Settings, real_models, tmp_path_factory) -> Iterator[Served]:
    """The app as `make run` serves it, with the real models; one for the module."""
    data_dir = tmp_path_factory.mktemp("hostile")
    overrides = {"limits__max_upload_bytes": UPLOAD_LIMIT, "server__admin_token": ADMIN_TOKEN}
    with served_app(base_settings, real_models, data_dir, **overrides) as app:
        yield app


def exchange(
    served: Served, head: bytes, body: Iterable[bytes] = (), *, cap: int = 64 * MIB, source: str = "127.0.0.1"
) -> tuple[bytes, int]:
    """Send `head` then `body` pieces (up to `cap` bytes) from `source` (a loopback address: the
    server's refusal log counts per client) while reading the reply; the reply's first bytes
    and how many body bytes went out before it came (or the server closed)."""
    sock = socket.create_connection((served.host, served.port), timeout=10, source_address=(source, 0))
    sock.sendall(head)
    sock.setblocking(False)
    reply, sent = b"", 0
    try:
        for piece in body:
            while piece and b"\r\n\r\n" not in reply and sent < cap:
                try:
                    done = sock.send(piece)
                    sent, piece = sent + done, piece[done:]
                except BlockingIOError:
                    time.sleep(0.001)
                try:
                    reply += sock.recv(65536) or b"<closed>"
                except BlockingIOError:
                    pass
            if b"\r\n\r\n" in reply or sent >= cap:
                break
        sock.settimeout(10)
        while b"\r\n\r\n" not in reply and not reply.endswith(b"<closed>"):
            reply += sock.recv(65536) or b"<closed>"
        time.sleep(0.05)  # the rest of a small JSON reply
        sock.setblocking(False)
        try:
            reply += sock.recv(65536)
        except (BlockingIOError, OSError):
            pass
    except OSError:  # reset: the server closed while we were still sending
        reply += _buffered(sock)
    finally:
        sock.close()
    return reply, sent


def _buffered(sock: socket.socket) -> bytes:
    """What the kernel still holds of the reply after a reset met a send (the server answered,
    then closed with body bytes unread): Linux keeps received bytes readable until they are read."""
    sock.setblocking(False)
    held = b""
    try:
        while chunk := sock.recv(65536):
            held += chunk
    except OSError:
        pass
    return held


def post_head(served: Served, path: str, *headers: str, content_type: str = JSON) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {served.host}", f"Content-Type: {content_type}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


MULTIPART = "multipart/form-data; boundary=xyz"
FILE_PART = b'--xyz\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n\r\n'


def endless_chunks(prefix: bytes) -> Iterator[bytes]:
    yield b"%x\r\n%s\r\n" % (len(prefix), prefix)
    piece = b"a" * 65536
    while True:
        yield b"%x\r\n%s\r\n" % (len(piece), piece)


# ---- request heads ------------------------------------------------------------------


def trickle_header(served: Served, seconds: float, result: list[bytes]) -> None:
    """One `X-Big:` header sent a kilobyte at a time for up to `seconds`."""
    head = f"GET /healthz HTTP/1.1\r\nHost: {served.host}\r\nX-Big: ".encode()
    deadline = time.monotonic() + seconds

    def pieces() -> Iterator[bytes]:
        while time.monotonic() < deadline:
            yield b"b" * 1024
            time.sleep(0.002)

    result.append(exchange(served, head, pieces())[0])


def test_a_header_flood_is_refused_and_healthz_stays_fast(served: Served) -> None:
    before = rss_bytes()
    replies: list[bytes] = []
    with HealthWatch(served.url) as health:
        floods = [threading.Thread(target=trickle_header, args=(served, 8.0, replies)) for _ in range(3)]
        for flood in floods:
            flood.start()
        for flood in floods:
            flood.join(30)
    assert len(replies) == 3
    for reply in replies:  # each refused at the limit, long before the 8 s of trickling ended
        assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
        assert b"larger than the limit of 32,768 bytes" in reply and b"connection: close" in reply
    assert not health.failures and health.slowest_s < HEALTHZ_MAX_S, (health.failures[:3], health.slowest_s)
    assert rss_bytes() - before < 50 * MIB, (rss_bytes() - before) / MIB


@pytest.mark.parametrize(
    ("client", "head", "status", "message"),
    [
        (
            "127.0.2.1",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n",
            431,
            b"32,768 bytes",
        ),
        (
            "127.0.2.2",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n",
            431,
            b"More than 100",
        ),
        ("127.0.2.3", b"GET /healthz?" + b"q" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, b"8,192 bytes"),
    ],
    ids=["one-large-header", "too-many-headers", "long-url"],
)
def test_heads_over_a_limit_are_refused(
    served: Served, caplog, client: str, head: bytes, status: int, message: bytes
) -> None:
    """Each from a client of its own: the refusal log counts per client."""
    caplog.set_level(logging.WARNING, logger="ui.limits")
    reply, _ = exchange(served, head, source=client)
    assert reply.startswith(b"HTTP/1.1 %d" % status) and message in reply
    assert any(f"head: {status} " in r.getMessage() and client in r.getMessage() for r in caplog.records)
    # Heads at the limits are served.
    ok = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-A: 1\r\n" * 90 + b"X-B: " + b"b" * 20_000 + b"\r\n\r\n"
    assert exchange(served, ok)[0].startswith(b"HTTP/1.1 200")


def test_a_head_that_never_ends_times_out() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await respond(send, 200, {"ok": True})

    with BackgroundServer(app, port=free_port(), header_limits=HeaderLimits(timeout_s=0.5)) as server:
        served = Served(server.url, runtime=None)
        start = time.monotonic()
        reply, _ = exchange(served, b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: a")
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 5


def test_head_limits_are_settings() -> None:
    settings = Settings.from_env(
        {"MAX_HEADER_BYTES": "65536", "MAX_HEADER_COUNT": "50", "MAX_URL_BYTES": "4096"}
    )
    assert HeaderLimits.from_settings(settings) == HeaderLimits(65536, 50, 4096)
    assert HeaderLimits.from_settings(Settings.from_env({})) == HeaderLimits()
    with pytest.raises(SettingsError, match="MAX_HEADER_BYTES"):
        Settings.from_env({"MAX_HEADER_BYTES": "100"})


# ---- request bodies -----------------------------------------------------------------


def test_a_declared_huge_gradio_body_is_refused_before_it_is_read(served: Served, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="ui.limits")
    head = post_head(served, "/gradio_api/call/classify_text", f"Content-Length: {400 * MIB}")
    reply, sent = exchange(served, head, iter(lambda: b"a" * 65536, None), source="127.0.2.100")
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body == {"detail": "The request body is larger than the limit of 1,048,576 bytes for this route."}
    assert sent < 16 * MIB  # the answer came while the body was still on its way
    assert any(
        "413 body over 1,048,576 bytes (declared 419,430,400" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize(
    ("path", "limit"),
    [
        ("/gradio_api/call/classify_text", MIB),
        ("/gradio_api/queue/join", MIB),
        ("/gradio_api/component_server", MIB),
        ("/gradio_api/run/classify_text", MIB),
        ("/gradio_api/upload", UPLOAD_LIMIT + UPLOAD_FORM_ALLOWANCE),
    ],
)
def test_chunked_bodies_are_counted_and_cut_at_the_limit(served: Served, path: str, limit: int) -> None:
    before = rss_bytes()
    upload = path.endswith("/upload")
    with HealthWatch(served.url) as health:
        head = post_head(
            served, path, "Transfer-Encoding: chunked", content_type=MULTIPART if upload else JSON
        )
        reply, sent = exchange(served, head, endless_chunks(FILE_PART if upload else b'{"data": ["'))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    ours = f"limit of {limit:,} bytes".encode() in reply and b"connection: close" in reply
    # An upload's file part may pass Gradio's own max_file_size (the file alone) before the
    # body passes this app's limit (the file and the form around it): either refusal holds.
    gradios = upload and f"maximum allowed size of {UPLOAD_LIMIT} bytes".encode() in reply
    assert ours or gradios, reply[:300]
    assert sent < limit + 16 * MIB  # what the sockets' buffers held when the answer came
    assert rss_bytes() - before < 50 * MIB, (rss_bytes() - before) / MIB
    assert not health.failures and health.slowest_s < HEALTHZ_MAX_S, (health.failures[:3], health.slowest_s)


def test_a_chunked_body_within_the_limit_is_served(served: Served) -> None:
    body = json.dumps({"data": ["Where is my parcel?"]}).encode()
    chunks = [
        b"%x\r\n%s\r\n" % (len(body[:10]), body[:10]),
        b"%x\r\n%s\r\n" % (len(body[10:]), body[10:]),
        b"0\r\n\r\n",
    ]
    head = post_head(served, "/gradio_api/call/classify_text", "Transfer-Encoding: chunked")
    reply, _ = exchange(served, head, chunks)
    assert reply.startswith(b"HTTP/1.1 200") and b"event_id" in reply


def test_admin_bodies_have_a_small_limit(served: Served) -> None:
    token = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    flush = served.http.post("/admin/api/flush", content=b" " * (64 * 1024 + 1), headers=token)
    assert flush.status_code == 413 and "65,536 bytes" in flush.json()["error"]
    assert served.http.post("/admin/api/flush", json={"tier": "l1"}, headers=token).status_code == 200


def test_the_body_limit_of_each_route() -> None:
    limits = BodyLimits.from_settings(Settings.from_env({"MAX_UPLOAD_BYTES": "1000"}))
    assert limits.for_path("/gradio_api/call/classify_text") == (MIB, "detail")
    assert limits.for_path("/gradio_api/upload") == (1000 + UPLOAD_FORM_ALLOWANCE, "detail")
    assert limits.for_path("/admin/api/flush") == (64 * 1024, "error")
    assert limits.for_path("/admin/api/inspect")[0] > limits.for_path("/admin/api/flush")[0]  # an image
    assert limits.for_path("/v2/models/text/infer") is None  # REST bounds its own
    assert limits.for_path("/") == (MIB, "detail")


def test_a_chunked_body_is_pulled_no_further_than_the_limit() -> None:
    """In process, with an endless body: no chunk past the limit is pulled from the client."""
    limit = 100_000
    pulled = 0
    read_by_app: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        size = 0
        while (message := await receive())["type"] == "http.request":
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        read_by_app.append(size)
        raise RuntimeError("the body ended early")  # as an app would that sees the client leave

    limits = BodyLimits(gradio=limit, upload=limit, admin_entry=limit)

    async def endless() -> Any:
        nonlocal pulled
        while True:
            pulled += 8192
            yield b"x" * 8192

    async def post() -> httpx.Response:
        async def bounded(scope: Any, receive: Any, send: Any) -> None:
            await limits(app, scope, receive, send)

        transport = httpx.ASGITransport(app=bounded)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/gradio_api/queue/join", content=endless())

    response = anyio.run(post)
    assert response.status_code == 413 and response.headers["connection"] == "close"
    assert limit < pulled <= limit + 8192 and read_by_app[0] <= limit


# ---- what Gradio would answer with a 500 ----------------------------------------------


def file_ref(path: str, **fields: Any) -> dict[str, Any]:
    return {"path": path, "meta": dict(FILE_META), **fields}


JSON = {"content-type": "application/json"}


def join(data: list[Any], fn_index: int | str, session_hash: str = "s1") -> dict[str, Any]:
    """A /queue/join body; a name for `fn_index` is looked up in the app's config."""
    return {"data": data, "fn_index": fn_index, "session_hash": session_hash}


def _cases(app_url: str) -> list[tuple[str, Any, int, str]]:
    """(path, body, status, part of the message): each a 500 from Gradio 6.31 on its own. A /call
    whose input is refused is accepted (200), the reason its result stream's error event, as
    Gradio answers a call whose function raises: the API page's bash snippet shows it."""
    url = f"{app_url}/healthz"
    call, queue = "/gradio_api/call/", "/gradio_api/queue/join"
    no_urls = "does not fetch URLs"
    component = {"data": {}, "component_id": 9999, "fn_name": "f", "session_hash": "s1"}
    return [
        (call + "classify_image", {"data": [file_ref(url, url=url)]}, 200, no_urls),
        (call + "classify_text", {"data": [file_ref("https://example.invalid/x.png")]}, 200, no_urls),
        (call + "v2/classify_image", {"image": file_ref(url)}, 200, no_urls),
        (queue, join([file_ref(url, url=url)], "classify_image"), 422, no_urls),  # as gradio_client sends it
        (queue, join(["x"], 9999), 404, "fn_index 9999"),
        (queue, join(["x"], -1), 404, "fn_index -1"),
        ("/gradio_api/run/classify_text", {"data": ["x"], "fn_index": 9999}, 404, "fn_index 9999"),
        ("/gradio_api/component_server", component, 404, "No component has id 9999"),
        (queue, join([], "classify_text"), 422, "takes 1 input(s)"),
        (queue, join([5], "classify_image"), 422, "not a valid image value"),
        (queue, join(["x"], "classify_text", session_hash=""), 400, "session_hash must not be empty"),
        (queue, join(["x"], "classify_text", session_hash="s\ud800"), 400, "unpaired surrogate"),
        (call + "classify_text", {"data": ["x"], "session_hash": "\udfff"}, 400, "unpaired surrogate"),
        (queue, join(["x"], "load_example"), 422, "index of one of its"),
        (call + "classify_image", {"data": [file_ref("x.png", size="big")]}, 200, "file reference"),
        (call + "v2/classify_text", {"nope": "hi"}, 422, "`nope` is not a valid key-word argument"),
        (call + "v2/classify_text", {}, 422, "No value provided for required argument: message"),
        (call + "v2/nope", {"message": "hi"}, 404, "No API of that name"),
        (call + "classify_image", {"data": [file_ref("a" * 5000)]}, 200, "cannot be looked up"),
        (call + "classify_image", {"data": [{"path": "x\u0000.png"}]}, 200, "cannot be looked up"),
        (queue, join([{"path": "x", "meta": None}], "classify_text"), 422, '"meta" must be'),
    ]


def refusal_message(detail: Any) -> str:
    """A refusal's reason: the detail itself, or on /queue/join for an input, Gradio's
    validation answer (`[{"__type__": "validate", "message": ...}]`, which gradio_client shows)."""
    if isinstance(detail, list):
        assert [d.get("__type__") for d in detail] == ["validate"], detail
        return detail[0]["message"]
    return detail


def test_requests_gradio_answers_with_a_500_get_a_4xx(served: Served, caplog) -> None:
    config = served.http.get("/config").json()
    fn_index = {d["api_name"]: d["id"] for d in config["dependencies"]}
    caplog.set_level(logging.WARNING, logger="ui.gradio_guard")
    for number, (path, body, status, message) in enumerate(_cases(served.url), start=1):
        if isinstance(body.get("fn_index"), str):
            body = {**body, "fn_index": fn_index[body["fn_index"]]}
        # A client of its own for each: the refusal log counts per client.
        transport = httpx.HTTPTransport(local_address=f"127.0.1.{number}")
        with httpx.Client(base_url=served.url, transport=transport, timeout=30) as client:
            # json.dumps escapes what UTF-8 cannot carry ("\ud800"), as a hostile client would.
            response = client.post(path, content=json.dumps(body), headers=JSON)
            assert response.status_code == status, (path, body, response.text[:300])
            if status == 200:  # a refused /call input: the reason is the result stream's error event
                api = path.removeprefix("/gradio_api/call/").removeprefix("v2/")
                stream = client.get(f"/gradio_api/call/{api}/{response.json()['event_id']}").text
                assert stream.startswith("event: error\ndata: ") and message in stream, stream
            else:
                assert message in refusal_message(response.json()["detail"]), response.text
    # Refused in front of Gradio with a log line, at most one per client per minute (RefusalLog):
    # earlier tests from this loopback client may have spent this minute's line.
    assert sum(r.name == "ui.gradio_guard" for r in caplog.records) <= len(_cases(served.url))


def test_a_refusal_carries_gradios_cors_headers(served: Served) -> None:
    body = {"data": ["x"], "fn_index": 9999, "session_hash": "s1"}
    origin = {"Origin": "http://localhost:7860"}
    refused = served.http.post("/gradio_api/queue/join", json=body, headers=origin)
    accepted = served.http.post("/gradio_api/queue/join", json={**body, "fn_index": None}, headers=origin)
    assert refused.status_code == 404 and accepted.status_code == 400  # Gradio's own "no fn_index"
    assert refused.headers.get("access-control-allow-origin") == accepted.headers.get(
        "access-control-allow-origin"
    )
    assert refused.headers.get("access-control-allow-origin") == "http://localhost:7860"


def test_repeated_refusals_are_logged_once_a_minute_per_client(served: Served, caplog) -> None:
    caplog.set_level(logging.WARNING)
    big_head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n"
    for _ in range(3):
        assert exchange(served, big_head, source="127.0.3.1")[0].startswith(b"HTTP/1.1 431")
    transport = httpx.HTTPTransport(local_address="127.0.3.2")
    with httpx.Client(base_url=served.url, transport=transport, timeout=30) as client:
        for _ in range(3):
            assert client.post("/gradio_api/queue/join", json=join(["x"], 9999)).status_code == 404
    lines = [r.getMessage() for r in caplog.records if r.name in ("ui.limits", "ui.gradio_guard")]
    assert sum("127.0.3.1" in line for line in lines) == 1 and sum("127.0.3.2" in line for line in lines) == 1


def test_an_upload_within_the_limit_still_works(served: Served, photo_bytes) -> None:
    data = photo_bytes("chelsea.png")
    response = served.http.post("/gradio_api/upload", files={"files": ("chelsea.png", data, "image/png")})
    assert response.status_code == 200 and Path(response.json()[0]).stat().st_size == len(data)
    big = b"\0" * (UPLOAD_LIMIT + UPLOAD_FORM_ALLOWANCE)
    refused = served.http.post("/gradio_api/upload", files={"files": ("big.png", big, "image/png")})
    assert refused.status_code == 413 and "limit of" in refused.json()["detail"]


# ---- one write per small answer ------------------------------------------------------


class _Recorder:
    """A transport that records writes (and the flow control uvicorn's cycle reads)."""

    write_paused = False

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _cycle_writes(one_write: bool, method: str, messages: list[dict[str, Any]]) -> _Recorder:
    transport = _Recorder()
    cycle = RequestResponseCycle(
        scope={"method": method, "path": "/", "http_version": "1.1"}, transport=transport,  # type: ignore[arg-type]
        flow=transport, logger=logging.getLogger("t"), access_logger=logging.getLogger("t"),  # type: ignore[arg-type]
        access_log=False, default_headers=[(b"server", b"x")], message_event=asyncio.Event(),
        expect_100_continue=False, keep_alive=True, on_response=lambda: None,
    )  # fmt: skip
    if one_write:
        cycle.__class__ = _OneWriteCycle

    async def run() -> None:
        for message in messages:
            await cycle.send(message)  # type: ignore[arg-type]

    asyncio.run(run())
    return transport


def _start(length: int | None) -> dict[str, Any]:
    headers = [] if length is None else [(b"content-length", b"%d" % length)]
    return {"type": "http.response.start", "status": 200, "headers": headers}


def _body(data: bytes, *, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


@pytest.mark.parametrize(
    ("method", "messages", "writes"),
    [
        ("POST", [_start(5), _body(b"hello")], 1),
        ("GET", [_start(0), _body(b"")], 1),
        ("GET", [_start(4), _body(b"ab", more=True), _body(b"cd")], 2),
        ("HEAD", [_start(5), _body(b"")], 1),
        ("GET", [_start(None), _body(b"ab", more=True), _body(b"")], 3),  # chunked: as it comes
        ("GET", [_start(70 * 1024), _body(b"x" * (70 * 1024))], 2),  # large: as uvicorn does
    ],
    ids=["small", "empty", "streamed-with-length", "head", "chunked", "large"],
)
def test_a_small_answer_goes_out_in_one_write(
    method: str, messages: list[dict[str, Any]], writes: int
) -> None:
    ours, uvicorns = _cycle_writes(True, method, messages), _cycle_writes(False, method, messages)
    assert b"".join(ours.writes) == b"".join(uvicorns.writes)  # the same bytes
    assert len(ours.writes) == writes


def test_a_held_head_is_sent_when_the_app_fails_after_it() -> None:
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]}
    transport = _cycle_writes(True, "GET", [start])
    assert transport.writes == []  # held for its body
    # uvicorn closes the transport when an app fails after its head: the head goes first.
    held = _HeldHead(transport)  # type: ignore[arg-type]
    held.write(b"HEAD")
    assert transport.writes == []
    held.close()
    assert transport.writes == [b"HEAD"] and transport.closed
