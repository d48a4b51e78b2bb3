"""Limits on what one HTTP request may make the server hold: its head and its body.

The head (request line and headers) is bounded on the connection, before any app code
runs. uvicorn's httptools parser has no limit of its own, and it builds a header value that
arrives over several reads by concatenation, each read copying everything before it: three
connections trickling one endless header held the event loop and grew memory by gigabytes.
`limited_http_protocol` is uvicorn's httptools protocol with a cap on the head's bytes (the
read in which the request began is held to the socket's read size, every later read is
counted while the head is open, and a complete head that could be over is measured), on the
URL's length and the number of headers (checked once the head is complete: until then the
byte cap holds them), and on how long the head may take to arrive. Past a cap the client
gets 431 (414 for the URL, 408 for the time) and the connection closes. A request whose
head arrives in one read, as any real client sends it, pays a few attribute updates and no
timer: about a microsecond (`python -m bench.http_limits`).

The body is bounded per route by `BodyLimits`, one ASGI step in front of everything the
app serves (ui.startup.ServingApp): a declared `Content-Length` over the route's limit is
refused before a byte is read; a chunked body is counted as it streams and refused at the
first chunk past the limit. Both answer 413 and close the connection. The REST infer routes
bound their own bodies (api.body) and are left alone here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from api import oip_body_limit
from api.body import byte_count
from settings import Settings
from ui.asgi import ASGIApp, Message, Receive, Scope, Send, respond
from ui.call_protocol import RefusalLog
from ui.simple_request import SimpleRequestReader

log = logging.getLogger(__name__)

# Room for the multipart form around one uploaded file (boundaries, part headers, file name).
UPLOAD_FORM_ALLOWANCE = 64 * 1024
# The admin API's own JSON (flush, bump, reload, cleanup); inspect and evict carry an input.
ADMIN_BODY_BYTES = 64 * 1024
GRADIO_PREFIX = "/gradio_api"
UPLOAD_PATH = f"{GRADIO_PREFIX}/upload"
ADMIN_PREFIX = "/admin/api/"
ADMIN_ENTRY_PATHS = ("/admin/api/inspect", "/admin/api/evict")
# A response whose Content-Length is at most this goes out in one write, head and body: one
# send and one TCP segment instead of two (a cached REST hit's answer is ~0.5 KB).
ONE_WRITE_BYTES = 64 * 1024
# A request with a declared body up to this size, whose app offers `answer_now`, gets its task
# only once its body is complete, and none when `answer_now` answers it (see answer_at_once):
# a REST infer POST, a Gradio call's POST and the GET of its result stream.
ANSWER_AT_ONCE_BYTES = 4 * 1024
GRADIO_CALL_PREFIX = b"/gradio_api/call/"
AT_ONCE_POST_PREFIXES = (b"/v2/", GRADIO_CALL_PREFIX)


# ---- the request head --------------------------------------------------------------


@dataclass(frozen=True)
class HeaderLimits:
    """Caps on one request's head. `max_bytes` counts the URL and every header name and
    value; `timeout_s` runs from the first read that leaves the head incomplete."""

    max_bytes: int = 32 * 1024
    max_count: int = 100
    max_url_bytes: int = 8 * 1024
    timeout_s: float = 30.0

    @classmethod
    def from_settings(cls, settings: Settings) -> HeaderLimits:
        limits = settings.limits
        return cls(limits.max_header_bytes, limits.max_header_count, limits.max_url_bytes)


class _HeadRefused(Exception):
    """Raised in a parser callback to stop parsing; uvicorn answers via send_400_response."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `limits` on each request's head (see the module)."""

    limits = HeaderLimits()
    refusals = RefusalLog(log)  # one per server: limited_http_protocol makes the class
    answer_at_once = True  # False: every request through a task, as uvicorn serves it (tests)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The app's `answer_now(scope, body)` (ui.startup.ServingApp), if it has one.
        self._answer_now = getattr(self.app, "answer_now", None) if self.answer_at_once else None
        limits = self.limits
        self._simple_requests = SimpleRequestReader(
            max_head_bytes=limits.max_bytes, max_url_bytes=limits.max_url_bytes, max_headers=limits.max_count,
            max_body_bytes=ANSWER_AT_ONCE_BYTES,
        )  # fmt: skip
        self._defer_task = False  # set while on_headers_complete runs for a request that may qualify
        self._deferred: tuple[RequestResponseCycle, Any] | None = None  # its cycle and app, body pending
        self._head_open = False  # a request has begun and its headers are not complete
        self._read_size = 0  # of the read being parsed
        self._began_in_read = False
        self._streamed = 0  # bytes of the reads after the first while the head is open
        self._head_bound = 0  # at least the head's size: the reads it arrived in
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None
        self._message_open = False  # the parser is inside a request (its head or body)
        self._declined = False  # the read being parsed was offered whole and declined: not again

    # The base class is called by name, not through super(): these run for every request.
    def data_received(self, data: bytes) -> None:
        if self._answer_now is not None and data[:1] in b"PG" and self._answered_whole(data):
            return
        self._read_size = len(data)
        try:
            self._parse(data)
        finally:
            self._declined = False

    def _parse(self, data: bytes) -> None:
        self._began_in_read = False
        HttpToolsProtocol.data_received(self, data)
        if not self._head_open or self._refusal is not None or self.transport.is_closing():
            return
        if not self._began_in_read:
            self._streamed += len(data)
            self._head_bound += len(data)
            if self._streamed > self.limits.max_bytes:
                self._refuse(431, self._too_large())
                return
        if self._head_timer is None:  # only a head that spans reads pays for a timer
            self._head_timer = self.loop.call_later(self.limits.timeout_s, self._head_timed_out)

    def on_message_begin(self) -> None:
        HttpToolsProtocol.on_message_begin(self)
        self._message_open = True
        self._head_open = self._began_in_read = True
        self._streamed = 0
        self._head_bound = self._read_size

    def on_headers_complete(self) -> None:
        self._head_open = False
        if self._head_timer is not None:
            self._cancel_head_timer()
        limits = self.limits
        # A URL or a header list over its limit is held no longer than the head's byte limit
        # allows while it arrives (data_received); it is refused here, once complete.
        if len(self.url) > limits.max_url_bytes:
            self._refusal = (414, f"The URL is longer than the limit of {limits.max_url_bytes:,} bytes.")
            raise _HeadRefused
        if len(self.headers) > limits.max_count:
            self._refusal = (431, f"More than {limits.max_count} request headers.")
            raise _HeadRefused
        # The exact size only when the reads it came in could hold more than the limit.
        if self._head_bound > limits.max_bytes:
            size = len(self.url) + sum(len(name) + len(value) for name, value in self.headers)
            if size > limits.max_bytes:
                self._refusal = (431, self._too_large())
                raise _HeadRefused
        cycle = self.cycle
        self._defer_task = self._answer_now is not None and not self._declined and self._may_answer_at_once()
        try:
            HttpToolsProtocol.on_headers_complete(self)
        finally:
            self._defer_task = False  # not started (pipelined, an upgrade): never deferred
        if self.cycle is not cycle:  # a new request's cycle (not an upgrade): it answers in one write
            self.cycle.__class__ = _OneWriteCycle

    # ---- a complete small request answered at once ----------------------------------------
    # A cached hit costs the server less than uvicorn's task, ASGI messages and the app's
    # routing: for a POST with a small declared body (or a GET of a call's result) the task
    # waits for the body (in the same read, from any real client), then the app's `answer_now`
    # is asked; its answer is written as uvicorn would write it (an answer without a
    # Content-Length chunked, as uvicorn sends a stream), and the task never made. Otherwise
    # the task starts with the whole body waiting for it, and the request is served as any other.

    def _may_answer_at_once(self) -> bool:
        # A REST infer POST; a Gradio call's POST, or the GET of its result stream (no body).
        if self.expect_100_continue or self.flow.write_paused:  # not reading its answers
            return False
        method, url = self.parser.get_method(), self.url
        if method == b"GET":
            if not url.startswith(GRADIO_CALL_PREFIX):
                return False
        elif method != b"POST" or not url.startswith(AT_ONCE_POST_PREFIXES):
            return False
        declared = None
        for name, value in self.headers:
            if name == b"content-length":
                if declared is not None or not (value.isdigit() and len(value) <= 5):
                    return False  # the task's to refuse or to take
                declared = int(value)
            elif name == b"transfer-encoding":
                return False
        if method == b"GET":
            return not declared
        return declared is not None and declared <= ANSWER_AT_ONCE_BYTES

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if self._defer_task and app is self.app:  # not uvicorn's 503 past limit_concurrency
            self._defer_task = False
            self._deferred = (cycle, app)
            return
        HttpToolsProtocol._start_asgi_task(self, cycle, app)

    def on_message_complete(self) -> None:
        self._message_open = False
        HttpToolsProtocol.on_message_complete(self)
        deferred = self._deferred
        if deferred is None:
            return
        self._deferred = None
        cycle, app = deferred
        if not self._answered_at_once(cycle):
            HttpToolsProtocol._start_asgi_task(self, cycle, app)

    def _answered_at_once(self, cycle: RequestResponseCycle) -> bool:
        if cycle.disconnected or self.flow.write_paused:
            return False
        answer = self._ask(cycle.scope, bytes(cycle.body))
        if answer is None:
            return False
        self._write_answer(cycle.scope, answer, cycle.keep_alive)
        cycle.response_started = cycle.response_complete = True
        cycle.body = bytearray()
        cycle.on_response()  # uvicorn's on_response_complete: keep-alive timer, the next pipelined request
        return True

    def _answered_whole(self, data: bytes) -> bool:
        """`data`, one whole simple request read alone between requests (ui.simple_request),
        answered at once without the parser: its callbacks, scope and cycle cost a cached hit
        more than the answer. False, nothing done: the parser reads it as any other."""
        cycle = self.cycle
        if self._message_open or self._refusal is not None or self.pipeline or self._deferred is not None:
            return False
        flow = self.flow
        if (cycle is not None and not cycle.response_complete) or flow.write_paused or flow.read_paused:
            return False
        request = self._simple_requests.read(data)
        if request is None or self.transport.is_closing():
            return False
        self._unset_keepalive_if_required()
        root = self.root_path
        scope = {
            "type": "http", "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1", "server": self.server, "client": self.client, "scheme": self.scheme,
            "root_path": root, "headers": request.headers, "state": self.app_state.copy(),
            "method": request.method, "path": root + request.path,
            "raw_path": (root + request.path).encode("ascii"), "query_string": b"",
        }  # fmt: skip
        answer = self._ask(scope, request.body)
        if answer is None:
            self._declined = True  # the parser's task serves it, without asking again
            return False
        self._write_answer(scope, answer, keep_alive=True)
        self.on_response_complete()  # as the cycle's: counted, keep-alive timer armed
        return True

    def _ask(self, scope: dict[str, Any], body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        assert self._answer_now is not None
        try:
            return self._answer_now(scope, body)  # type: ignore[no-any-return]
        except Exception:  # a bug: logged, and the task serves the request (a 500 if it fails too)
            log.exception("answering %s at once failed", scope["path"][:200])
            return None

    def _write_answer(
        self, scope: dict[str, Any], answer: tuple[int, list[tuple[bytes, bytes]], bytes], keep_alive: bool
    ) -> None:
        status, headers, body = answer
        # As uvicorn's RequestResponseCycle.send logs and writes a head and a body with a Content-Length.
        if self.access_log:
            path = get_path_with_query_string(scope)  # type: ignore[arg-type]
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"], path,  # type: ignore[arg-type]
                                    scope["http_version"], status)  # fmt: skip
        content = [STATUS_LINE[status], _default_head(self.server_state.default_headers)]
        chunked = True  # an answer without a length is a stream: sent chunked, in one chunk
        for name, value in headers:
            content.extend((name, b": ", value, b"\r\n"))
            chunked = chunked and name != b"content-length"
        if not keep_alive:
            content.append(b"connection: close\r\n")
        if chunked:
            content.append(b"transfer-encoding: chunked\r\n")
            body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
        content.extend((b"\r\n", body))
        self.transport.write(b"".join(content))
        if not keep_alive:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a parser error, which is how a callback's refusal surfaces.
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(*self._refusal)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._deferred = None
        super().connection_lost(exc)

    def _too_large(self) -> str:
        return f"The request's headers are larger than the limit of {self.limits.max_bytes:,} bytes."

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_open and not self.transport.is_closing():
            self._refuse(408, f"The request's headers did not arrive within {self.limits.timeout_s:g} s.")

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, message: str) -> None:
        self._refusal = (status, message)
        self._head_open = False
        self._cancel_head_timer()
        self.refusals.refused(
            self.client[0] if self.client else "unknown", f"a request head: {status} {message}"
        )
        body = message.encode()
        head = b"".join(
            [
                STATUS_LINE[status],
                b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
            ]
        )
        self.transport.write(head + body)
        self.transport.close()


