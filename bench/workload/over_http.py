"""What users get: the Zipf stream over HTTP, through three paths side by side.

`ours` is this app through Gradio (`/gradio_api/call/classify_*`), `ours-rest` this app
through REST (the Open Inference Protocol, `/v2/models/{task}/infer`), `grcache` the minimal
gr.cache app through Gradio; each path has its own server process (`bench.workload.servers`).
Three phases against the same servers:

1. stream: the zipf-restart stream, by `clients` keep-alive clients per path, the paths
   taking turns segment by segment, every server restarted halfway (new processes, models
   loaded again; Redis kept). Gradio clients with and without a session hash (`mixed`: every
   other client sends none, as curl and Gradio's "Use via API" page do; REST has no sessions);
2. cached answers: one keep-alive client per path and session mode sends inputs already
   cached, one at a time, the cells interleaved in rounds: latency (p50) and the server's CPU
   per answer (its process, measured over each round's batch);
3. memory: `rss_calls` cached text calls without a session hash to each path, and the server
   process's resident memory before and after.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import host_load
from bench.workload.config import HTTP_PATHS, Config, Job, Labels
from bench.workload.inputs import PNG_MAGIC
from bench.workload.processes import ModelSets
from bench.workload.replay import Result, replay, rotated, split_segments
from bench.workload.servers import Servers
from testing.gradio_http import GradioHttpClient
from testing.oip_http import OipHttpClient

HIT_INPUTS = 8  # distinct cached inputs per task that the hit and memory phases cycle through
HIT_ROUNDS = 5
TASKS = ("text", "image")


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


class RestApiClient:
    """One keep-alive JSON client of the app's Open Inference Protocol routes."""

    def __init__(self, url: str) -> None:
        self._oip = OipHttpClient(url, timeout_s=120.0)

    def classify(self, task: str, raw: Any) -> tuple[Labels, str | None]:
        answer = self._oip.infer(task, raw)
        return answer.labels, answer.cache_info.get("tier")

    def close(self) -> None:
        self._oip.close()


def make_client(path: str, url: str, *, session: bool) -> GradioApiClient | RestApiClient:
    return RestApiClient(url) if HTTP_PATHS[path][1] == "rest" else GradioApiClient(url, session=session)


def session_plan(mode: str, clients: int) -> list[bool]:
    """Which of the Gradio clients send a session hash: `mixed` every other one (the first does)."""
    return [mode == "with" or (mode == "mixed" and k % 2 == 0) for k in range(clients)]


def session_modes(path: str) -> tuple[bool | None, ...]:
    """The session modes of the hit phase: with and without for Gradio, none for REST."""
    return (None,) if HTTP_PATHS[path][1] == "rest" else (True, False)


@dataclass
class HitCost:
    """Cached answers one at a time on one path: latency, and the server's CPU per answer."""

    path: str
    session: bool | None  # None: REST, which has no sessions
    task: str
    latencies_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0  # the server process and its Redis, over the timed answers (NaN: shared process)
    tiers: Counter[str] = field(default_factory=Counter)

    @property
    def n(self) -> int:
        return len(self.latencies_ms)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    @property
    def cpu_ms(self) -> float:
        return 1000.0 * self.cpu_s / self.n if self.n else float("nan")


@dataclass(frozen=True)
class RssGrowth:
    path: str
    calls: int
    start_mib: float
    end_mib: float

    @property
    def growth_mib(self) -> float:
        return self.end_mib - self.start_mib


@dataclass
class HttpRun:
    results: dict[str, Result]
    hits: list[HitCost]
    memory: list[RssGrowth]
    sessions: str
    task_share: dict[str, float] = field(default_factory=dict)  # each task's share of the stream

    def hit(self, path: str, session: bool | None, task: str) -> HitCost | None:
        return next((h for h in self.hits if (h.path, h.session, h.task) == (path, session, task)), None)


def hottest(stream: np.ndarray, jobs: Sequence[Job], task: str, count: int = HIT_INPUTS) -> list[int]:
    """The `count` inputs of `task` the stream sends most often (all cached once it has run)."""
    counts = Counter(int(i) for i in stream if jobs[int(i)][0] == task)
    return [index for index, _ in counts.most_common(count)]


