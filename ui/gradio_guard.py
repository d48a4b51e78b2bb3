"""Refusals in front of Gradio for requests it would turn into a server error.

Gradio 6.31 answers several client mistakes with HTTP 500 and a logged traceback, because
its queue runs a cached callback's preprocessing (the probe) while the POST is still open:

- an unknown `fn_index` (`/queue/join`, `/run/*`, `/api/*`): a KeyError;
- fewer inputs than the event takes, or an input its component's data model refuses
  (`{"data": [5]}` for an image): a ValueError or a pydantic ValidationError;
- a file reference to a URL (`{"path": "http://...", "meta": {"_type": "gradio.FileData"}}`):
  Gradio downloads it for the call, and its SSRF guard raises for a private address;
- an empty `session_hash` on `/queue/join`: a KeyError once the answer is cached;
- a `session_hash` with an unpaired surrogate ("\\ud800" in JSON): the queue's analytics
  (a pandas frame of every recent event, Arrow strings once pyarrow is installed) raise on it
  after each later call, with a traceback, until 10,000 other events have pushed it out;
- `/call/v2/<api>` with an unknown API name or an unknown or missing named parameter;
- `/component_server` with an unknown `component_id`: a KeyError;
- the `fn_index` of an event that runs in the browser only (`js`, no server function): an
  IndexError;
- a Radio's, Dropdown's or CheckboxGroup's value outside its choices: gradio.exceptions.Error.

`GradioGuard` is an ASGI middleware inside the mounted Gradio app (inside Gradio's CORS
layer, so refusals carry the headers Gradio's own answers carry). For those routes it reads
the JSON body (within a limit: ui.limits bounds bodies in front of the app, this bounds an
app served without it), reads it with Gradio's own models, and refuses what Gradio would
fail on: 404 for an unknown event or component, 400 for a URL file reference or an empty or
unencodable session, 422 for inputs Gradio cannot take, each with a message and a log line.
Everything else goes to Gradio with its body replayed. A remote file is never fetched: this
app classifies files uploaded to it.

On `/queue/join` (the route of gradio_client, the JS client and the browser), a refused input
is answered as Gradio answers an input its event's validator refuses: 422 with
`{"detail": [{"__type__": "validate", "is_valid": false, "parameter_name": ..., "message": ...}]}`.
gradio_client raises only a bare `400 Bad Request` for any other refusal (it reads no body but
that one), and fails on a 422 whose detail is a string; this one it raises as
`ValidationError("1 parameter(s) failed validation:\n- image: <the reason>")`.

On `/call/<api>` and `/call/v2/<api>` (curl, the "Use via API" page's bash snippet), a refused
input is answered as Gradio answers a call whose function raises: the call is accepted
(`{"event_id": ...}`) and its result stream (`GET /call/<api>/<event_id>`, answered by
ui.cached_calls from `RefusedCalls`) is one `event: error` with the reason. The snippet pipes
the POST's answer into awk for the event id: a 4xx body's reason would be lost there.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr
from gradio import utils as gradio_utils
from gradio.data_classes import ComponentServerJSONBody, FileData, PredictBody, SimplePredictBody
from gradio_client.utils import construct_args, is_file_obj_with_meta, is_http_url_like
from pydantic import ValidationError
from starlette.routing import get_route_path

from ui.asgi import TOO_LARGE, ASGIApp, Receive, Scope, Send, read_body, replay, respond
from ui.call_protocol import LONE_SURROGATE, RefusalLog, json_response

log = logging.getLogger(__name__)

_PREDICT = re.compile(r"/gradio_api/(queue/join|call/(?!v2/)[^/]+|run/[^/]+|api/[^/]+)/?")
_CALL_V2 = re.compile(r"/gradio_api/call/v2/([^/]+)/?")
_COMPONENT_SERVER = re.compile(r"/gradio_api/component_server/?")
NOT_AN_UPLOAD = (
    "This app classifies files uploaded to it and does not fetch URLs: POST the file to "
    "/gradio_api/upload and pass the path it answers."
)


REFUSED_CALLS_CAPACITY = 2000  # as many as ui.cached_calls keeps answers waiting for their GET
REFUSED_CALLS_TTL_S = 300.0


class RefusedCalls:
    """The reasons of refused `/call` inputs, by the event id their POST answered, until the
    GET reads them: at most `capacity`, none older than `ttl_s`."""

    def __init__(self, *, capacity: int = REFUSED_CALLS_CAPACITY, ttl_s: float = REFUSED_CALLS_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reasons: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def add(self, reason: str) -> str:
        event_id = uuid.uuid4().hex
        now = self._clock()
        with self._lock:
            self._reasons[event_id] = (now, reason)
            while self._reasons:
                oldest, (at, _) = next(iter(self._reasons.items()))
                if len(self._reasons) <= self._capacity and now - at <= self._ttl_s:
                    break
                del self._reasons[oldest]
        return event_id

    def pop(self, event_id: str) -> str | None:
        with self._lock:
            entry = self._reasons.pop(event_id, None)
        return entry[1] if entry is not None and self._clock() - entry[0] <= self._ttl_s else None


class Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail: Any = message  # the body's "detail"
        self.input_index: int | None = None  # the input refused, where one is
        self.call_input = False  # an input of a /call: answered as an error event (RefusedCalls)


def as_validation(refusal: Refusal, parameter: str) -> Refusal:
    """`refusal` as Gradio's answer to an input its event's validator refuses (see the module
    docstring): the one 4xx body gradio_client shows its user."""
    answer = Refusal(422, refusal.message)
    answer.detail = [{"__type__": "validate", "is_valid": False, "parameter_name": parameter,
                      "message": refusal.message}]  # fmt: skip
    return answer


class GradioGuard:
    """ASGI middleware of the Gradio app serving `blocks` (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, *, blocks: Any, max_body_bytes: int, refused_calls: RefusedCalls | None = None
    ) -> None:
        self.app = app
        self._blocks = blocks
        self._refused_calls = refused_calls
        self._max_body_bytes = max_body_bytes
        self._named_parameters: dict[str, list[dict[str, Any]]] | None = None
        self._refusals = RefusalLog(log)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        check = self._check_for(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        if check is None:
            await self.app(scope, receive, send)
            return
        messages, body = await read_body(receive, self._max_body_bytes)
        try:
            if body is TOO_LARGE:
                limit = self._max_body_bytes
                raise Refusal(413, f"The request body is larger than the limit of {limit:,} bytes.")
            if isinstance(body, bytes) and (request := _json(body)) is not None:  # else Gradio answers it
                check(request)
        except Refusal as refusal:
            client = scope.get("client") or ("unknown", 0)
            what = f"POST {scope['path'][:200]}: {refusal.status} {refusal.message[:300]}"
            self._refusals.refused(client[0], what)
            if refusal.call_input and self._refused_calls is not None:
                event_id = self._refused_calls.add(refusal.message)
                await json_response(200, {"event_id": event_id})(send)  # the reason: the GET's error event
                return
            headers = [(b"connection", b"close")] if refusal.status == 413 else []
            await respond(send, refusal.status, {"detail": refusal.detail}, headers=headers)
            return
        await self.app(scope, replay(messages, receive), send)

    def _check_for(self, scope: Scope) -> Callable[[Any], None] | None:
        path = get_route_path(scope)
        if (match := _PREDICT.fullmatch(path)) is not None:
            route = match.group(1)
            return lambda request: self._check_predict(route, request)
        if (match := _CALL_V2.fullmatch(path)) is not None:
            api_name = match.group(1)
            return lambda request: self._check_call_v2(api_name, request)
        if _COMPONENT_SERVER.fullmatch(path) is not None and not _multipart(scope):
            return self._check_component_server
        return None

    # ---- the routes --------------------------------------------------------------

    def _check_predict(self, route: str, request: Any) -> None:
        kind, _, api_name = route.partition("/")  # "queue" (join), "call", "run" or "api"
        api_name = "" if kind == "queue" else api_name
        model = SimplePredictBody if kind == "call" else PredictBody
        try:
            body = model.model_validate(request)  # read as Gradio reads it ("4" is fn_index 4)
        except ValidationError:
            return  # Gradio's own 422
        if body.session_hash == "":
            raise Refusal(400, "session_hash must not be empty.")
        if body.session_hash is not None and LONE_SURROGATE.search(body.session_hash):
            raise Refusal(400, "session_hash must be text UTF-8 can carry (it has an unpaired surrogate).")
        fn_index = getattr(body, "fn_index", None)
        if fn_index is not None and kind != "call":
            fn = self._blocks.fns.get(fn_index)
            if fn is None:
                shown = str(fn_index) if abs(fn_index) < 10**12 else "out of range"
                raise Refusal(404, f"No event has fn_index {shown}; the API list is at /gradio_api/info.")
        else:
            fn = self._by_api_name(api_name) if api_name else None
            if fn is None:
                return  # no fn_index on /queue/join, or no such API: Gradio's own 400 and 404
        if fn.fn is None:  # a `js`-only event: Gradio's queue fails on it with a traceback
            shown = fn_index if fn_index is not None else api_name
            raise Refusal(400, f"Event {shown} runs in the browser only: nothing to call on the server.")
        data = _simple_data(fn, body.data) if kind == "call" else body.data
        # A classify callback (probed by Gradio's queue) cleans its text; any other event's
        # value may come back in its outputs, which Gradio's event stream cannot encode (orjson):
        # the stream breaks with a traceback.
        probed = bool(getattr(fn.fn, "cache", False))
        if not probed and LONE_SURROGATE.search(json.dumps(data, ensure_ascii=False, default=str)):
            raise Refusal(400, "Inputs must be text UTF-8 can carry (one has an unpaired surrogate).")
        try:
            _check_inputs(fn, data, self._session_blocks(body.session_hash))
        except Refusal as refusal:
            if refusal.input_index is None:
                raise
            if kind == "queue":
                raise as_validation(refusal, _parameter_name(fn, refusal.input_index)) from None
            refusal.call_input = kind == "call"
            raise

    def _check_call_v2(self, api_name: str, request: Any) -> None:
        if not isinstance(request, dict):
            return  # Gradio's own 422
        parameters = self._parameters().get(api_name)
        fn = self._by_api_name(api_name)
        if parameters is None or fn is None:
            raise Refusal(404, "No API of that name; the list is at /gradio_api/info.")
        named = {k: v for k, v in request.items() if k != "oauth_token"}  # Gradio's to take or drop
        try:
            data = construct_args(parameters, (), named)
        except (TypeError, ValueError) as exc:  # an unknown, repeated or missing parameter
            raise Refusal(422, str(exc)) from None
        try:
            _check_inputs(fn, _simple_data(fn, data))
        except Refusal as refusal:
            refusal.call_input = refusal.input_index is not None
            raise

    def _check_component_server(self, request: Any) -> None:
        try:
            body = ComponentServerJSONBody.model_validate(request)
        except ValidationError:
            return  # Gradio's own 422
        # This app renders nothing per session (no gr.render), so every component is a block.
        if body.component_id not in self._blocks.blocks:
            shown = body.component_id if abs(body.component_id) < 10**12 else "out of range"
            raise Refusal(404, f"No component has id {shown}.")

    # ---- the app's events --------------------------------------------------------

    def _session_blocks(self, session_hash: str | None) -> dict[int, Any] | None:
        """The blocks as the session sees them (Gradio keeps a copy of those an event updated),
        or None for no session or one Gradio does not know (looked up, never created)."""
        holder = getattr(self._blocks, "state_holder", None)
        session = getattr(holder, "session_data", {}).get(session_hash) if session_hash else None
        return session.blocks_config.blocks if session is not None else None

    def _by_api_name(self, api_name: str) -> Any:
        return next((fn for fn in self._blocks.fns.values() if fn.api_name == api_name), None)

    def _parameters(self) -> dict[str, list[dict[str, Any]]]:
        """Each named endpoint's parameters, as `/call/v2` reads them (built once)."""
        if self._named_parameters is None:
            endpoints = self._blocks.get_api_info()["named_endpoints"].items()
            self._named_parameters = {name.lstrip("/"): info["parameters"] for name, info in endpoints}
        return self._named_parameters


def _simple_data(fn: Any, data: list[Any]) -> list[Any]:
    """The inputs of a `/call` body as Gradio fills them (routes.prepare_simple_api_data):
    the API's inputs, with None for the inputs the API skips."""
    if len(data) == len(fn.inputs):
        return data
    api_inputs = [block for block in fn.inputs if not block.skip_api]
    if len(data) != len(api_inputs):
        return data
    items = iter(data)
    return [None if block.skip_api else next(items) for block in fn.inputs]


def _check_inputs(fn: Any, data: list[Any], session_blocks: dict[int, Any] | None = None) -> None:
    """Refuse the inputs Gradio's preprocessing would fail on (Blocks.preprocess_data)."""
    name = fn.api_name or fn.name or "this event"
    # A cached callback's inputs are preprocessed by Gradio's queue probe while the POST is
    # open, where a file that was not uploaded is answered 400 (ui.server); any other event's
    # fail later in the queue, with a traceback: those are checked here.
    probed = bool(getattr(fn.fn, "cache", False))
    if len(data) < len(fn.inputs):
        raise Refusal(422, f"{name} takes {len(fn.inputs)} input(s); the request sent {len(data)}.")
    for index, block in enumerate(fn.inputs):
        if block.stateful:
            continue  # Gradio reads the session's state, not the request
        try:
            _check_input(fn, index, block, data[index], probed=probed, session_blocks=session_blocks)
        except Refusal as refusal:
            refusal.input_index = index
            raise


def _parameter_name(fn: Any, index: int) -> str:
    """The name Gradio gives input `index` of `fn` in a validation answer
    (queueing.process_validation_response)."""
    names = list(getattr(fn, "input_parameter_names", None) or ())
    if not names and fn.fn is not None:
        try:
            names = list(inspect.signature(fn.fn).parameters)
        except (TypeError, ValueError):
            names = []
    return names[index] if index < len(names) else f"parameter_{index}"


def _check_input(
    fn: Any, index: int, block: Any, value: Any, *, probed: bool, session_blocks: dict[int, Any] | None
) -> None:
    """Input `index` of `fn` (see _check_inputs)."""
    name = fn.api_name or fn.name or "this event"
    _check_file_references(value, uploaded_only=not probed)
    if index in fn.component_prop_inputs:
        return
    if isinstance(block, gr.Dataset) and block.type != "index":
        _check_sample_index(block, value, f"Input {index} of {name}")
    if value is None:
        return
    # A session's copy of the block where an event updated it (its choices, for one).
    current = session_blocks.get(block._id, block) if session_blocks else block
    _check_choice(current, value, f"Input {index} of {name}")
    model = getattr(block, "data_model", None)
    if model is None:
        return
    try:
        read = model.model_validate(value, context={"validate_meta": True})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        detail = f"{where}: {first['msg']}" if where else first["msg"]
        kind = block.get_block_name()
        raise Refusal(422, f"Input {index} of {name} is not a valid {kind} value: {detail}.") from None
    _check_path(getattr(read, "path", None))  # a file component checks it against the upload folder


def _check_choice(block: Any, value: Any, what: str) -> None:
    """A Radio's, Dropdown's or CheckboxGroup's value among its choices, as its preprocessing
    requires (it raises gradio.exceptions.Error, which Gradio logs with a traceback)."""
    if not isinstance(block, gr.Radio | gr.Dropdown | gr.CheckboxGroup):
        return
    if getattr(block, "allow_custom_value", False):
        return
    allowed = [choice[1] for choice in block.choices]
    values = value if isinstance(block, gr.CheckboxGroup) or getattr(block, "multiselect", False) else [value]
    if not isinstance(values, list) or any(not _hashable(v) or v not in allowed for v in values):
        shown = ", ".join(repr(c) for c in allowed[:10])
        raise Refusal(422, f"{what} must be one of {shown}.")


def _hashable(value: Any) -> bool:
    return isinstance(value, str | int | float | bool)


def _check_sample_index(dataset: Any, value: Any, what: str) -> None:
    """An example's index, as gr.Dataset.preprocess looks it up (the examples of this app
    are the same in every session). None too is refused: gr.Examples' loader unpacks what
    the Dataset hands it, and a click always sends an index."""
    count = len(dataset.raw_samples)
    if not isinstance(value, int) or not -count <= value < count:
        raise Refusal(422, f"{what} must be the index of one of its {count} examples.")


def _check_file_references(value: Any, *, uploaded_only: bool = False) -> None:
    """Every file reference in `value`, at any depth, as Gradio finds them
    (processing_utils.async_move_files_to_cache): a FileData it can read, not a URL, and with
    `uploaded_only` a file in Gradio's upload folder (processing_utils._check_allowed)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if isinstance(item.get("path"), str) and "meta" in item and not isinstance(item["meta"], dict):
                # Gradio's own test (is_file_obj_with_meta) calls meta.get(): an AttributeError.
                raise Refusal(422, 'A file reference\'s "meta" must be {"_type": "gradio.FileData"}.')
            if is_file_obj_with_meta(item):
                if is_http_url_like(item["path"]):
                    raise Refusal(400, NOT_AN_UPLOAD)
                _check_path(item["path"])
                if uploaded_only:
                    _check_uploaded(item["path"])
                try:
                    FileData.model_validate(item)
                except ValidationError as exc:
                    raise Refusal(422, f"A file reference is not valid: {exc.errors()[0]['msg']}.") from None
            else:
                stack.extend(item.values())


def _check_uploaded(path: str) -> None:
    """A file Gradio received through its upload route, as its preprocessing requires."""
    allowed, _reason = gradio_utils.is_allowed_file(
        Path(gradio_utils.abspath(path)), blocked_paths=[], allowed_paths=[],
        created_paths=[gradio_utils.get_upload_folder()],
    )  # fmt: skip
    if not allowed:
        raise Refusal(400, "Files must be uploaded first; a request cannot name a file on the server.")


def _check_path(path: Any) -> None:
    """A path the file system can be asked about: Gradio asks whether a file's path exists
    (utils.is_static_file) and resolves it to see where it lies (processing_utils.
    _check_allowed); a NUL, a lone surrogate, a name too long or a symlink loop fails that
    with a 500."""
    if not isinstance(path, str):
        return
    try:
        Path(path).exists()
        Path(path).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # UnicodeEncodeError is a ValueError
        raise Refusal(422, f"The file path cannot be looked up ({type(exc).__name__}).") from None


def _multipart(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.lower().startswith(b"multipart/")
    return False


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # not JSON (invalid UTF-8 too), or nested too deep
        return None