_last_default_head: tuple[Any, bytes] = (None, b"")


def _default_head(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The server's default headers (date, server) as uvicorn writes them; uvicorn makes a new
    list when the date changes (once a second), so the bytes are kept for the list."""
    global _last_default_head
    kept_for, head = _last_default_head
    if kept_for is not default_headers:
        head = b"".join(b"%b: %b\r\n" % (name.lower(), value) for name, value in default_headers)
        _last_default_head = (default_headers, head)
    return head


class _OneWriteCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, but the head of a small response with a
    Content-Length is held until its body comes and goes out with it in one write (the same
    bytes). A streamed or chunked response, a HEAD's, a 1xx/204/304 is sent as uvicorn sends it."""

    async def send(self, message: Any) -> None:
        starts = not self.response_started and message["type"] == "http.response.start"
        if starts and _one_write(self, message):
            transport = self.transport
            self.transport = _HeldHead(transport)  # type: ignore[assignment]
            try:
                await RequestResponseCycle.send(self, message)
            except BaseException:
                self.transport = transport
                raise
            return
        try:
            await RequestResponseCycle.send(self, message)
        finally:
            held = self.transport
            if isinstance(held, _HeldHead) and (held.sent or self.disconnected):
                self.transport = held.transport


def _one_write(cycle: RequestResponseCycle, message: Any) -> bool:
    if cycle.scope["method"] == "HEAD" or message["status"] < 200 or message["status"] in (204, 304):
        return False
    for name, value in message.get("headers", ()):
        if name.lower() == b"content-length":
            size = byte_count(value.decode("latin-1"))
            return size is not None and size <= ONE_WRITE_BYTES
    return False


class _HeldHead:
    """A transport whose first write (a response's head) waits for the next (its body): one
    write of both. Closing first sends what is held. Everything else is the transport's."""

    __slots__ = ("_head", "sent", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._head: bytes | None = None
        self.sent = False

    def write(self, data: bytes) -> None:
        if self._head is None and not self.sent:
            self._head = data
            return
        self._flush(data)

    def close(self) -> None:
        self._flush(b"")
        self.transport.close()

    def _flush(self, data: bytes) -> None:
        if not self.sent:
            self.sent = True
            data = (self._head or b"") + data
            self._head = None
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def limited_http_protocol(limits: HeaderLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn builds for each connection (`uvicorn.Config(http=...)`)."""
    attributes = {"limits": limits, "refusals": RefusalLog(log)}
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), attributes)


# ---- the request body ----------------------------------------------------------------


@dataclass(frozen=True)
class BodyLimits:
    """The largest body each route takes, in bytes."""

    gradio: int  # Gradio's call, queue, component and other JSON routes: MAX_GRADIO_BODY_BYTES
    upload: int  # /gradio_api/upload: one file at MAX_UPLOAD_BYTES and its form
    admin_entry: int  # /admin/api/inspect and /evict: an input as REST takes it (an image, base64)
    admin: int = ADMIN_BODY_BYTES
    refusals: RefusalLog = field(default_factory=lambda: RefusalLog(log), compare=False, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> BodyLimits:
        return cls(
            gradio=settings.limits.max_gradio_body_bytes,
            upload=settings.limits.max_upload_bytes + UPLOAD_FORM_ALLOWANCE,
            admin_entry=oip_body_limit(settings.limits.max_upload_bytes),
        )

    def for_path(self, path: str) -> tuple[int, str] | None:
        """The limit for `path` and the key its JSON error goes under; None: the route
        bounds its own body (REST)."""
        if path.startswith(GRADIO_PREFIX):
            return (self.upload if path.rstrip("/") == UPLOAD_PATH else self.gradio), "detail"
        if path.startswith(ADMIN_PREFIX):
            return (self.admin_entry if path.rstrip("/") in ADMIN_ENTRY_PATHS else self.admin), "error"
        if path.startswith("/v2"):
            return None
        return self.gradio, "detail"  # the page, health, metrics: any body at all is odd

    async def __call__(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one HTTP request with `app` within its route's body limit."""
        rule = self.for_path(scope["path"])
        if rule is None:
            await app(scope, receive, send)
            return
        limit, key = rule
        count = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = byte_count(value.decode("latin-1"))
                if declared is not None and declared > limit:
                    await _too_large(scope, send, limit, key, self.refusals, declared=declared)
                    return
                count = count or declared is None  # too many digits to read: count it instead
            elif name == b"transfer-encoding":
                count = True
        if not count:  # no body, or one of a declared length within the limit (the parser holds it to that)
            await app(scope, receive, send)
            return
        counted = _CountedBody(scope, receive, send, limit, key, self.refusals)
        try:
            await app(scope, counted.receive, counted.send)
        except Exception:
            if not counted.refused:
                raise
            # The app was told the client left (its body was cut off); its error is moot.


class _CountedBody:
    """receive/send for a chunked body: past `limit` bytes the client gets 413 and the app
    an `http.disconnect`; whatever the app sends after that is dropped."""

    def __init__(
        self, scope: Scope, receive: Receive, send: Send, limit: int, key: str, refusals: RefusalLog
    ) -> None:
        self._scope, self._receive, self._send = scope, receive, send
        self._limit, self._key, self._refusals = limit, key, refusals
        self._received = 0
        self._started = False
        self.refused = False

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limit:
                self.refused = True
                if not self._started:
                    await _too_large(self._scope, self._send, self._limit, self._key, self._refusals)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return
        if message["type"] == "http.response.start":
            self._started = True
        await self._send(message)


async def _too_large(
    scope: Scope, send: Send, limit: int, key: str, refusals: RefusalLog, *, declared: int | None = None
) -> None:
    client = scope.get("client") or ("unknown", 0)
    how = f"declared {declared:,} bytes" if declared is not None else "chunked, counted as it streamed"
    refusals.refused(
        client[0], f"{scope['method']} {scope['path'][:200]}: 413 body over {limit:,} bytes ({how})"
    )
    message = f"The request body is larger than the limit of {limit:,} bytes for this route."
    # The rest of the body is never read: close the connection rather than drain it.
    await respond(send, 413, {key: message}, headers=[(b"connection", b"close")])
