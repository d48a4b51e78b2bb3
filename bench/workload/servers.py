"""The servers of the HTTP run: this app and a minimal gr.cache app, each in its own process.

Each HTTP path gets its own server (and its own Redis when the app uses one), so that no path
warms another's cache and each server's CPU and memory are its own. A server is up when it
answers its readiness probe (`/readyz` 200 for this app, which may listen before its models
are loaded; the page for the gr.cache app), not merely when its port accepts connections.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.models import set_threads
from bench.peers import CountingModel, counting, our_settings
from bench.workload.config import HTTP_PATHS, USES_REDIS, Config, models_of
from bench.workload.processes import (
    ChildHandle,
    LocalHandle,
    ModelSets,
    fresh_redis,
    load_models,
    peak_rss_mib,
    process_cpu_s,
    process_rss_mib,
    redis_state,
    reset_peak_rss,
    rss_mib,
)
from storage.redis.embedded import free_port

READY_TIMEOUT_S = 600.0


def build_grcache_demo(models: Mapping[str, Any], *, max_memory: int) -> Any:
    """The minimal Gradio app: gr.Image(type="numpy") and a Textbox into gr.cache'd classifiers."""
    import gradio as gr

    from engine.inputs import CanonicalImage
    from ui.server import QUEUE_MAX_SIZE

    image_model, text_model = models["image"], models["text"]

    @gr.cache(max_size=0, max_memory=max_memory)
    def classify_image(image: np.ndarray) -> dict[str, float]:
        return image_model.predict_batch([CanonicalImage(np.ascontiguousarray(image))])[0].as_label_value()

    @gr.cache(max_size=0, max_memory=max_memory)
    def classify_text(text: str) -> dict[str, float]:
        return text_model.predict_batch([text_model.canonicalize(text)])[0].as_label_value()

    with gr.Blocks(title="gr.cache") as demo:
        image_in = gr.Image(type="numpy")
        image_out = gr.Label(num_top_classes=5)
        gr.Button("Classify image").click(classify_image, image_in, image_out, api_name="classify_image")
        text_in = gr.Textbox()
        text_out = gr.Label(num_top_classes=5)
        gr.Button("Classify message").click(classify_text, text_in, text_out, api_name="classify_text")
    # Gradio's default: one call per event at a time (the set-up issue 18 measured against).
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=1)
    return demo


def build_grcache_app(models: Mapping[str, Any], *, max_memory: int) -> Any:
    import gradio as gr
    from fastapi import FastAPI

    demo = build_grcache_demo(models, max_memory=max_memory)
    return gr.mount_gradio_app(FastAPI(), demo, path="", ssr_mode=False)


