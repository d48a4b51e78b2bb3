"""The Open Inference Protocol v2 REST routes (KServe, Triton, MLServer clients), on the app's port.

Model names are the engine's task names. Each infer request carries one BYTES input named
`input` (text: a UTF-8 string; image: the file's bytes); every element goes through
`engine.classify(task, raw, route="rest")`, so the cache, limits, request log and metrics
are the Gradio path's. The routes only translate between the wire and the engine.

Response `parameters` (OIP parameter values are strings, numbers or booleans):
`cache_info` is a JSON-encoded list with one cache_info object per element, and for a
single element its fields (tier, key, model, model_version, generation, latency_ms,
device, age_s) are also given flat.

Statuses: 400 malformed request or bad input (`{"error": "<the engine's message>"}`),
404 unknown model or version, 413 body over the limit, 415 unknown Content-Encoding,
429 a miss past the client's miss budget (with `Retry-After`; engine.capacity.fairness: hits are
never refused), 503 the model failed (with `Retry-After` when a remote model's server is
unavailable). Readiness before the models load is the app's gate, not this router's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from functools import partial
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.routing import Match

from api.body import Receive, read_body
from api.docs import INFER_DOCS, INFER_RESPONSES, INPUT_NAME
from api.errors import RequestRefused, quote
from api.repeats import REPEAT_BODY_BYTES, Repeats
from api.tensors import (
    MAX_JSON_VALUES,
    OUTPUT_NAMES,
    EncodedOutputs,
    InferRequest,
    OutputTensor,
    RequestedOutput,
    dumps,
    encode_infer_response,
    encode_outputs,
    json_separators,
    parse_infer_request,
)
from engine.errors import InvalidInputError, ModelError, OverBudgetError, RemoteUnavailableError
from engine.models.base import Classifier
from engine.pipeline.service import ClassifyResult, InferenceEngine

log = logging.getLogger(__name__)

SERVER_NAME = "inference-cache"
SERVER_VERSION = "0.1.0"  # pyproject.toml's version
EXTENSIONS = ("binary_tensor_data",)
ROUTE = "rest"  # the request log's and the metrics' name for this front door
MAX_BATCH = 64  # elements per request
# Elements of one batch classified at once: enough to fill a text micro-batch
# (BATCH_MAX_SIZE, 8 by default) without taking the whole shared thread pool.
BATCH_CONCURRENCY = 8
# Bodies up to this size are parsed on the event loop (microseconds); larger ones in a thread.
INLINE_PARSE_BYTES = 64 * 1024
# A body in the binary tensor extension whose JSON header is that small is taken on the event
# loop up to this size, unless it asks for base64: splitting its bytes is a copy and hashing an
# element ~0.25 ns a byte (BLAKE3), ~0.15 ms at this size, what a JSON body of the size above
# costs to parse. A 240 KB photo's cached hit then skips two thread hand-offs (about a third of
# its server CPU, bench.triton_peer's `image, binary` row).
INLINE_BINARY_BYTES = 512 * 1024
# A plain JSON body up to that size is taken on the event loop too when it holds few values (an
# image's one base64 string): 0.07 ms to parse at 190 KB, 0.3 ms at 320 KB (base64 by SIMD).
# Counting its separators first bounds what orjson may meet there (240 KB of small values cost
# it up to 4 ms).
INLINE_JSON_VALUES = 1024
assert INLINE_JSON_VALUES <= MAX_JSON_VALUES  # an inline body's count also passes the parser's bound
# A 429 is held this long (or until Retry-After, if sooner) before it is sent: on the event
# loop it costs nothing, and a client that ignores Retry-After from a few connections is
# slowed to a few requests a second instead of taking the loop from everyone's hits.
REFUSAL_HOLD_S = 0.5
IMAGE_AS_BYTES = (
    'Send the image file\'s bytes: base64 in JSON with "parameters": {"content_type": "base64"}, '
    "or as binary data."
)


def build_oip_router(
    engine: InferenceEngine, *, max_body_bytes: int, max_batch: int = MAX_BATCH,
    repeats: Repeats | None = None,
) -> APIRouter:  # fmt: skip
    """The /v2 routes over `engine`. `max_body_bytes`: see `api.body.oip_body_limit`; `repeats`:
    the door's memory of repeated requests, shared with its DirectInfer (None: its own)."""
    router = APIRouter(prefix="/v2", tags=["Open Inference Protocol v2"])

    # The infer routes first: the router tries its routes in order, twice per request.
    serve_infer = partial(_serve_infer, engine, repeats or Repeats(), max_body_bytes=max_body_bytes,
                          max_batch=max_batch)  # fmt: skip

    async def model_infer(model: str, request: Request) -> Response:
        """Classify a batch of one or more inputs through the cache."""
        return await _infer_response(serve_infer, request)

    async def model_version_infer(model: str, version: str, request: Request) -> Response:
        """As /infer, refused with 404 unless `version` is the served model_version."""
        return await _infer_response(serve_infer, request)

    for path, endpoint in (("/models/{model}/infer", model_infer),
                           ("/models/{model}/versions/{version}/infer", model_version_infer)):  # fmt: skip
        setattr(endpoint, _ASGI_HANDLER, serve_infer)  # before the route, which reads it
        router.add_api_route(
            path, endpoint, methods=["POST"], openapi_extra=INFER_DOCS, responses=INFER_RESPONSES,
            route_class_override=_InferRoute,
        )  # fmt: skip

    @router.get("")
    def server_metadata() -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": list(EXTENSIONS)}

    @router.get("/health/live")
    def server_live() -> dict[str, bool]:
        return {"live": True}

    @router.get("/health/ready")
    def server_ready() -> dict[str, bool]:
        # The app answers /v2 only once the models are loaded (its readiness gate).
        return {"ready": True}

    @router.get("/models/{model}", responses={404: INFER_RESPONSES[404]})
    def model_metadata(model: str, request: Request) -> Response:
        return _answer(request, lambda: _metadata(model, _model(engine, model)))

    @router.get("/models/{model}/versions/{version}", responses={404: INFER_RESPONSES[404]})
    def model_version_metadata(model: str, version: str, request: Request) -> Response:
        return _answer(request, lambda: _metadata(model, _model(engine, model, version)))

    @router.get("/models/{model}/ready", responses={404: INFER_RESPONSES[404]})
    def model_ready(model: str, request: Request) -> Response:
        return _answer(request, lambda: _readiness(model, _model(engine, model)))

    @router.get("/models/{model}/versions/{version}/ready", responses={404: INFER_RESPONSES[404]})
    def model_version_ready(model: str, version: str, request: Request) -> Response:
        return _answer(request, lambda: _readiness(model, _model(engine, model, version)))

    return router


