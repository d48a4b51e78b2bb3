"""The HTTP app: health endpoints plus the Gradio UI mounted at /, served by uvicorn."""

from __future__ import annotations

import logging
import threading
import time

import gradio as gr
import uvicorn
from fastapi import FastAPI

from admin.api import build_router
from admin.tab import CARD_CSS, build_admin_tab
from engine.runtime import Runtime
from ui.app_ui import build_demo

log = logging.getLogger(__name__)

QUEUE_MAX_SIZE = 256
GRACEFUL_SHUTDOWN_S = 5


def build_app(runtime: Runtime) -> FastAPI:
    settings = runtime.settings
    engine = runtime.engine
    app = FastAPI(title="Inference cache", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(
        build_router(engine=engine, admin=runtime.admin, auth=runtime.auth, metrics=runtime.metrics)
    )
    demo = build_demo(
        engine,
        max_upload_bytes=settings.max_upload_bytes,
        admin_tab=lambda: build_admin_tab(runtime.admin, runtime.auth),
    )
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=1)
    return gr.mount_gradio_app(
        app,
        demo,
        path="",
        max_file_size=2 * settings.max_upload_bytes,  # the engine's own limit gives the clearer message
        ssr_mode=False,
        footer_links=["api"],
        css=CARD_CSS,
    )


class BackgroundServer:
    """Runs the app in a thread (tests, benchmarks). `close()` stops it."""

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
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


def serve(runtime: Runtime) -> None:
    """Blocks until the process is told to stop (SIGINT/SIGTERM handled by uvicorn)."""
    settings = runtime.settings
    # Open event streams (a browser tab, a gradio_client) must not hold a redeploy hostage.
    uvicorn.run(
        build_app(runtime), host=settings.host, port=settings.port, log_level="info",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )  # fmt: skip
