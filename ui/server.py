"""The HTTP app: health endpoints plus the Gradio UI mounted at /, served by uvicorn."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import gradio as gr
import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from gradio.exceptions import ComponentProcessingError, InvalidPathError
from gradio.route_utils import FnIndexInferError
from starlette.middleware import Middleware
from starlette.routing import Mount

from admin.console.api import build_router
from admin.console.tab import CARD_CSS, build_admin_tab
from admin.insights.api import build_insights_router
from api import DirectInfer, Repeats, build_oip_router, oip_body_limit
from engine.models.base import takes_image
from settings import FORWARDED_ALLOW_IPS, Settings
from storage.redis.embedded import REDIS_SUBDIR
from ui.api_page import ApiSnippets
from ui.app_ui import PHONE_CSS, build_demo, example_photos, read_upload
from ui.cached_calls import CachedApi, CachedCalls
from ui.call_protocol import RefusalLog
from ui.docs_pages import add_docs_pages
from ui.gradio_guard import GradioGuard, RefusedCalls
from ui.lean_sessions import SweepTimer, install_lean_sessions
from ui.limits import HeaderLimits, limited_http_protocol
from ui.queue_shares import QueueShares
from ui.queue_wake import WokenQueue
from ui.startup import Runtime, ServingApp

log = logging.getLogger(__name__)

QUEUE_MAX_SIZE = 256
DEFAULT_HEADERS = HeaderLimits()  # the settings' defaults, for servers built without settings
GRACEFUL_SHUTDOWN_S = 5
ON_LOOP_UPLOAD_BYTES = 1024 * 1024  # a cached call's upload up to this size is read on the event loop


def build_app(runtime: Runtime) -> FastAPI:
    settings = runtime.settings
    engine = runtime.engine
    app = FastAPI(title="Inference cache", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    add_docs_pages(app)  # /docs and /redoc, their scripts served by the app (no CDN)
    app.include_router(
        build_router(engine=engine, admin=runtime.admin, auth=runtime.auth, metrics=runtime.metrics)
    )
    if runtime.insights is not None:  # sizing, worth, health, CSV downloads (admin.insights.api)
        app.include_router(build_insights_router(insights=runtime.insights, auth=runtime.auth))
    oip_limit = oip_body_limit(settings.limits.max_upload_bytes)
    repeats = Repeats()  # the REST door's memory of repeated requests: one for both paths to it
    app.include_router(build_oip_router(engine, max_body_bytes=oip_limit, repeats=repeats))
    # REST infer calls skip FastAPI's routing and middleware when served by ServingApp.
    app.state.direct_routes = (DirectInfer(engine, max_body_bytes=oip_limit, repeats=repeats),)
    demo = build_demo(
        engine,
        max_upload_bytes=settings.limits.max_upload_bytes,
        admin_tab=lambda: build_admin_tab(
            runtime.admin, runtime.auth, clients=runtime.client_activity, insights=runtime.insights
        ),
    )
    # Classify events set their own limits (see ui.app_ui._miss_lane); the console's run one at a time.
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=1)
    gr.mount_gradio_app(  # mounts onto `app` and returns it
        app,
        demo,
        path="",
        # The browser refuses a larger file before uploading it, with Gradio's message; an API
        # client gets 413 from ui.limits (the upload route's body limit).
        max_file_size=settings.limits.max_upload_bytes,
        ssr_mode=False,
        footer_links=["api"],
        css=CARD_CSS + PHONE_CSS,
        # The example photos are the only files outside Gradio's own folders the app hands out;
        # the request log and the embedded Redis are never to be served or read as an upload.
        allowed_paths=[str(p) for p in example_photos()],
        blocked_paths=_private_data_paths(settings),
    )
    # Gradio enforces "an input file must have been uploaded" (processing_utils._check_allowed)
    # only once Blocks.has_launched is set, which launch() does and mount_gradio_app does not
    # (Gradio 6.31). Without it, a request naming {"path": "/any/file"} makes the server read
    # that file as the upload. Gradio's reload mode sets the flag the same way (swap_blocks).
    demo.has_launched = True
    # With the check on, a refused path raises out of Gradio's queue probe (which runs
    # preprocessing before queueing) as HTTP 500; it is the client's mistake, so answer 400.
    gradio_app = next(r.app for r in app.routes if isinstance(r, Mount) and r.path == "")
    gradio_app.add_exception_handler(InvalidPathError, _refuse_path)
    # The same refusal from UploadedImage.preprocess (a reference without Gradio's FileData
    # marker), which Gradio wraps in ComponentProcessingError.
    gradio_app.add_exception_handler(ComponentProcessingError, _refuse_wrapped_path)
    gradio_app.add_exception_handler(FnIndexInferError, _unknown_api)  # Gradio: a 500
    invalid_body = partial(_invalid_body, RefusalLog(log))  # FastAPI: a 500 for a body not UTF-8
    gradio_app.add_exception_handler(RequestValidationError, invalid_body)
    # The other requests Gradio would fail with a 500 are refused before its routes. Last in
    # the list: inside Gradio's CORS middleware, so refusals carry the CORS headers its own do.
    refused_calls = RefusedCalls()  # a /call's refused input: its GET's error event (ui.cached_calls)
    guard = Middleware(GradioGuard, blocks=demo, max_body_bytes=settings.limits.max_gradio_body_bytes,
                       refused_calls=refused_calls)  # fmt: skip
    gradio_app.user_middleware.append(guard)
    gradio_app.user_middleware.append(Middleware(ApiSnippets))  # the API page's bash snippets run as printed
    holder = install_lean_sessions(gradio_app, demo)
    sweeps = SweepTimer(holder)  # abandoned calls expire with no new call to sweep them
    app.router.add_event_handler("startup", sweeps.start)
    app.router.add_event_handler("shutdown", sweeps.stop)
    QueueShares(demo._queue, holder).install()  # one address cannot fill the queue for the others
    WokenQueue(demo._queue).install()  # Gradio's queue loop woken by work, not polling every 1 ms
    # Cached answers of the two-step HTTP API skip Gradio's routing and queue (see ui.cached_calls):
    # a middleware of the Gradio app just inside its CORS middleware, in front of the guard.
    apis = _cached_call_apis(demo, engine, settings.limits.max_upload_bytes)
    shortcut = CachedCalls(gradio_app, engine, apis, refused=refused_calls)
    shortcut.install()
    app.state.cached_calls = shortcut
    return app


def _cached_call_apis(demo: gr.Blocks, engine: Any, max_upload_bytes: int) -> dict[str, CachedApi]:
    """The classify APIs, each with how its one input becomes the engine's raw input."""

    def text(item: Any) -> str:
        if not isinstance(item, str):
            raise TypeError("not a message")
        return item

    def uploaded(item: Any) -> Path:
        path = item.get("path") if isinstance(item, dict) else None
        if not isinstance(path, str) or path not in demo.upload_file_set:
            raise PermissionError("not a file this app received through its upload route")
        return Path(path)

    def upload(item: Any) -> bytes:
        return read_upload(uploaded(item), max_upload_bytes)

    def small_upload(item: Any) -> bytes:
        # A photo of a few hundred KB is read (and hashed) in tens of microseconds, less than
        # a thread's round trip; a larger file is read in the probe's thread.
        path = uploaded(item)
        if path.stat().st_size > ON_LOOP_UPLOAD_BYTES:
            raise ValueError("read in a thread")
        return read_upload(path, max_upload_bytes)

    apis = {}
    for fn in demo.fns.values():
        task = (fn.api_name or "").removeprefix("classify_")
        model = engine.models.get(task)
        if (
            model is not None
            and fn.api_name == f"classify_{task}"
            and len(fn.inputs) == 1
            and len(fn.outputs) == 2
        ):
            image = takes_image(model)
            apis[fn.api_name] = CachedApi(task, fn.inputs[0], list(fn.outputs), upload if image else text,
                                          raw_input_now=small_upload if image else text,
                                          event=fn)  # fmt: skip
    return apis


