"""Gradio's two-step call protocol as Gradio 6.31 speaks it, for `ui.cached_calls`: how its
routes read a body (which bodies it takes at all), and the responses and event streams it
writes. Each rule names the Gradio or FastAPI code it follows; `tests/test_gradio_differential.py`
checks them against the same app without the shortcut.
"""

from __future__ import annotations

import email.message
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cachetools import LRUCache
from fastapi import HTTPException
from gradio.data_classes import SimplePredictBody
from gradio_client.utils import construct_args
from pydantic import ValidationError

from ui.asgi import Message, Scope, Send

# The largest body of a call the shortcut answers, read whole (chunked or not): a message is
# at most MAX_TEXT_CHARS (12 KB as JSON escapes at worst), an image travels as a file
# reference. A longer body goes on to Gradio's guard and limits as it came.
MAX_BODY_BYTES = 64 * 1024
REFUSAL_LOG_WINDOW_S = 60.0
REFUSAL_LOG_CLIENTS = 4096
NOT_FOUND = str(HTTPException(status_code=404))  # what Gradio's streams say: "404: Not Found"
NOT_JSON = object()  # a body FastAPI does not parse as JSON for Gradio's routes
# Text UTF-8 cannot carry: Gradio fails on it with a 500 where it must encode it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

Responder = Callable[[Send], Awaitable[None]]


class RefusalLog:
    """One log line per client per window: the first refusal, then at most one a window,
    each saying how many went unlogged since (a client repeating a bad call cannot flood
    the log)."""

    def __init__(self, logger: logging.Logger, *, window_s: float = REFUSAL_LOG_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._log = logger
        self._window_s = window_s
        self._clock = clock
        self._clients: LRUCache[str, list[float]] = LRUCache(maxsize=REFUSAL_LOG_CLIENTS)

    def refused(self, client: str, what: str) -> None:
        now = self._clock()
        entry = self._clients.get(client)
        if entry is not None and now - entry[0] < self._window_s:
            entry[1] += 1
            return
        unlogged = int(entry[1]) if entry is not None else 0
        more = f" ({unlogged} more refused since the last line)" if unlogged else ""
        self._log.warning("refused %s from %s%s", what, client, more)
        self._clients[client] = [now, 0]


# ---- bodies -----------------------------------------------------------------------


def json_body(scope: Scope, body: bytes) -> Any:
    """The body as FastAPI parses it for Gradio's routes (fastapi.routing.get_request_handler),
    or NOT_JSON when it would not: a content type other than JSON, or bytes that are not JSON.
    With no content type FastAPI's answer depends on its strictness: NOT_JSON, Gradio decides."""
    # The first Content-Type, as Starlette's Headers.get reads it.
    content_type = next((v for k, v in scope.get("headers") or () if k == b"content-type"), None)
    if content_type is None or not body:
        return NOT_JSON
    if content_type != b"application/json":
        message = email.message.Message()
        message["content-type"] = content_type.decode("latin-1")
        subtype = message.get_content_subtype()
        is_json = subtype == "json" or subtype.endswith("+json")
        if message.get_content_maintype() != "application" or not is_json:
            return NOT_JSON
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # invalid UTF-8 too; nesting deeper than Python's stack
        return NOT_JSON


def simple_data(request: Any) -> list[Any] | None:
    """The inputs of a `{"data": [...]}` call (routes.simple_predict_post); None when Gradio
    would not take the body as it is (its 422), or its session hash is empty or holds a lone
    surrogate (a KeyError, a 500 in Gradio: refused by the guard)."""
    if request is NOT_JSON:
        return None
    try:
        body = SimplePredictBody.model_validate(request)
    except ValidationError:
        return None
    session = body.session_hash
    if session is not None and (session == "" or LONE_SURROGATE.search(session)):
        return None
    return body.data


def named_data(endpoint: dict[str, Any] | None, request: Any) -> list[Any] | None:
    """The positional inputs of a named-parameter (`v2`) call, as Gradio's route builds them
    from `endpoint` (its /gradio_api/info entry); None when Gradio would not take it: not a
    JSON object, an unknown API, unknown or missing parameters."""
    if not isinstance(request, dict) or endpoint is None:
        return None
    parameters = endpoint["parameters"]
    kwargs = dict(request)
    # As Gradio's route does: an oauth_token that is not a parameter is dropped.
    if endpoint.get("oauth_token") or all(p.get("parameter_name") != "oauth_token" for p in parameters):
        kwargs.pop("oauth_token", None)
    try:
        return construct_args(parameters, (), kwargs)
    except (TypeError, ValueError):
        return None


# ---- responses -----------------------------------------------------------------------


SSE_CONTENT_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")


def sse_start() -> Message:
    # A new headers list each time: Gradio's CORS middleware adds to it in place.
    return {"type": "http.response.start", "status": 200, "headers": [SSE_CONTENT_TYPE]}


def body_part(chunk: bytes, *, more: bool = True) -> Message:
    return {"type": "http.response.body", "body": chunk, "more_body": more}


def json_answer(status: int, content: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """A JSON response as Starlette's JSONResponse writes it (compact): status, headers, body."""
    payload = json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
    return (
        status,
        [(b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")],
        payload,
    )


def json_response(status: int, content: Any) -> Responder:
    """json_answer as an ASGI response."""
    status, headers, payload = json_answer(status, content)

    async def respond(send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(body_part(payload, more=False))

    return respond


def event_stream(events: bytes) -> Responder:
    """A finished event stream, as Gradio's StreamingResponse sends it: no length (chunked),
    the events as a part with more to come, then an empty last part (which is what makes
    Gradio's compression middleware treat it as a stream)."""

    async def respond(send: Send) -> None:
        await send(sse_start())
        await send(body_part(events))
        await send(body_part(b"", more=False))

    return respond


def error_event(message: str | dict[str, Any]) -> bytes:
    """An `error` event of Gradio's call streams (routes.simple_predict_get, process_msg): a
    message, or a failed call's payload (gradio.utils.error_payload)."""
    return b"event: error\ndata: " + json.dumps(message).encode() + b"\n\n"
