"""The Zipf stream through the HTTP API of this app and of a minimal gr.cache app."""

from __future__ import annotations

import gc
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.gradio_http import GradioHttpClient
from bench.models import host_load, set_threads
from bench.peers import CountingModel, counting, our_settings
from bench.workload.config import HTTP_SYSTEMS, USES_REDIS, Config, Job, Labels
from bench.workload.inputs import PNG_MAGIC
from bench.workload.processes import (
    ChildHandle,
    LocalHandle,
    fresh_redis,
    load_models,
    peak_rss_mib,
    process_cpu_s,
    redis_state,
    reset_peak_rss,
    rss_mib,
)
from bench.workload.replay import Result, replay, rotated, split_segments
from storage.embedded_redis import free_port


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
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=1)  # what our app sets
    return demo


def build_grcache_app(models: Mapping[str, Any], *, max_memory: int) -> Any:
    import gradio as gr
    from fastapi import FastAPI

    demo = build_grcache_demo(models, max_memory=max_memory)
    return gr.mount_gradio_app(FastAPI(), demo, path="", ssr_mode=False)


@dataclass(frozen=True)
class ServerSpec:
    system: str
    data_dir: str
    redis_url: str | None
    device: str
    threads: int | None
    port: int


class HttpServer:
    """One app (ours or the gr.cache app) served by uvicorn in a thread of this process."""

    def __init__(
        self, spec: ServerSpec, *, models: Mapping[str, Any] | None = None, isolated: bool = True
    ) -> None:
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
        self.spec = spec
        self._shared_models = models
        self._isolated = isolated
        self._models: dict[str, CountingModel] = {}
        self._runtime: Any = None
        self._server: Any = None

    def setup(self) -> dict[str, Any]:
        from ui.server import BackgroundServer, build_app

        spec = self.spec
        models = self._shared_models
        if models is None:
            set_threads(spec.threads)
            models = load_models(spec.device)
        self._models = counting(models)
        settings = our_settings(spec.redis_url, Path(spec.data_dir), spec.device)
        if spec.system == "ours":
            from engine.runtime import build_runtime

            self._runtime = build_runtime(settings, models=self._models)
            app = build_app(self._runtime)
        else:
            app = build_grcache_app(self._models, max_memory=settings.cache_l1_max_bytes)
        self._server = BackgroundServer(app, port=spec.port).start()
        gc.collect()
        rss = rss_mib()
        if self._isolated:
            reset_peak_rss()
        return {"url": self._server.url, "pid": os.getpid(), "rss_start_mib": rss}

    def finish(self) -> dict[str, Any]:
        if self._server is not None:
            self._server.close()
        if self._runtime is not None:
            self._runtime.close()
        return {
            "model_calls": sum(m.calls for m in self._models.values()),
            "rss_peak_mib": peak_rss_mib() if self._isolated else None,
        }


class GradioApiClient:
    """One HTTP client of an app's Gradio API, with one session (as gradio_client and a browser
    keep one) or none (curl style: Gradio builds a new session for every call)."""

    def __init__(self, url: str, *, session: bool = True) -> None:
        session_hash = secrets.token_hex(8) if session else None
        self._gradio = GradioHttpClient(url, timeout_s=120.0, session_hash=session_hash)

    def classify(self, task: str, raw: Any) -> tuple[Labels, str | None]:
        if task == "image":
            name, mime = ("upload.png", "image/png") if raw[:8] == PNG_MAGIC else ("upload.jpg", "image/jpeg")
            outputs = self._gradio.call("classify_image", [self._gradio.upload_file(name, raw, mime)]).outputs
        else:
            outputs = self._gradio.call("classify_text", [raw]).outputs
        label = outputs[0]
        tier = outputs[1].get("tier") if len(outputs) > 1 and isinstance(outputs[1], dict) else None
        return tuple((c["label"], float(c["confidence"])) for c in label["confidences"]), tier

    def close(self) -> None:
        self._gradio.close()


