"""What uvicorn serves: it listens at once and is honest about readiness.

While the runtime (models, stores) and the app are built in the background,
`ServingApp` answers `/healthz` and `/v2/health/live` (the process is alive),
`/readyz` and every other `/v2` or API path with 503, and the page with a loading
notice that reloads itself. Once everything is up (and Redis has answered, or
`READY_L2_WAIT_S` has passed) every request goes to the app.

It also routes: the app's direct routes (`app.state.direct_routes`: the REST infer
calls) are called before any routing or middleware, and asked (with the cached Gradio
calls, `app.state.cached_calls`) for an answer made at once by the server's protocol;
API paths go to the FastAPI app, everything else straight to the Gradio app mounted in
it, so a Gradio call does not first walk the API routes. Every request but the direct
routes' (which bound their own) passes its route's body limit first (ui.limits.BodyLimits).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, Protocol

from fastapi import FastAPI
from starlette.routing import Mount

from admin.auth import AdminAuth
from admin.console.service import AdminService
from admin.insights.service import Insights
from admin.monitoring.metrics import Metrics
from common.startup_clock import phase, process_age_s, record
from engine.capacity.forwarding import Forwarding
from engine.errors import ModelLoadError
from engine.pipeline.service import InferenceEngine
from settings import Settings, redact_url
from ui.asgi import Receive, Scope, Send, respond
from ui.limits import BodyLimits

log = logging.getLogger(__name__)


# Paths served by the FastAPI routes (admin, health, metrics, REST); the rest is Gradio's.
API_PREFIXES = ("/v2", "/admin/api", "/healthz", "/readyz", "/metrics", "/docs", "/redoc", "/openapi.json")
ALIVE_PATHS = ("/healthz", "/v2/health/live")
GRADIO_CALL_PREFIX = "/gradio_api/call/"
RETRY_AFTER_S = "2"

LOADING_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>Inference cache: starting</title>
<style>body{font-family:system-ui,sans-serif;margin:4rem auto;max-width:36rem;color:#333}</style>
</head><body><h1>Inference result cache</h1>
<p id="loading-notice">{notice}</p><p>This page reloads by itself.</p></body></html>
"""


def local_url(settings: Settings) -> str:
    """The address a person on this machine opens (a wildcard bind is reached as localhost)."""
    host = settings.server.host
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "localhost"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address in a URL
    return f"http://{host}:{settings.server.port}/"


def start_lines(settings: Settings) -> list[str]:
    """The last lines of a start: where the files are, then the URL to open."""
    database = (redact_url(settings.log.database_url) if settings.log.database_url
                else settings.sqlite_path.resolve())  # fmt: skip
    token = ("ADMIN_TOKEN" if settings.server.admin_token is not None
             else "the token printed above (set ADMIN_TOKEN to choose one)")  # fmt: skip
    return [
        f"data directory: {settings.server.data_dir.resolve()}; "
        f"ONNX exports: {settings.export_dir.resolve()}; request log: {database}",
        f"ready: open {local_url(settings)} (API: {local_url(settings)}docs; the Admin tab takes {token})",
    ]


class Runtime(Protocol):
    """What the app is built from: the composition root's `runtime.Runtime` (top floor),
    described here so that ui/ imports nothing above itself."""

    settings: Settings
    engine: InferenceEngine
    admin: AdminService
    auth: AdminAuth
    metrics: Metrics
    insights: Insights | None
    forwarding: Forwarding | None

    def wait_for_l2(self, timeout_s: float) -> bool: ...

    def close(self) -> None: ...