def run_http(
    stream: np.ndarray,
    jobs: Sequence[Job],
    config: Config,
    workdir: Path,
    *,
    models: ModelSets | None = None,
    log: Callable[[str], None] = print,
) -> HttpRun:
    paths = config.http_paths
    results = {path: Result(path, "zipf-restart (HTTP)") for path in paths}
    answers: dict[str, dict[int, Labels]] = {path: {} for path in paths}
    disagreements: dict[str, list[str]] = {path: [] for path in paths}
    plan = session_plan(config.http_sessions, config.clients)
    with ExitStack() as stack:
        servers = Servers(config, workdir, stack, models=models)
        servers.start()
        for path, live in servers.live.items():
            results[path].rss_start_mib = live.rss_start_mib if config.isolated else None
        segments = split_segments(stream, config.segments)
        restart_at = len(segments) // 2
        log(
            f"zipf-restart over HTTP ({', '.join(paths)}): {len(stream):,} requests, {len(segments)} "
            f"segments, {config.clients} clients per path, Gradio clients with a session hash: "
            f"{sum(plan)} of {len(plan)} | at start: {host_load()}"
        )
        try:
            for k, segment in enumerate(segments):
                if k == restart_at:  # a real restart: new processes, models loaded again
                    servers.stop()
                    servers.start()
                    for path, live in servers.live.items():
                        results[path].restart_s = live.start_s
                for path in rotated(paths, k):
                    url = servers.live[path].url
                    clients = [make_client(path, url, session=session) for session in plan]
                    try:
                        cpu = servers.cpu_s(path)
                        segment_result = replay(
                            [c.classify for c in clients], jobs, segment, answers[path], disagreements[path]
                        )
                        segment_result.cpu_s = servers.cpu_s(path) - cpu  # the server's, not the clients'
                    finally:
                        for c in clients:
                            c.close()
                    results[path].add(segment_result)
            log(f"zipf-restart over HTTP: done | {host_load()}")
            picks = {task: hottest(stream, jobs, task) for task in TASKS}
            hits = measure_hits(servers, jobs, picks, config)
            log(f"cached answers over HTTP: done | {host_load()}")
            memory = measure_memory(servers, jobs, picks["text"], config)
            log(f"memory over HTTP: done | at end: {host_load()}")
        finally:
            for path in paths:
                results[path].redis_mib = servers.redis_mib(path)
            servers.stop()
    for path in paths:
        results[path].model_calls = servers.model_calls[path]
        results[path].answers = answers[path]
        results[path].disagreements = disagreements[path]
        peaks = servers.rss_peaks[path]
        results[path].rss_peak_mib = max(peaks) if peaks else None
    tasks = Counter(jobs[int(i)][0] for i in stream)
    share = {task: count / max(len(stream), 1) for task, count in tasks.items()}
    return HttpRun(results, hits, memory, config.http_sessions, share)


def measure_hits(
    servers: Servers, jobs: Sequence[Job], picks: Mapping[str, Sequence[int]], config: Config
) -> list[HitCost]:
    """Per task, every (path, session mode) cell sends cached inputs one at a time; the cells
    take turns in rounds (rotating), each round a batch whose server CPU is measured."""
    cells = [(path, session) for path in servers.paths for session in session_modes(path)]
    chunk = max(1, config.hit_samples // HIT_ROUNDS)
    costs: list[HitCost] = []
    for task in TASKS:
        inputs = list(picks[task])
        if not inputs:
            continue
        clients = {
            (path, session): make_client(path, servers.live[path].url, session=bool(session))
            for path, session in cells
        }
        found = {cell: HitCost(cell[0], cell[1], task) for cell in cells}
        try:
            for client in clients.values():  # cached everywhere, and every connection open
                for index in inputs:
                    client.classify(task, jobs[index][1])
            for r in range(HIT_ROUNDS):
                for cell in rotated(cells, r):
                    cost, classify = found[cell], clients[cell].classify
                    cpu = servers.cpu_s(cell[0])
                    for j in range(chunk):
                        raw = jobs[inputs[(r * chunk + j) % len(inputs)]][1]
                        started = time.perf_counter_ns()
                        _, tier = classify(task, raw)
                        cost.latencies_ms.append((time.perf_counter_ns() - started) / 1e6)
                        cost.tiers[tier or "?"] += 1
                    cost.cpu_s += servers.cpu_s(cell[0]) - cpu
        finally:
            for client in clients.values():
                client.close()
        costs += found.values()
    return costs


def measure_memory(
    servers: Servers, jobs: Sequence[Job], inputs: Sequence[int], config: Config
) -> list[RssGrowth]:
    """`rss_calls` cached text calls without a session hash to each path, by `clients`
    concurrent clients; the server's resident memory before and after."""
    if not inputs:
        return []
    indices = [inputs[i % len(inputs)] for i in range(config.rss_calls)]
    found = []
    for path in servers.paths:
        url = servers.live[path].url
        clients = [make_client(path, url, session=False) for _ in range(config.clients)]
        try:
            before = servers.rss_mib(path)
            segment = replay([c.classify for c in clients], jobs, indices, {}, [])
            after = servers.rss_mib(path)
        finally:
            for c in clients:
                c.close()
        if segment.errors:
            raise RuntimeError(f"{path}: {len(segment.errors)} calls failed, first: {segment.errors[0]}")
        found.append(RssGrowth(path, len(indices), before, after))
    return found