def run_http(
    stream: np.ndarray,
    jobs: Sequence[Job],
    config: Config,
    workdir: Path,
    *,
    models: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Result]:
    """The Zipf stream through the Gradio API of both apps, servers restarted at halfway."""
    systems = [s for s in HTTP_SYSTEMS if s in config.systems]
    results = {name: Result(name, "zipf-restart (HTTP)") for name in systems}
    answers: dict[str, dict[int, Labels]] = {name: {} for name in systems}
    disagreements: dict[str, list[str]] = {name: [] for name in systems}
    peaks: dict[str, list[float]] = {name: [] for name in systems}
    with ExitStack() as stack:
        servers: dict[str, Any] = {}
        for name in systems:
            if name in USES_REDIS:
                servers[name] = stack.enter_context(fresh_redis(workdir / f"http-{name}-redis"))

        def start_all() -> dict[str, tuple[Any, dict[str, Any]]]:
            """Start both servers (in parallel); each one's `ready` holds its url, pid and start time."""
            started = time.perf_counter()
            handles: dict[str, Any] = {}
            for name in systems:
                spec = ServerSpec(
                    name,
                    str(workdir / f"http-{name}"),
                    servers[name].url if name in servers else None,
                    config.device,
                    config.threads,
                    free_port(),
                )
                handles[name] = (
                    ChildHandle(HttpServer, spec)
                    if config.isolated
                    else LocalHandle(HttpServer(spec, models=models, isolated=False))
                )
                handles[name].send("setup")
            live = {}
            for name, handle in handles.items():
                ready = handle.receive()
                ready["start_s"] = time.perf_counter() - started
                live[name] = (handle, ready)
            return live

        def stop_all(live: Mapping[str, tuple[Any, dict[str, Any]]]) -> None:
            for name, (handle, _) in live.items():
                final = handle.call("finish")
                results[name].model_calls += final["model_calls"]
                if final["rss_peak_mib"] is not None:
                    peaks[name].append(final["rss_peak_mib"])
                handle.close()

        def server_cpu(name: str) -> float:
            """CPU seconds so far of the server process (when it has its own) and its redis-server."""
            total = process_cpu_s(live[name][1]["pid"]) if config.isolated else 0.0
            return total + (redis_state(servers[name])[1] if name in servers else 0.0)

        live = start_all()
        for name, (_, ready) in live.items():
            results[name].rss_start_mib = ready["rss_start_mib"] if config.isolated else None
        segments = split_segments(stream, config.segments)
        restart_at = len(segments) // 2
        sessions = "one session per client" if config.http_sessions else "no session (a new one per request)"
        log(
            f"zipf-restart over HTTP: {len(stream):,} requests, {len(segments)} segments, "
            f"{config.clients} HTTP clients, {sessions} | at start: {host_load()}"
        )
        try:
            for k, segment in enumerate(segments):
                if k == restart_at:  # a real restart: new processes, models loaded again
                    stop_all(live)
                    live = start_all()
                    for name, (_, ready) in live.items():
                        results[name].restart_s = ready["start_s"]
                for name in rotated(systems, k):
                    url = live[name][1]["url"]
                    clients = [
                        GradioApiClient(url, session=config.http_sessions) for _ in range(config.clients)
                    ]
                    try:
                        cpu = server_cpu(name)
                        segment_result = replay(
                            [c.classify for c in clients], jobs, segment, answers[name], disagreements[name]
                        )
                        segment_result.cpu_s = server_cpu(name) - cpu  # the server's, not the clients'
                    finally:
                        for c in clients:
                            c.close()
                    results[name].add(segment_result)
        finally:
            for name, server in servers.items():
                results[name].redis_mib = redis_state(server)[0]
            stop_all(live)
        log(f"zipf-restart over HTTP: done | at end: {host_load()}")
    for name in systems:
        if not config.isolated:  # the servers ran in this process, alongside the clients
            results[name].cpu_s = float("nan")
        results[name].answers = answers[name]
        results[name].disagreements = disagreements[name]
        results[name].rss_peak_mib = max(peaks[name]) if peaks[name] else None
    return results