class DirectRoute(Protocol):
    """A plain ASGI app for the requests whose path parameters it finds (`api.DirectInfer`)."""

    def path_params(self, scope: Scope) -> dict[str, str] | None: ...

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...

    def answer_now(self, scope: Scope, body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """The whole answer to a complete request, when it can be made at once (a cached hit),
        else None with nothing done: the request then goes through `__call__`."""


AnswerNow = Callable[[Scope, bytes], "tuple[int, list[tuple[bytes, bytes]], bytes] | None"]


class ServingApp:
    """The ASGI app: a start-up gate in front of the app that `build_app(runtime)` makes."""

    def __init__(
        self,
        settings: Settings,
        *,
        build_runtime: Callable[[Settings], Runtime],
        build_app: Callable[[Runtime], FastAPI],
        on_failure: Callable[[BaseException], None] | None = None,
        on_started: Callable[[], None] | None = None,
        close_runtime: bool = True,
    ) -> None:
        self._settings = settings
        self._close_runtime = close_runtime  # False: the runtime has another owner (tests)
        self._build_runtime = build_runtime
        self._build_app = build_app
        self._on_failure = on_failure
        self._on_started = on_started  # once start-up is over, ready or failed
        self._app: FastAPI | None = None
        self._gradio: Any = None  # the mounted Gradio app, reached without the API routes
        self._direct: tuple[DirectRoute, ...] = ()
        self._gradio_now: AnswerNow | None = None  # the cached Gradio calls' answer_now
        self._forwarding: Forwarding | None = None
        self._starting: asyncio.Task[None] | None = None
        self._stack = AsyncExitStack()
        self._body_limits = BodyLimits.from_settings(settings)
        self.runtime: Runtime | None = None
        self.failure: BaseException | None = None

    @property
    def ready(self) -> bool:
        return self._app is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        app = self._app
        if app is None:
            await self._not_ready(scope, receive, send)
            return
        forwarding = self._forwarding
        if forwarding is not None:
            forwarded_client(scope, forwarding)
        for route in self._direct:
            params = route.path_params(scope)
            if params is not None:
                scope["path_params"] = params
                await route(scope, receive, send)  # it bounds its own body
                return
        gradio = self._gradio
        routed = gradio if gradio is not None and not scope["path"].startswith(API_PREFIXES) else app
        if scope["type"] == "http":
            await self._body_limits(routed, scope, receive, send)
        else:
            await routed(scope, receive, send)

    def answer_now(self, scope: Scope, body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """A complete HTTP request's whole answer (status, headers, body) when a direct route
        can make it at once (api.DirectInfer.answer_now: a small REST request for a cached
        answer), else None, with nothing counted or logged: serve it through `__call__`. The
        server's protocol calls it before it makes a task for the request (ui.limits)."""
        if self._app is None:
            return None
        forwarding = self._forwarding
        if forwarding is not None:
            scope = dict(scope)  # `__call__` applies it to the request's own scope if this declines
            forwarded_client(scope, forwarding)
        for route in self._direct:
            params = route.path_params(scope)
            if params is not None:
                scope["path_params"] = params
                return route.answer_now(scope, body)
        if self._gradio_now is not None and scope["path"].startswith(GRADIO_CALL_PREFIX):
            if len(body) > self._body_limits.gradio:
                return None  # the route's 413 (BodyLimits)
            return self._gradio_now(scope, body)  # a cached Gradio call (ui.cached_calls)
        return None

    # ---- start and stop -------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                record("listening (/healthz answers)", process_age_s())
                self._starting = asyncio.create_task(self._start())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        try:
            with phase("runtime (models, stores, SQL)"):
                runtime = await asyncio.to_thread(self._build_runtime, self._settings)
            self.runtime = runtime
            if self._close_runtime:
                self._stack.push_async_callback(asyncio.to_thread, runtime.close)
            with phase("app (FastAPI routes, Gradio Blocks)"):
                app = await asyncio.to_thread(self._build_app, runtime)
            # The app's lifespan starts Gradio's queue; uvicorn ran ours long before.
            with phase("app lifespan (Gradio's queue) and Redis's first answer"):
                await self._stack.enter_async_context(app.router.lifespan_context(app))
                await asyncio.to_thread(runtime.wait_for_l2, self._settings.server.ready_l2_wait_s)
            self._gradio = next((r.app for r in app.routes if isinstance(r, Mount) and r.path == ""), None)
            self._direct = tuple(getattr(app.state, "direct_routes", ()))
            self._gradio_now = getattr(getattr(app.state, "cached_calls", None), "answer_now", None)
            self._forwarding = getattr(runtime, "forwarding", None)  # a stand-in runtime may have none
            self._app = app
            record("ready", process_age_s())
            for line in start_lines(self._settings):
                log.info("%s", line)
        except ModelLoadError as exc:  # a model that cannot load: the message names it (engine.models)
            log.error("start-up failed: %s", exc)
            self.failure = exc
            if self._on_failure is not None:
                self._on_failure(exc)
        except Exception as exc:
            log.exception("start-up failed")
            self.failure = exc
            if self._on_failure is not None:
                self._on_failure(exc)
        finally:
            if self._on_started is not None:
                self._on_started()

    async def _stop(self) -> None:
        if self._starting is not None and not self._starting.done():
            await asyncio.shield(self._starting)  # a half-built runtime is closed, not abandoned
        self._app = self._gradio = self._gradio_now = None
        self._direct = ()
        await self._stack.aclose()

    # ---- while not ready --------------------------------------------------------

    async def _not_ready(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1013})  # try again later
            return
        path = scope["path"]
        failed = self.failure is not None
        notice = (
            "Start-up failed; the server log says why."
            if failed
            else "Loading the models and connecting the cache…"
        )
        if path in ALIVE_PATHS:
            await _respond(send, 200, {"status": "ok"})
        elif path == "/readyz":
            await _respond(send, 503, {"status": "failed" if failed else "starting", "detail": notice})
        elif path == "/" and scope.get("method") in ("GET", "HEAD"):
            page = LOADING_PAGE.replace("{notice}", notice).encode()
            await _respond(send, 503 if failed else 200, page, content_type="text/html; charset=utf-8")
        else:
            await _respond(send, 503, {"error": notice})


def forwarded_client(scope: Scope, forwarding: Forwarding) -> None:
    """Sets the request's client to the address it is from (engine.capacity.forwarding), and its scheme
    to X-Forwarded-Proto's when a trusted proxy sent it, as uvicorn's proxy-headers step does
    (which serve() turns off: this replaces it)."""
    if scope["type"] not in ("http", "websocket"):
        return
    forwarded_for: list[str] = []
    proto = None
    for name, value in scope["headers"]:
        if name == b"x-forwarded-for":
            forwarded_for.append(value.decode("latin-1"))
        elif name == b"x-forwarded-proto":
            proto = value.decode("latin-1").strip()
    if not forwarded_for and proto is None:
        return
    peer = scope.get("client")
    host = peer[0] if peer else None
    client = forwarding.client(host, forwarded_for)
    if client != host and client:
        scope["client"] = (client, 0)
    if proto in ("http", "https") and host is not None and forwarding.trusts(host):
        scope["scheme"] = proto if scope["type"] == "http" else proto.replace("http", "ws")


async def _respond(send: Send, status: int, body: Any, *, content_type: str = "application/json") -> None:
    headers = [(b"cache-control", b"no-store")]
    if status == 503:
        headers.append((b"retry-after", RETRY_AFTER_S.encode()))
    await respond(send, status, body, content_type=content_type, headers=headers)
