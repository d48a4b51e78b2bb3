"""The systems called in process: one worker per system, all taking turns segment by segment."""

from __future__ import annotations

import gc
import os
import pickle
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import host_load, set_threads
from bench.peers import CommonRecipe, CountingModel, GrCache, NoCache, Ours, System, counting, our_settings
from bench.workload.config import REDIS_OVER_TCP, USES_REDIS, Config, Job, Labels, models_of
from bench.workload.processes import (
    ChildHandle,
    LocalHandle,
    ModelSets,
    fresh_redis,
    load_models,
    peak_rss_mib,
    redis_state,
    reset_peak_rss,
    rss_mib,
)
from bench.workload.replay import Result, Segment, labels_of, replay, rotated, split_segments


def build_system(
    name: str, models: Mapping[str, CountingModel], *, redis_url: str | None, data_dir: Path, device: str
) -> System:
    settings = our_settings(redis_url, data_dir, device)
    if name == "nocache":
        return NoCache(models)
    if name == "seed":
        if redis_url is None:
            raise ValueError("seed needs a Redis")
        return CommonRecipe(models, redis_url, name="seed")
    if name == "grcache":
        return GrCache(models, max_memory=settings.cache.l1_max_bytes)  # the same budget as our L1
    if name == "ours":
        return Ours(models, settings)
    if name == "ours-l1":
        return Ours(models, settings.changed(redis__url="off"), name)
    if name == "ours-tcp":  # the same engine; run_workload gives it a Redis on loopback TCP
        return Ours(models, settings, name)
    if name == "ours-nobatch":
        return Ours(models, settings.changed(models__batch_max_size=1), name)
    if name == "ours-signed":  # a fresh key per run: signing's cost, not a secret
        return Ours(models, settings.changed(cache__signing_keys=(secrets.token_urlsafe(32),)), name)
    if name in ("nocache-twin", "nocache-app"):  # (the app's models are the caller's choice)
        return NoCache(models, name)
    raise ValueError(f"unknown system {name!r}")


@dataclass(frozen=True)
class WorkerSpec:
    system: str
    workload: str
    inputs_path: str
    data_dir: str
    redis_url: str | None
    device: str
    threads: int | None
    clients: int


class Worker:
    """Serves one system for one workload: setup, segments, a restart, finish."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        models: ModelSets | None = None,
        jobs: Sequence[Job] | None = None,
        isolated: bool = True,
    ) -> None:
        self.spec = spec
        self._shared_models = models
        self._jobs = jobs
        self._isolated = isolated  # alone in its process: its RSS is its own
        self._system: System | None = None
        self._models: dict[str, CountingModel] = {}
        self._answers: dict[int, Labels] = {}
        self._disagreements: list[str] = []
        self._rss_start = float("nan")

    def setup(self) -> dict[str, Any]:
        spec = self.spec
        if self._jobs is None:
            self._jobs = pickle.loads(Path(spec.inputs_path).read_bytes())
        if self._shared_models is not None:
            models = self._shared_models[models_of(spec.system)]
        else:
            set_threads(spec.threads)
            models = load_models(spec.device, models_of(spec.system))
        self._models = counting(models)
        self._system = build_system(
            spec.system,
            self._models,
            redis_url=spec.redis_url,
            data_dir=Path(spec.data_dir),
            device=spec.device,
        )
        gc.collect()
        self._rss_start = rss_mib()
        if self._isolated:
            reset_peak_rss()
        return {"rss_start_mib": self._rss_start, "pid": os.getpid()}

    def _classify(self, task: str, raw: Any) -> tuple[Labels, str | None]:
        assert self._system is not None
        prediction, tier = self._system.classify(task, raw)
        return labels_of(prediction), tier

    def run(self, indices: Sequence[int]) -> Segment:
        assert self._jobs is not None
        clients = [self._classify] * self.spec.clients
        return replay(clients, self._jobs, indices, self._answers, self._disagreements)

    def restart(self) -> float:
        assert self._system is not None
        started = time.perf_counter()
        self._system.restart()
        gc.collect()
        return time.perf_counter() - started

    def finish(self) -> dict[str, Any]:
        if self._system is not None:
            self._system.close()
        return {
            "model_calls": sum(m.calls for m in self._models.values()),
            "l2_errors": getattr(self._system, "l2_errors", None),
            "rss_start_mib": self._rss_start if self._isolated else None,
            "rss_peak_mib": peak_rss_mib() if self._isolated else None,
            "answers": self._answers,
            "disagreements": self._disagreements,
        }


def run_workload(
    workload: str,
    stream: np.ndarray,
    config: Config,
    workdir: Path,
    inputs_path: Path,
    *,
    models: ModelSets | None = None,
    jobs: Sequence[Job] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Result]:
    """Every system on one workload: all alive at once, taking turns segment by segment."""
    results = {name: Result(name, workload) for name in config.systems}
    with ExitStack() as stack:
        servers: dict[str, Any] = {}
        handles: dict[str, ChildHandle | LocalHandle] = {}
        for name in config.systems:
            redis_url = None
            if name in USES_REDIS:
                servers[name] = stack.enter_context(
                    fresh_redis(workdir / f"{workload}-{name}-redis", tcp=name in REDIS_OVER_TCP)
                )
                redis_url = servers[name].url
            spec = WorkerSpec(
                name,
                workload,
                str(inputs_path),
                str(workdir / f"{workload}-{name}"),
                redis_url,
                config.device,
                config.threads,
                config.clients,
            )
            if config.isolated:
                handles[name] = ChildHandle(Worker, spec)
            else:
                handles[name] = LocalHandle(Worker(spec, models=models, jobs=jobs, isolated=False))
            stack.callback(handles[name].close)
        for handle in handles.values():  # the children load their models in parallel
            handle.send("setup")
        for name, handle in handles.items():
            ready = handle.receive()
            results[name].rss_start_mib = ready["rss_start_mib"] if config.isolated else None
        segments = split_segments(stream, config.segments)
        restart_at = len(segments) // 2 if workload == "zipf-restart" else None
        log(
            f"{workload}: {len(stream):,} requests, {len(segments)} segments, {config.clients} clients"
            f" | at start: {host_load()}"
        )
        for k, segment in enumerate(segments):
            if k == restart_at:
                for name in config.systems:
                    results[name].restart_s = handles[name].call("restart")
            for name in rotated(config.systems, k):
                # CPU per segment: the system's process (measured there) and its redis-server's.
                redis_cpu = redis_state(servers[name])[1] if name in servers else 0.0
                segment_result = handles[name].call("run", segment)
                if name in servers:
                    segment_result.cpu_s += redis_state(servers[name])[1] - redis_cpu
                results[name].add(segment_result)
        log(f"{workload}: done | at end: {host_load()}")
        for name in config.systems:
            if name in servers:
                results[name].redis_mib = redis_state(servers[name])[0]
            final = handles[name].call("finish")
            results[name].model_calls = final["model_calls"]
            results[name].l2_errors = final["l2_errors"]
            results[name].rss_peak_mib = final["rss_peak_mib"]
            results[name].answers = final["answers"]
            results[name].disagreements = final["disagreements"]
    return results
