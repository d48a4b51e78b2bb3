"""A lean probe for Gradio's two-step HTTP API: cached answers without entering Gradio.

`POST /gradio_api/call/<api>` then `GET /gradio_api/call/<api>/<event_id>` is how curl, the
"Use via API" page and HTTP clients call the app. Gradio spends 4–5 ms of server CPU on such
a call even when its queue probe finds the answer cached (its routing, session, queue and
event bookkeeping), 60 times the engine's own hit. `CachedCalls` sits in front of the
mounted Gradio app and answers those calls whose answer is already cached, from the engine
(the same probe Gradio's queue runs): a message, or an image that names a file this app's
Gradio received through its upload route (exactly a path in `Blocks.upload_file_set`,
stricter than Gradio's own check). Its outputs are rendered by the event's own output
components as Gradio renders them, and its event id handed back for the GET, which streams
the same `complete` event Gradio would. A call whose body Gradio would fail with a 500 (not
JSON, no input, an image input that is not a file reference) is refused here with 400. Everything
else (a miss, input the engine refuses, any other file reference, the `/queue` protocol of
browsers and gradio_client) goes to Gradio untouched, body and all.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic import BaseModel

from engine.service import InferenceEngine
from ui.asgi import ASGIApp, Message, Receive, Scope, Send, respond

log = logging.getLogger(__name__)


CALL_PREFIX = "/gradio_api/call/"
MAX_BODY_BYTES = 64 * 1024  # a longer body is not a cached message: Gradio's to handle
# Answers wait this long, at most this many, for their GET (Gradio keeps 2,000 sessions' worth).
PENDING_CAPACITY = 2000
PENDING_TTL_S = 300.0


@dataclass(frozen=True)
class CachedApi:
    """One API name answered here: its task, its event's output components (label,
    cache_info), how the call's one data item becomes the engine's raw input (raising
    for anything it must leave to Gradio), and what is wrong with an item of the wrong
    kind (None when its kind is right; by default any kind is)."""

    task: str
    outputs: Sequence[Any]
    raw_input: Callable[[Any], Any]
    wrong_kind: Callable[[Any], str | None] = lambda item: None


class CachedCalls:
    """ASGI wrapper of the mounted Gradio app, answering the calls of `apis` that are cached."""

    def __init__(
        self,
        gradio_app: ASGIApp,
        engine: InferenceEngine,
        apis: dict[str, CachedApi],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gradio_app = gradio_app
        self._engine = engine
        self._apis = apis
        self._clock = clock
        self._pending: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.answered = 0  # calls answered here (for tests and the curious)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(CALL_PREFIX):
            parts = scope["path"][len(CALL_PREFIX) :].strip("/").split("/")
            if parts[0] in self._apis:
                if len(parts) == 1 and scope["method"] == "POST":
                    await self._call(scope, receive, send, parts[0])
                    return
                if len(parts) == 2 and scope["method"] == "GET" and self._answer(parts[1]) is not None:
                    await _stream(send, self._pending.pop(parts[1])[1])
                    return
        await self.gradio_app(scope, receive, send)

    async def _call(self, scope: Scope, receive: Receive, send: Send, api_name: str) -> None:
        messages, complete = await _read_body(scope, receive)
        body = b"".join(m.get("body", b"") for m in messages)
        data: list[Any] | None = None
        if complete:
            data, problem = _call_data(body, self._apis[api_name])
            if problem is not None:
                log.warning("refused a call of %s: 400 %s", api_name, problem)
                await respond(send, 400, {"detail": problem})
                return
        outputs = await self._cached_outputs(api_name, data) if data is not None else None
        if outputs is None:  # not ours to answer: Gradio gets the request as it came
            await self.gradio_app(scope, _replay(messages, receive), send)
            return
        event_id = uuid.uuid4().hex
        self._remember(event_id, outputs)
        self.answered += 1
        await respond(send, 200, {"event_id": event_id})

    async def _cached_outputs(self, api_name: str, data: list[Any]) -> bytes | None:
        if len(data) != 1:
            return None  # Gradio ignores extra items; its answer, not ours
        api = self._apis[api_name]

        def probe() -> Any:
            # What Gradio's queue probe does (an L2 read or a file read may block: a thread).
            return self._engine.classify(api.task, api.raw_input(data[0]), probe=True)

        try:
            result = await anyio.to_thread.run_sync(probe)
        except Exception:  # ProbeMiss, bad input, anything: Gradio's queued call handles it
            return None
        values = (result.prediction.as_label_value(), result.cache_info())
        try:
            pairs = zip(api.outputs, values, strict=True)
            return json.dumps([_rendered(component, value) for component, value in pairs]).encode()
        except Exception:  # never a 500 for what Gradio itself can answer
            log.exception("could not render a cached answer for %s; Gradio answers it", api_name)
            return None

    def _remember(self, event_id: str, outputs: bytes) -> None:
        now = self._clock()
        self._pending[event_id] = (now, outputs)
        while self._pending:
            oldest, (at, _) = next(iter(self._pending.items()))
            if len(self._pending) <= PENDING_CAPACITY and now - at <= PENDING_TTL_S:
                break
            del self._pending[oldest]

    def _answer(self, event_id: str) -> bytes | None:
        entry = self._pending.get(event_id)
        return None if entry is None else entry[1]


def _call_data(body: bytes, api: CachedApi) -> tuple[list[Any] | None, str | None]:
    """A call's inputs (its "data", a non-empty list), or what is wrong with its body."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # invalid UTF-8 too; nesting deeper than Python's stack
        return None, "The body must be JSON: {\"data\": [<input>]}."
    data = request.get("data") if isinstance(request, dict) else None
    if not isinstance(data, list) or not data:
        return None, "The body must be a JSON object whose \"data\" is a list holding the input."
    problem = api.wrong_kind(data[0])
    return (None, problem) if problem is not None else (data, None)


def _rendered(component: Any, value: Any) -> Any:
    """What Gradio sends for `value` as this output component (Blocks.postprocess_data)."""
    rendered = component.postprocess(value)
    # Gradio's data models (LabelData, JsonData, ...) are pydantic: Gradio sends their dump.
    return rendered.model_dump() if isinstance(rendered, BaseModel) else rendered


async def _read_body(scope: Scope, receive: Receive) -> tuple[list[Message], bool]:
    """The request's body messages, and whether all of it was read (up to MAX_BODY_BYTES)."""
    headers = dict(scope.get("headers") or [])
    length = headers.get(b"content-length")
    if length is None or not length.isdigit() or int(length) > MAX_BODY_BYTES:
        return [], False
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages, message["type"] == "http.request"


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that first hands back the messages already read."""
    queued = list(messages)

    async def replay() -> Message:
        return queued.pop(0) if queued else await receive()

    return replay


async def _stream(send: Send, outputs: bytes) -> None:
    """The event stream Gradio sends for a completed call (routes.simple_predict_get)."""
    payload = b"event: complete\ndata: " + outputs + b"\n\n"
    await respond(send, 200, payload, content_type="text/event-stream; charset=utf-8",
                  headers=[(b"cache-control", b"no-cache")])  # fmt: skip
