"""A lean path for Gradio's two-step HTTP API: answers without Gradio's routing and queue.

`POST /gradio_api/call/<api>` (`{"data": [...]}`) or `POST /gradio_api/call/v2/<api>` (named
parameters, the snippet of the "Use via API" page), then `GET .../<event_id>`, is how curl,
HTTP clients and other sites' JavaScript call the app. Gradio spends 4–5 ms of server CPU on
such a call even when its queue probe finds the answer cached. `CachedCalls` answers the calls
whose answer is already cached, from the engine (the same probe Gradio's queue runs): a
message, or an image that names a file this app's Gradio received through its upload route
(exactly a path in `Blocks.upload_file_set`). Its outputs are rendered by the event's own
output components as Gradio renders them, and the GET streams the `complete` event Gradio would.
A miss is computed here as well while Gradio's queue would start it at once (nothing waits in
the queue, the event's lane has room): the engine's answer, or the `error` event of the
callback's gr.Error for what the engine refuses. With calls waiting, a miss waits its turn in
Gradio's queue (about 9 ms of server CPU a call: the reason for computing it here).

No client can tell it is there. It is a middleware of the mounted Gradio app, inside Gradio's
own CORS and compression middleware, so its answers carry exactly the headers Gradio's do.
A call it does not answer (a miss while calls wait in the queue, a body Gradio would refuse or
fail on, any other file reference) goes on as it came, body and all, to the app's guard
(ui.gradio_guard, which refuses what Gradio would turn into a 500) and Gradio; so does the
`/queue` protocol of browsers and gradio_client. A second GET of an answered call gets what
Gradio gives (a stream of heartbeats until the client leaves). An event id or session Gradio
does not know gets Gradio's `404` event on a stream closed cleanly (Gradio breaks the stream
off and logs a traceback), with one log line per client per minute. The deliberate
differences are listed in docs/DESIGN.md ("Cached calls skip Gradio").
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import anyio
import gradio as gr
import orjson
from gradio.route_utils import CustomCORSMiddleware
from gradio.server_messages import UnexpectedErrorMessage
from gradio.utils import error_payload, get_heartbeat_rate
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import get_route_path

from api.repeats import CLIENT_ENTRIES, REPEAT_BODY_BYTES, REPEAT_ENTRIES, Lru
from engine.capacity.fairness import client_id
from engine.pipeline.service import InferenceEngine
from ui.app_ui import user_errors
from ui.asgi import ASGIApp, Message, Receive, Scope, Send, read_body, replay
from ui.call_protocol import (
    MAX_BODY_BYTES,
    NOT_FOUND,
    SSE_CONTENT_TYPE,
    RefusalLog,
    body_part,
    error_event,
    event_stream,
    json_answer,
    json_body,
    json_response,
    named_data,
    simple_data,
    sse_start,
)
from ui.gradio_guard import RefusedCalls
from ui.lean_sessions import DeliveredIds

log = logging.getLogger(__name__)


CALL_PREFIX = "/gradio_api/call/"
QUEUE_DATA_PATH = "/gradio_api/queue/data"
# Answers wait this long, at most this many, for their GET (Gradio keeps 2,000 sessions' worth).
PENDING_CAPACITY = 2000
PENDING_TTL_S = 300.0
NOT_DATA = object()  # a body remembered as one Gradio would not take


@dataclass(frozen=True)
class CachedApi:
    """One API name answered here: its task, its event's input and output components (label,
    cache_info), and how the call's one data item becomes the engine's raw input (raising
    for anything it must leave to Gradio)."""

    task: str
    input: Any
    outputs: Sequence[Any]
    raw_input: Callable[[Any], Any]
    # The raw input when it is cheap to get on the event loop (a message; an upload of a
    # size read in microseconds), else raising: the probe then runs in a thread.
    raw_input_now: Callable[[Any], Any] | None = None
    # Gradio's BlockFunction of the event: its queue lane (concurrency id and limit). With
    # one, a miss is computed here while Gradio's queue would have started it at once.
    event: Any = None


class CachedCalls:
    """Answers the calls of `apis` that are cached, as a middleware of the Gradio app once
    `install()`ed; `enabled = False` sends every request on (a plain Gradio app, to compare)."""

    def __init__(
        self,
        gradio_app: Any,
        engine: InferenceEngine,
        apis: dict[str, CachedApi],
        *,
        clock: Callable[[], float] = time.monotonic,
        refused: RefusedCalls | None = None,
    ) -> None:
        self.app: ASGIApp = _not_wired
        # Calls the guard accepted only to refuse their input (ui.gradio_guard): their GET streams
        # the reason as Gradio's error event, with the shortcut on or off.
        self.refused = refused
        self._gradio_app = gradio_app
        self._engine = engine
        self._apis = apis
        self._clock = clock
        self._blocks = gradio_app.get_blocks()
        self._named: dict[str, Any] | None = None  # Gradio's API info per "/<api>", built on first use
        self._pending: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # event id -> its event
        # What a repeated call need not pay again (all bounded LRUs): its body's parsed data,
        # its client's label, and the rendered label of an entry (checked against the entry's
        # prediction: a recomputed answer is rendered anew).
        self._bodies = Lru(REPEAT_ENTRIES)  # (api, named, content type, body) -> data or NOT_DATA
        self._labels = Lru(REPEAT_ENTRIES)  # (api, key) -> (Prediction, rendered label as JSON)
        self._clients = Lru(CLIENT_ENTRIES)  # address -> engine.capacity.fairness.client_id
        # Answered calls a second GET may name: the lean session holder's table when installed.
        holder_table = getattr(getattr(gradio_app, "state_holder", None), "delivered", None)
        self._delivered: DeliveredIds = holder_table if holder_table is not None else DeliveredIds()
        self._refusals = RefusalLog(log, clock=clock)
        # Gradio's login (auth=...) guards these routes; this app sets none, and with one every
        # request goes to Gradio.
        self.enabled = getattr(gradio_app, "auth", None) is None and gradio_app.auth_dependency is None
        self._computing: Counter[str] = Counter()  # misses computed here now, by Gradio queue lane
        self.answered = 0  # calls answered here (for tests and the curious)
        self.answered_now = 0  # of which by answer_now (POST and GET answered without a task)

    def install(self) -> None:
        """Become a middleware of the Gradio app, just inside Gradio's CORS middleware (so
        every answer gets Gradio's CORS and compression) and in front of the app's own."""
        stack = self._gradio_app.user_middleware
        cors = next((i for i, m in enumerate(stack) if m.cls is CustomCORSMiddleware), len(stack) - 1)
        stack.insert(cors + 1, Middleware(self.around))

    def around(self, app: ASGIApp) -> CachedCalls:
        """The middleware factory Starlette calls with the app inside this one."""
        self.app = app
        return self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, method = get_route_path(scope), scope["method"]
            route = None
            if path.startswith(CALL_PREFIX) and method in ("POST", "GET"):
                route = _call_route(method, path[len(CALL_PREFIX) :].split("/"))
            if route is not None and method == "GET" and self.refused is not None:
                reason = self.refused.pop(route[0])
                if reason is not None:
                    await event_stream(error_event(reason))(send)
                    return
            if self.enabled and route is not None:
                if method == "POST":
                    await self._post(scope, receive, send, route[0], named=route[1])
                else:
                    await self._get(scope, receive, send, route[0])
                return
            if self.enabled and path == QUEUE_DATA_PATH and method == "GET":
                if self._unknown_session(scope):
                    self._refused(scope, "a stream of an unknown session: 404")
                    error = UnexpectedErrorMessage(message=NOT_FOUND, session_not_found=True).model_dump()
                    await event_stream(b"data: " + orjson.dumps(error, default=str) + b"\n\n")(send)
                else:
                    await self._gradio_stream(scope, receive, send)
                return
        await self.app(scope, receive, send)

    # ---- POST: queue a call ------------------------------------------------------

    async def _post(self, scope: Scope, receive: Receive, send: Send, api_name: str, *, named: bool) -> None:
        messages, body = await read_body(receive, MAX_BODY_BYTES)
        event = None
        if isinstance(body, bytes) and api_name in self._apis:
            api = self._apis[api_name]
            item = self._item(api, self._data(scope, api_name, named, body))
            if item is not NOT_DATA:
                client = self._client(scope)
                result = self._from_memory(api, item, client)
                if result is not None:
                    event = self._complete(api, result)
                elif self._lane_free(api):
                    event = await self._computed(api, item, client)
                else:
                    event = await self._probed(api, item, client)
        if event is None:  # not ours to answer: on to the guard and Gradio, as it came
            await self.app(scope, replay(messages, receive), send)
            return
        await json_response(200, {"event_id": self._queued(event)})(send)

    def answer_now(self, scope: Scope, body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """The whole answer to a complete call request when it can be made at once, without a
        task or the ASGI messages (the server's protocol asks, ui.limits, through
        ui.startup.ServingApp): the POST of a call this replica's memory answers, the GET of
        an answer waiting here. The same bytes as the app would send; the hit logged and
        counted as any. None, with nothing done, for anything else (a request with an Origin
        too: Gradio's CORS middleware has headers to add)."""
        if not self.enabled or any(name == b"origin" for name, _ in scope["headers"]):
            return None
        path, method = scope["path"], scope["method"]
        route = (
            _call_route(method, path[len(CALL_PREFIX) :].split("/")) if path.startswith(CALL_PREFIX) else None
        )
        if route is None:
            return None
        if method == "GET":
            entry = self._pending.pop(route[0], None)
            if entry is None:
                return None
            self._delivered.add(route[0])
            self.answered_now += 1
            return 200, [SSE_CONTENT_TYPE], entry[1]
        api = self._apis.get(route[0])
        if api is None or api.raw_input_now is None:
            return None
        item = self._item(api, self._data(scope, route[0], route[1], body))
        result = self._from_memory(api, item, self._client(scope)) if item is not NOT_DATA else None
        if result is None:
            return None
        event = self._complete(api, result)
        if event is None:
            return None
        self.answered_now += 1
        return json_answer(200, {"event_id": self._queued(event)})

    def _queued(self, event: bytes) -> str:
        """A new event id whose GET streams `event`."""
        event_id = uuid.uuid4().hex
        self._remember(event_id, event)
        self.answered += 1
        return event_id

    def _client(self, scope: Scope) -> str:
        address = (scope.get("client") or ("",))[0]  # as engine.capacity.forwarding left it
        client = self._clients.get(address)
        if client is None:
            client = client_id(address)
            self._clients.put(address, client)
        return client  # type: ignore[no-any-return]

    def _data(self, scope: Scope, api_name: str, named: bool, body: bytes) -> list[Any] | None:
        """The call's inputs as Gradio's route takes them, or None; a repeated small body
        (a client asking the same again) is parsed once."""
        content_type = next((v for k, v in scope.get("headers") or () if k == b"content-type"), None)
        key = (api_name, named, content_type, body)
        data = self._bodies.get(key) if len(body) <= REPEAT_BODY_BYTES else None
        if data is None:
            request = json_body(scope, body)
            data = named_data(self._endpoint(api_name), request) if named else simple_data(request)
            if len(body) <= REPEAT_BODY_BYTES:
                self._bodies.put(key, NOT_DATA if data is None else data)
        return None if data is NOT_DATA else data

    def _endpoint(self, api_name: str) -> dict[str, Any] | None:
        """Gradio's /gradio_api/info entry of a named endpoint (its parameters), or None."""
        if self._named is None:
            self._named = self._blocks.get_api_info()["named_endpoints"]
        return self._named.get("/" + api_name)

    def _item(self, api: CachedApi, data: list[Any] | None) -> Any:
        """The call's one input, or NOT_DATA where Gradio's answer is not ours to give."""
        if data is None or len(data) != 1:
            return NOT_DATA  # Gradio ignores extra items; its answer, not ours
        item = data[0]
        model = getattr(api.input, "data_model", None)
        if model is not None and item is not None:
            try:  # what Gradio's preprocessing checks first (Blocks.preprocess_data)
                model.model_validate(item, context={"validate_meta": True})
            except ValidationError:
                return NOT_DATA
        return item

    def _from_memory(self, api: CachedApi, item: Any, client: str) -> Any:
        """The answer when this replica's memory holds it, on the event loop (no Redis, no
        model, no decode): the hit is logged and counted as the probe's would be. Else None."""
        if api.raw_input_now is None:
            return None
        try:
            raw = api.raw_input_now(item)
        except Exception:
            return None
        return self._engine.classify_from_memory(api.task, raw, route="gradio", client=client)

    async def _probed(self, api: CachedApi, item: Any, client: str) -> bytes | None:
        """The `complete` event of an answer cached beyond this replica's memory (Gradio's queue
        probe, done here), or None."""

        def probe() -> Any:
            # What Gradio's queue probe does (an L2 read or a file read may block: a thread).
            return self._engine.classify(api.task, api.raw_input(item), probe=True, client=client)

        try:
            result = await anyio.to_thread.run_sync(probe)
        except Exception:  # ProbeMiss, bad input, anything: Gradio's queued call handles it
            return None
        return self._complete(api, result)

    def _lane_free(self, api: CachedApi) -> bool:
        """Whether Gradio's queue would start a call of `api` at once: nothing waits in it (so
        no call is overtaken, and neither its size nor a client's share could refuse this one)
        and the event's lane has room, counting the misses computed here."""
        queue = self._blocks._queue
        if api.event is None or queue.stopped or len(queue) or queue.max_size == 0:
            return False
        limit = api.event.concurrency_limit
        if limit == "default":
            limit = queue.default_concurrency_limit
        lane = queue.event_queue_per_concurrency_id.get(api.event.concurrency_id)
        running = self._computing[api.event.concurrency_id] + (lane.current_concurrency if lane else 0)
        return limit is None or running < limit

    async def _computed(self, api: CachedApi, item: Any, client: str) -> bytes | None:
        """The event Gradio's queued call would end with, computed here without the queue: its
        `complete` event, or its `error` event for what the engine refuses (the callback's
        words, ui.app_ui.user_errors). None for an input only Gradio answers (not a message, a
        file it did not receive: its guard refuses it)."""
        lane = api.event.concurrency_id
        self._computing[lane] += 1
        try:
            outcome = await anyio.to_thread.run_sync(self._classify, api, item, client)
        finally:
            self._computing[lane] -= 1
        if isinstance(outcome, gr.Error):
            return error_event(error_payload(outcome, self._blocks.show_error))
        return None if outcome is None else self._complete(api, outcome)

    def _classify(self, api: CachedApi, item: Any, client: str) -> Any:
        """The engine's answer (a thread: Redis, a file, the model), a gr.Error, or None."""
        try:
            raw = api.raw_input(item)
        except Exception:
            return None
        try:
            with user_errors(probe=False):
                return self._engine.classify(api.task, raw, client=client)
        except gr.Error as exc:
            return exc

    def _complete(self, api: CachedApi, result: Any) -> bytes | None:
        """The `complete` event of `result`, or None when it cannot be rendered (Gradio answers)."""
        try:
            return b"event: complete\ndata: " + self._outputs(api, result) + b"\n\n"
        except Exception:  # never a 500 for what Gradio itself can answer
            log.exception("could not render an answer for %s; Gradio answers it", api.task)
            return None

    def _outputs(self, api: CachedApi, result: Any) -> bytes:
        """The event's outputs as Gradio renders them: json.dumps of the rendered label and
        cache_info, the label kept rendered per entry."""
        label_output, info_output = api.outputs  # classify events have these two
        kept = self._labels.get((api.task, result.key))
        if kept is None or (kept[0] is not result.prediction and kept[0] != result.prediction):
            kept = (
                result.prediction,
                json.dumps(_rendered(label_output, result.prediction.as_label_value())),
            )
            self._labels.put((api.task, result.key), kept)
        # json.dumps of a two-item list is its items' dumps joined by ", ".
        return f"[{kept[1]}, {json.dumps(_rendered(info_output, result.cache_info()))}]".encode()

    def _remember(self, event_id: str, event: bytes) -> None:
        now = self._clock()
        self._pending[event_id] = (now, event)
        while self._pending:
            oldest, (at, _) = next(iter(self._pending.items()))
            if len(self._pending) <= PENDING_CAPACITY and now - at <= PENDING_TTL_S:
                break
            del self._pending[oldest]

    # ---- GET: the result stream --------------------------------------------------

    async def _get(self, scope: Scope, receive: Receive, send: Send, event_id: str) -> None:
        entry = self._pending.pop(event_id, None)
        if entry is not None:
            self._delivered.add(event_id)
            await event_stream(entry[1])(send)
        elif event_id in self._delivered:
            # Gradio keeps an answered call's session: a second GET waits on it, with heartbeats,
            # and when that client leaves Gradio drops the session (a third GET finds none).
            await self._heartbeats(receive, send)
            self._delivered.discard(event_id)
        elif self._unknown_event(event_id):
            self._refused(scope, "a result stream of an unknown event id: 404")
            await event_stream(error_event(NOT_FOUND))(send)
        else:
            await self._gradio_stream(scope, receive, send)

    async def _gradio_stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One of Gradio's event streams. When its session goes away while it runs (evicted,
        cleaned up), Gradio sends its 404 event, then raises an HTTPException that Starlette
        can no longer answer: the stream would break off with a traceback in the log. It is
        closed cleanly instead (the client has read the event)."""
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except RuntimeError as exc:
            if not (started and isinstance(exc.__cause__, HTTPException)):
                raise
            self._refused(scope, f"a stream whose session went away: {exc.__cause__.status_code}")
            await send(body_part(b"", more=False))

    def _unknown_event(self, event_id: str) -> bool:
        """Whether Gradio's GET would find no session for `event_id` (routes.simple_predict_get)."""
        queue = self._blocks._queue
        event = queue.event_ids_to_events.get(event_id)
        if event is not None:
            return event.session_hash not in queue.pending_messages_per_session
        try:
            sessions = (s for s, ids in queue.pending_event_ids_session.items() if event_id in ids)
            return next(sessions, event_id) not in queue.pending_messages_per_session
        except RuntimeError:  # changed by a call on another thread: Gradio answers
            return False

    def _unknown_session(self, scope: Scope) -> bool:
        session = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash")
        return bool(session) and session[-1] not in self._blocks._queue.pending_messages_per_session

    async def _heartbeats(self, receive: Receive, send: Send) -> None:
        """Gradio's stream of a session with nothing left to say: a heartbeat every
        GRADIO_HEARTBEAT_INTERVAL seconds until the client leaves or the server stops."""
        await send(sse_start())
        queue = self._blocks._queue

        async def beat() -> None:
            try:
                while True:
                    await anyio.sleep(get_heartbeat_rate())
                    if queue.stopped or not self._blocks.is_running:
                        await send(body_part(error_event("Server stopped unexpectedly."), more=False))
                        break
                    await send(body_part(b"event: heartbeat\ndata: null\n\n"))
            except OSError:  # the client left while a heartbeat was being written
                pass
            group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(beat)
            while (await receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

    def _refused(self, scope: Scope, what: str) -> None:
        client = scope.get("client")
        self._refusals.refused(client[0] if client else "unknown", what)


def _call_route(method: str, parts: list[str]) -> tuple[str, bool] | None:
    """Which of Gradio's call routes a path after /gradio_api/call/ is: (API name, named
    parameters) for POST <api>[/] and v2/<api>[/], (event id, False) for GET [v2/]<api>/<id>."""
    if method == "POST":
        if len(parts) > 1 and parts[-1] == "":
            parts = parts[:-1]
        named = len(parts) == 2 and parts[0] == "v2"
        return (parts[-1], named) if (len(parts) == 1 or named) and parts[-1] else None
    if all(parts) and (len(parts) == 2 or (len(parts) == 3 and parts[0] == "v2")):
        return parts[-1], False
    return None


async def _not_wired(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("CachedCalls runs as a middleware: Middleware(shortcut.around)")


def _rendered(component: Any, value: Any) -> Any:
    """What Gradio sends for `value` as this output component (Blocks.postprocess_data)."""
    rendered = component.postprocess(value)
    # Gradio's data models (LabelData, JsonData, ...) are pydantic: Gradio sends their dump.
    return rendered.model_dump() if isinstance(rendered, BaseModel) else rendered