def _private_data_paths(settings: Settings) -> list[str]:
    # Not DATA_DIR as a whole: an operator may put Gradio's upload folder (GRADIO_TEMP_DIR)
    # under it, and a blocked path wins over the upload folder.
    sqlite = settings.sqlite_path.resolve()
    redis = settings.server.data_dir / REDIS_SUBDIR
    return [str(sqlite), f"{sqlite}-wal", f"{sqlite}-shm", str(redis.resolve())]


async def _refuse_path(request: Request, error: Exception) -> JSONResponse:
    log.warning("refused a request naming a file that was not uploaded: %s", error)
    return JSONResponse(
        {"detail": "Files must be uploaded first; a request cannot name a file on the server."},
        status_code=400,
    )


async def _unknown_api(request: Request, error: Exception) -> JSONResponse:
    log.warning("refused %s %s: 404 no such API", request.method, request.url.path[:200])
    return JSONResponse({"detail": "No API of that name; the list is at /gradio_api/info."}, status_code=404)


async def _invalid_body(refusals: RefusalLog, request: Request, error: Exception) -> Response:
    """FastAPI's own 422, but safe for any input it quotes: FastAPI answers 500 for a body
    that is not UTF-8 (its encoder decodes the bytes) or that holds a lone surrogate (its
    response encodes to UTF-8). Quotes are cut short and the JSON is ASCII."""
    errors = error.errors() if isinstance(error, RequestValidationError) else []
    cut = {bytes: lambda b: b[:200].decode("utf-8", "replace"), str: lambda s: s[:200]}
    body = json.dumps({"detail": jsonable_encoder(errors, custom_encoder=cut)})
    kinds = ", ".join(str(e.get("type")) for e in errors[:3])
    refusals.refused(request.client.host if request.client else "unknown",
                     f"{request.method} {request.url.path[:200]}: 422 {kinds}")  # fmt: skip
    return Response(body, status_code=422, media_type="application/json")