# ---- the infer routes' fast path ----------------------------------------------


class DirectInfer:
    """The infer routes as one plain ASGI app that a server may call before any routing or
    middleware (`ui.startup.ServingApp` does): a cached hit then costs the HTTP parse, the
    engine's memory lookup and the encoding, nothing else. The same handler answers through
    the FastAPI routes, which stay for the OpenAPI page and any other server."""

    PREFIX = "/v2/models/"
    SUFFIX = "/infer"

    def __init__(
        self, engine: InferenceEngine, *, max_body_bytes: int, max_batch: int = MAX_BATCH,
        repeats: Repeats | None = None,
    ) -> None:  # fmt: skip
        self._repeats = repeats or Repeats()
        self._serve = partial(_serve_infer, engine, self._repeats, max_body_bytes=max_body_bytes,
                              max_batch=max_batch)  # fmt: skip
        self._engine, self._max_batch = engine, max_batch

    def path_params(self, scope: Scope) -> dict[str, str] | None:
        """The route's path parameters when `scope` is an infer request, else None."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path: str = scope["path"]
        if not (path.startswith(self.PREFIX) and path.endswith(self.SUFFIX)):
            return None
        parts = path[len(self.PREFIX) : -len(self.SUFFIX)].split("/")
        if len(parts) == 1 and parts[0]:
            return {"model": parts[0]}
        if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
            return {"model": parts[0], "version": parts[2]}
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._serve(scope, receive, tracked)
        except Exception:  # what Starlette's ServerErrorMiddleware does on the routed path
            log.exception("infer failed: %s %s", scope["method"], scope["path"][:200])
            if not started:
                await _send(send, *_answer_of(500, _error_body("Internal server error."), _JSON))

    def answer_now(self, scope: Scope, body: bytes) -> Answer | None:
        """The answer to a complete infer request (`scope` with its path parameters, `body`
        as received), when it is one small element whose answer this replica's memory holds:
        what the handler would send, made at once, without a task or the ASGI messages (the
        server's protocol calls it, ui.limits). The hit is logged and counted as the handler's
        is. None, with nothing counted: anything else (a miss, a refusal, a batch, a large or
        compressed body), for the handler to answer."""
        return _answer_now(self._engine, self._repeats, scope, body, self._max_batch)


Scope = MutableMapping[str, Any]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]  # status, headers, body
_JSON = b"application/json"
ASGIHandler = Callable[[Scope, Receive, Send], Awaitable[None]]
_ASGI_HANDLER = "oip_asgi_handler"  # the endpoint's attribute naming its plain ASGI handler
_WANTED_HEADERS = (b"content-length", b"content-encoding", b"inference-header-content-length")


class _InferRoute(APIRoute):
    """An infer route: FastAPI matches and documents it (OpenAPI from the endpoint), but a
    POST goes straight to the endpoint's plain ASGI handler, without FastAPI's request,
    dependency and response machinery (most of a cached hit's cost). The endpoint itself
    answers the same through that handler, should a FastAPI version bypass `handle`."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self._asgi_handler: ASGIHandler | None = getattr(endpoint, _ASGI_HANDLER, None)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child_scope = super().matches(scope)
        # Another method on an infer path is this route's 405, not a partial match that the
        # app's catch-all Gradio mount (a full match for every path) would answer with 404.
        return (Match.FULL if match is Match.PARTIAL else match), child_scope

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._asgi_handler
        if scope["method"] != "POST":
            message = f"Method {scope['method']} is not allowed here; inference requests are POST."
            log.warning("refused %s %s: 405 %s", scope["method"], scope["path"][:200], message)
            await _send(send, *_answer_of(405, _error_body(message), _JSON, (b"allow", b"POST")))
            return
        if handler is None:
            await super().handle(scope, receive, send)
            return
        await handler(scope, receive, send)


async def _infer_response(serve_infer: ASGIHandler, request: Request) -> Response:
    """The handler's answer as a FastAPI response (the fallback path)."""
    sent: dict[str, Any] = {}

    async def capture(message: MutableMapping[str, Any]) -> None:
        sent.update(message)

    await serve_infer(request.scope, request.receive, capture)
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in sent["headers"]
               if k != b"content-length"}  # fmt: skip
    return Response(sent["body"], status_code=sent["status"], headers=headers)


async def _serve_infer(
    engine: InferenceEngine,
    repeats: Repeats,
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    max_body_bytes: int,
    max_batch: int,
) -> None:
    """POST /v2/models/{model}[/versions/{version}]/infer as a plain ASGI handler."""
    params = scope["path_params"]
    headers = _wanted_headers(scope)
    client = repeats.client((scope.get("client") or ("",))[0])  # as engine.capacity.forwarding left it
    try:
        content, header_length = await _infer(
            engine, repeats, params["model"], params.get("version"), headers, receive, max_body_bytes,
            max_batch, client,
        )  # fmt: skip
    except (RequestRefused, InvalidInputError, ModelError, OverBudgetError) as exc:
        status, message = _status(exc)
        extra = []
        if isinstance(exc, OverBudgetError):
            extra.append((b"retry-after", str(exc.wait_s).encode()))
            await anyio.sleep(min(REFUSAL_HOLD_S, exc.retry_after_s))
        elif isinstance(exc, RemoteUnavailableError):  # a remote model's server is down or refused
            extra.append((b"retry-after", str(exc.wait_s).encode()))
        # A refused miss is logged by the engine's request log and metrics, not once per request here.
        if status != 429:
            log.warning("refused %s %s: %d %s", scope["method"], scope["path"][:200], status, message)
        await _send(send, *_answer_of(status, _error_body(message), _JSON, *extra))
        return
    await _send(send, *_answered(content, header_length))


def _wanted_headers(scope: Scope) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in scope["headers"]:
        if name in _WANTED_HEADERS and name not in headers:  # the first, as Starlette's Headers
            headers[name.decode("latin-1")] = value.decode("latin-1")
    return headers


def _answered(content: bytes, header_length: int | None) -> Answer:
    if header_length is None:
        return _answer_of(200, content, _JSON)
    return _answer_of(200, content, b"application/octet-stream",
                      (b"inference-header-content-length", str(header_length).encode()))  # fmt: skip


def _answer_of(status: int, body: bytes, content_type: bytes, *extra: tuple[bytes, bytes]) -> Answer:
    headers = [(b"content-length", str(len(body)).encode()), (b"content-type", content_type), *extra]
    return status, headers, body


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _answer_now(
    engine: InferenceEngine, repeats: Repeats, scope: Scope, body: bytes, max_batch: int
) -> Answer | None:
    """DirectInfer.answer_now: `_infer` for one small element held in memory, or None before
    anything is counted."""
    if len(body) > REPEAT_BODY_BYTES:
        return None
    headers = _wanted_headers(scope)
    if headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
        return None
    params = scope["path_params"]
    task, version = params["model"], params.get("version")
    model = engine.models.get(task)
    if model is None or (version is not None and version != model.version):
        return None
    header_length = headers.get("inference-header-content-length")
    parse = partial(parse_infer_request, body, header_length, input_name=INPUT_NAME, max_elements=max_batch)
    try:
        parsed = repeats.parsed.get_or_make((body, header_length, max_batch), parse)
        if len(parsed.elements) != 1:
            return None
        raw = _engine_input(parsed.elements[0], text=_takes_text(model))
    except RequestRefused:
        return None
    client = repeats.client((scope.get("client") or ("",))[0])
    # The server's protocol writes the answer as soon as this returns (ui.limits): the hit's
    # bookkeeping runs on the event loop right after, while the client reads it.
    result = engine.classify_from_memory(task, raw, route=ROUTE, client=client, defer=_after_answer())
    if result is None:
        return None
    if version is not None and result.model_version != version:  # counted: refused here, as _infer does
        message = f"Model {task!r} was replaced during the request; version {version!r} is no longer served."
        log.warning("refused %s %s: %d %s", scope["method"], scope["path"][:200], 404, message)
        return _answer_of(404, _error_body(message), _JSON)
    return _answered(*encode_infer_response(_response_header(task, parsed, [result]),
                                            _encoded_outputs(repeats, parsed, [result])))  # fmt: skip


def _after_answer() -> Callable[..., object] | None:
    """The running event loop's `call_soon`; None outside one (the work is then done at once)."""
    try:
        return asyncio.get_running_loop().call_soon
    except RuntimeError:
        return None


def _error_body(message: str) -> bytes:
    # As JSONResponse renders {"error": message}.
    return json.dumps({"error": message}, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


# ---- metadata ---------------------------------------------------------------


def _model(engine: InferenceEngine, task: str, version: str | None = None) -> Classifier:
    model = engine.models.get(task)
    if model is None:
        raise RequestRefused(404, f"Unknown model {quote(task)}. Models: {', '.join(sorted(engine.models))}.")
    if version is not None and version != model.version:
        # A pinned version is a promise about which weights answer: never another's.
        raise RequestRefused(404, f"Model {task!r} has no version {quote(version)}; it serves "
                                  f"{model.version!r}.")  # fmt: skip
    return model


def _takes_text(model: Classifier) -> bool:
    # Config-defined models (issue 17) name their kind ("text-classification" /
    # "image-classification"); the built-ins are known by their task.
    kind = getattr(model, "kind", None)
    if isinstance(kind, str):
        return not kind.startswith("image")
    return model.task != "image"


def _readiness(task: str, model: Classifier) -> dict[str, Any]:
    # A model the engine holds is loaded: the app is assembled only once every model is.
    return {"name": task, "ready": True}


def _metadata(task: str, model: Classifier) -> dict[str, Any]:
    text = _takes_text(model)
    return {
        "name": task,
        "versions": [model.version],
        "platform": "pytorch",
        "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [
            {"name": "label", "datatype": "BYTES", "shape": [-1, -1]},
            {"name": "score", "datatype": "FP32", "shape": [-1, -1]},
        ],
        "parameters": {
            "model": model.name,
            "device": model.device,
            "input": "UTF-8 text" if text else "an image file's bytes (base64 in JSON)",
        },
    }


# ---- inference --------------------------------------------------------------


async def _infer(
    engine: InferenceEngine,
    repeats: Repeats,
    task: str,
    version: str | None,
    headers: Mapping[str, str],
    receive: Receive,
    max_body_bytes: int,
    max_batch: int,
    client: str | None = None,
) -> tuple[bytes, int | None]:
    """(body, JSON header length or None for plain JSON), or an exception to refuse with."""
    model = _model(engine, task, version)  # before the body: an unknown model costs no read
    body = await read_body(headers, receive, limit=max_body_bytes)
    header_length = headers.get("inference-header-content-length")
    inline = _inline(body, header_length)
    # Inline, a large JSON's separators were counted (at most INLINE_JSON_VALUES): not again.
    parse = partial(parse_infer_request, body, header_length, input_name=INPUT_NAME, max_elements=max_batch,
                    values_bounded=inline)  # fmt: skip
    if len(body) <= REPEAT_BODY_BYTES:
        parsed = repeats.parsed.get_or_make((body, header_length, max_batch), parse)
    else:
        parsed = parse() if inline else await anyio.to_thread.run_sync(parse)
    text = _takes_text(model)
    raws = [_engine_input(element, text=text) for element in parsed.elements]
    results = await _classify_all(engine, task, raws, from_memory=inline, client=client)
    if version is not None and any(r.model_version != version for r in results):
        raise RequestRefused(404, f"Model {task!r} was replaced during the request; version {version!r} "
                                  "is no longer served.")  # fmt: skip
    return encode_infer_response(_response_header(task, parsed, results),
                                 _encoded_outputs(repeats, parsed, results))  # fmt: skip


def _encoded_outputs(repeats: Repeats, parsed: InferRequest, results: list[ClassifyResult]) -> EncodedOutputs:
    if len(results) != 1:
        return encode_outputs(_outputs(parsed, results))
    result = results[0]
    spec = (result.key, parsed.outputs, parsed.binary_output)
    kept = repeats.encoded.get(spec)
    # The answer under a key is the same unless the entry was evicted and computed again.
    if kept is not None and (kept[0] is result.prediction or kept[0] == result.prediction):
        return kept[1]  # type: ignore[no-any-return]
    encoded = encode_outputs(_outputs(parsed, results))
    repeats.encoded.put(spec, (result.prediction, encoded))
    return encoded


def _inline(body: bytes, header_length: str | None) -> bool:
    """Whether parsing `body` and hashing its elements is cheap enough for the event loop."""
    if len(body) <= INLINE_PARSE_BYTES:
        return True
    if len(body) > INLINE_BINARY_BYTES:
        return False
    if header_length is None:
        return json_separators(body) <= INLINE_JSON_VALUES
    if not (header_length.isascii() and header_length.isdigit() and len(header_length) <= 7):
        return False  # the parser says what is wrong with it
    json_length = int(header_length)
    # base64 anywhere in the JSON header (a content_type, or only an id): decoding is not cheap.
    return json_length <= INLINE_PARSE_BYTES and body.find(b"base64", 0, json_length) < 0


def _engine_input(element: bytes | str, *, text: bool) -> bytes | str:
    """What the engine takes: a str for a text model, the file's bytes for an image model."""
    if not text:
        if isinstance(element, str):
            raise RequestRefused(400, IMAGE_AS_BYTES)
        return element
    if isinstance(element, str):
        return element
    try:
        return element.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestRefused(400, "The message is not valid UTF-8 text.") from None


async def _classify_all(
    engine: InferenceEngine,
    task: str,
    raws: list[bytes | str],
    *,
    from_memory: bool,
    client: str | None = None,
) -> list[ClassifyResult]:
    """Every element through the cache. With `from_memory` (small inputs: hashing them costs
    microseconds) answers held in this replica's memory are taken on the event loop; the
    rest go to threads (the engine blocks on Redis and the model), up to BATCH_CONCURRENCY
    at once so that concurrent text misses share a forward pass."""
    results: list[ClassifyResult | None] = [None] * len(raws)
    if from_memory:
        for index, raw in enumerate(raws):
            results[index] = engine.classify_from_memory(task, raw, route=ROUTE, client=client)
    missing = [index for index, result in enumerate(results) if result is None]
    if not missing:
        return [r for r in results if r is not None]
    classify = partial(engine.classify, task, route=ROUTE, client=client)
    if len(raws) == 1:
        return [await anyio.to_thread.run_sync(classify, raws[0])]
    errors: list[InvalidInputError | ModelError | OverBudgetError | None] = [None] * len(raws)
    slots = anyio.Semaphore(BATCH_CONCURRENCY)

    async def one(index: int) -> None:
        async with slots:
            try:
                results[index] = await anyio.to_thread.run_sync(classify, raws[index])
            except (InvalidInputError, ModelError, OverBudgetError) as exc:
                errors[index] = exc

    async with anyio.create_task_group() as group:
        for index in missing:
            group.start_soon(one, index)
    # OIP has no per-element errors: the batch fails as a whole. Bad input outranks a spent
    # budget, which outranks a model failure (retrying the same batch would not help for the
    # first, would after Retry-After for the second); then the lowest index.
    rank = {InvalidInputError: 0, OverBudgetError: 1, ModelError: 2}
    failed = sorted((rank.get(type(e), 2), i, e) for i, e in enumerate(errors) if e is not None)
    if failed:
        _, index, error = failed[0]
        if isinstance(error, OverBudgetError | RemoteUnavailableError):
            raise error  # its Retry-After goes with it
        status, message = _status(error)
        raise RequestRefused(status, f"Element {index}: {message}")
    return [r for r in results if r is not None]


def _response_header(task: str, parsed: InferRequest, results: list[ClassifyResult]) -> dict[str, Any]:
    infos = [r.cache_info() for r in results]
    parameters: dict[str, Any] = {"cache_info": dumps(infos).decode()}
    if len(infos) == 1:
        parameters.update(infos[0])
    header: dict[str, Any] = {"model_name": task, "model_version": results[0].model_version}
    if parsed.request_id is not None:
        header["id"] = parsed.request_id
    header["parameters"] = parameters
    return header


def _outputs(parsed: InferRequest, results: list[ClassifyResult]) -> list[tuple[OutputTensor, bool]]:
    # Every element of one model has the same number of classes; min() keeps the tensor
    # rectangular should a live model swap change it mid-batch.
    k = min(len(r.prediction.labels) for r in results)
    shape = (len(results), k)
    top = [pair for r in results for pair in r.prediction.labels[:k]]
    tensors = {
        "label": OutputTensor("label", "BYTES", shape, [name for name, _ in top]),
        "score": OutputTensor("score", "FP32", shape, [score for _, score in top]),
    }
    wanted = parsed.outputs or tuple(RequestedOutput(name, None) for name in OUTPUT_NAMES)
    return [(tensors[o.name], parsed.wants_binary(o)) for o in wanted]


# ---- errors -----------------------------------------------------------------


def _answer(request: Request, build: Callable[[], dict[str, Any]]) -> Response:
    try:
        return JSONResponse(build())
    except RequestRefused as exc:
        return _refusal(request, exc)


def _status(exc: RequestRefused | InvalidInputError | ModelError | OverBudgetError) -> tuple[int, str]:
    """The one place an error becomes an HTTP status and a message for the caller."""
    if isinstance(exc, RequestRefused):
        return exc.status, exc.message
    if isinstance(exc, OverBudgetError):
        return 429, exc.message
    if isinstance(exc, InvalidInputError):
        return (404 if exc.code == "unknown_task" else 400), exc.message  # 404: a task removed since
    return 503, str(exc)


def _refusal(request: Request, exc: RequestRefused | InvalidInputError | ModelError) -> JSONResponse:
    status, message = _status(exc)
    log.warning("refused %s %s: %d %s", request.method, request.url.path[:200], status, message)
    return JSONResponse({"error": message}, status_code=status)