def wait_ready(url: str, path: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until `url + path` answers 200 (a 503 means: listening, not ready yet)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url + path, timeout=5.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{url}{path} not ready within {timeout_s:.0f}s ({last})")


@dataclass(frozen=True)
class ServerSpec:
    app: str  # "ours" | "grcache"
    data_dir: str
    redis_url: str | None
    device: str
    threads: int | None
    port: int


class HttpServer:
    """One app served by uvicorn in a thread of this process (a child process, or the tests')."""

    def __init__(self, spec: ServerSpec, *, models: ModelSets | None = None, isolated: bool = True) -> None:
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
        self.spec = spec
        self._shared_models = models
        self._isolated = isolated
        self._models: dict[str, CountingModel] = {}
        self._server: Any = None

    def setup(self) -> dict[str, Any]:
        from ui.server import BackgroundServer

        spec = self.spec
        if self._shared_models is not None:
            models = self._shared_models[models_of(spec.app)]
        else:
            set_threads(spec.threads)
            models = load_models(spec.device, models_of(spec.app))
        self._models = counting(models)
        settings = our_settings(spec.redis_url, Path(spec.data_dir), spec.device)
        if spec.app == "ours":
            app = self._our_app(settings)
        else:
            app = build_grcache_app(self._models, max_memory=settings.cache.l1_max_bytes)
        self._server = BackgroundServer(app, port=spec.port).start()
        wait_ready(self._server.url, "/readyz" if spec.app == "ours" else "/")
        gc.collect()
        rss = rss_mib()
        if self._isolated:
            reset_peak_rss()
        return {"url": self._server.url, "pid": os.getpid(), "rss_start_mib": rss}

    def _our_app(self, settings: Any) -> Any:
        """What `python app.py` serves: the app behind its start-up gate (`ui.startup`), which
        builds the runtime (around our counting models) once it listens and closes it on shutdown."""
        from runtime import build_runtime
        from ui.server import build_app
        from ui.startup import ServingApp

        def runtime_for(settings: Any) -> Any:
            return build_runtime(settings, models=self._models)

        return ServingApp(settings, build_runtime=runtime_for, build_app=build_app)

    def finish(self) -> dict[str, Any]:
        if self._server is not None:
            self._server.close()  # the gate's shutdown closes the runtime it built
        return {
            "model_calls": sum(m.calls for m in self._models.values()),
            "rss_peak_mib": peak_rss_mib() if self._isolated else None,
        }


@dataclass
class Live:
    handle: ChildHandle | LocalHandle
    url: str
    pid: int
    rss_start_mib: float
    start_s: float


class Servers:
    """One server per HTTP path, each with its own Redis (kept across restarts) where its app
    uses one; `start()` starts them all at once (they load their models in parallel)."""

    def __init__(
        self,
        config: Config,
        workdir: Path,
        stack: ExitStack,
        *,
        models: ModelSets | None = None,
    ) -> None:
        self._config = config
        self._workdir = workdir
        self._models = models
        self.paths = config.http_paths
        self.redis = {
            path: stack.enter_context(fresh_redis(workdir / f"http-{path}-redis"))
            for path in self.paths
            if HTTP_PATHS[path][0] in USES_REDIS
        }
        self.live: dict[str, Live] = {}
        self.model_calls = dict.fromkeys(self.paths, 0)
        self.rss_peaks: dict[str, list[float]] = {path: [] for path in self.paths}

    def start(self) -> None:
        config = self._config
        started = time.perf_counter()
        handles: dict[str, ChildHandle | LocalHandle] = {}
        for path in self.paths:
            spec = ServerSpec(
                HTTP_PATHS[path][0],
                str(self._workdir / f"http-{path}"),
                self.redis[path].url if path in self.redis else None,
                config.device,
                config.threads,
                free_port(),
            )
            handles[path] = (
                ChildHandle(HttpServer, spec)
                if config.isolated
                else LocalHandle(HttpServer(spec, models=self._models, isolated=False))
            )
            handles[path].send("setup")
        for path, handle in handles.items():
            ready = handle.receive()
            elapsed = time.perf_counter() - started
            self.live[path] = Live(handle, ready["url"], ready["pid"], ready["rss_start_mib"], elapsed)

    def stop(self) -> None:
        for path, live in self.live.items():
            final = live.handle.call("finish")
            self.model_calls[path] += final["model_calls"]
            if final["rss_peak_mib"] is not None:
                self.rss_peaks[path].append(final["rss_peak_mib"])
            live.handle.close()
        self.live.clear()

    def cpu_s(self, path: str) -> float:
        """CPU seconds so far of the server's process and its redis-server (NaN: no process of its own)."""
        if not self._config.isolated:
            return float("nan")
        total = process_cpu_s(self.live[path].pid)
        return total + (redis_state(self.redis[path])[1] if path in self.redis else 0.0)

    def rss_mib(self, path: str) -> float:
        """The server process's resident memory now (NaN: no process of its own)."""
        return process_rss_mib(self.live[path].pid) if self._config.isolated else float("nan")

    def redis_mib(self, path: str) -> float | None:
        return redis_state(self.redis[path])[0] if path in self.redis else None