async def _refuse_wrapped_path(request: Request, error: Exception) -> JSONResponse:
    if isinstance(error.__cause__, InvalidPathError):
        return await _refuse_path(request, error.__cause__)
    raise error  # anything else stays the server error it was


class BackgroundServer:
    """Runs the app in a thread (tests, benchmarks). `close()` stops it."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int,
        header_limits: HeaderLimits | None = DEFAULT_HEADERS,
        forwarded_allow_ips: str | None = FORWARDED_ALLOW_IPS,
    ) -> None:
        # An open event stream (a gradio_client's heartbeat) must not hold close() for its
        # whole join timeout: requests in flight get this long, then connections are dropped.
        # header_limits=None: uvicorn's own protocol, no limits (a benchmark's baseline).
        http = "httptools" if header_limits is None else limited_http_protocol(header_limits)
        # forwarded_allow_ips: whose X-Forwarded-For names the client, by uvicorn's rule; None
        # for a ServingApp, which applies the runtime's own (engine.capacity.forwarding).
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=1, http=http,
                                proxy_headers=forwarded_allow_ips is not None,
                                forwarded_allow_ips=forwarded_allow_ips)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self.app = app  # what it serves (a test may call it in-process, e.g. from another address)
        self.url = f"http://{host}:{port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_runtime(
    runtime: Runtime,
    *,
    host: str = "127.0.0.1",
    port: int,
    timeout_s: float = 60.0,
    limit_headers: bool = True,
) -> BackgroundServer:
    """A started server of `runtime` in a thread, on the path `serve` takes (the readiness
    gate and its routing, the app built from `runtime`, the settings' header limits unless
    `limit_headers` is False), ready when it returns. The caller owns `runtime` and closes
    it after the server (tests, benchmarks)."""
    serving = ServingApp(runtime.settings, build_runtime=lambda _settings: runtime, build_app=build_app,
                         close_runtime=False)  # fmt: skip
    limits = HeaderLimits.from_settings(runtime.settings) if limit_headers else None
    # Who a request is from is the runtime's to say (engine.capacity.forwarding), not uvicorn's.
    server = BackgroundServer(serving, host=host, port=port, header_limits=limits,
                              forwarded_allow_ips=None).start(timeout_s)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not serving.ready:
        if serving.failure is not None or time.monotonic() > deadline:
            server.close()
            raise RuntimeError(f"the app did not become ready: {serving.failure!r}")
        time.sleep(0.02)
    return server


def serve(
    settings: Settings,
    *,
    build_runtime: Callable[[Settings], Runtime],
    on_started: Callable[[], None] | None = None,
) -> None:
    """Listens at once, builds the runtime (with `build_runtime`, which `app.py` takes from
    the composition root) and the app behind a readiness gate, and blocks until the process
    is told to stop (SIGINT/SIGTERM handled by uvicorn). Exits non-zero when start-up fails.
    `on_started` is called once start-up is over, ready or failed (app.py: the collector)."""
    server: uvicorn.Server | None = None

    def stop(_failure: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    serving = ServingApp(settings, build_runtime=build_runtime, build_app=build_app, on_failure=stop,
                         on_started=on_started)  # fmt: skip
    # Open event streams (a browser tab, a gradio_client) must not hold a redeploy hostage.
    config = uvicorn.Config(
        # Warnings only: ui.startup logs the one "ready: serving on" line a newcomer needs.
        serving, host=settings.server.host, port=settings.server.port, log_level="warning", lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=limited_http_protocol(HeaderLimits.from_settings(settings)),
        # Who a request is from (the miss budget's identity) is ServingApp's to say, with the
        # runtime's engine.capacity.forwarding (FORWARDED_ALLOW_IPS, FORWARDED_TRUSTED_HOPS), not uvicorn's.
        proxy_headers=False,
        # A line per request costs more server CPU than a cached answer; the request log
        # (console) and /metrics record every request.
        access_log=False,
    )  # fmt: skip
    server = uvicorn.Server(config)
    server.run()
    if serving.failure is not None:
        raise SystemExit(1)
