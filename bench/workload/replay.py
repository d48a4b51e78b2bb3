"""Replaying a stream by concurrent clients, and what one system measured on one workload."""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.models import SCORE_TOLERANCE
from bench.workload.config import Job, Labels


def labels_of(prediction: Any) -> Labels:
    return tuple((str(name), float(score)) for name, score in prediction.labels)


@dataclass
class Segment:
    latencies_ms: np.ndarray
    wall_s: float
    cpu_s: float
    tiers: Counter[str]
    errors: list[str]
    tier_each: list[str] = field(default_factory=list)  # each request's tier, in `indices` order


def replay(
    clients: Sequence[Callable[[str, Any], tuple[Labels, str | None]]],
    jobs: Sequence[Job],
    indices: Sequence[int],
    answers: dict[int, Labels],
    disagreements: list[str],
) -> Segment:
    """Replay `indices` with one thread per client, each taking the next request when its
    last one is answered. Records latency, the answer given to every input (`answers`) and any
    input answered differently from an earlier time (`disagreements`)."""
    n = len(indices)
    latencies = np.zeros(n)
    tiers: Counter[str] = Counter()
    tier_each = [""] * n
    errors: list[str] = []
    cursor = itertools.count()  # next() on it is atomic under the GIL
    lock = threading.Lock()

    def client(classify: Callable[[str, Any], tuple[Labels, str | None]]) -> None:
        while (i := next(cursor)) < n:
            index = indices[i]
            task, raw = jobs[index]
            started = time.perf_counter_ns()
            try:
                labels, tier = classify(task, raw)
            except Exception as exc:
                with lock:
                    errors.append(f"input {index} ({task}): {exc.__class__.__name__}: {exc}")
                continue
            latencies[i] = (time.perf_counter_ns() - started) / 1e6
            tier_each[i] = tier or "?"
            with lock:
                tiers[tier or "?"] += 1
                known = answers.setdefault(index, labels)
                if known != labels and not same_answer(known, labels):
                    disagreements.append(f"input {index} ({task}) answered {labels} after {known}")

    threads = [threading.Thread(target=client, args=(c,), name=f"client-{k}") for k, c in enumerate(clients)]
    gc.collect()
    cpu_started, started = time.process_time(), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return Segment(latencies, wall, cpu, tiers, errors, tier_each)


def same_answer(a: Labels, b: Labels, tolerance: float = SCORE_TOLERANCE) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and abs(x[1] - y[1]) <= tolerance for x, y in zip(a, b, strict=True)
    )


@dataclass
class Result:
    system: str
    workload: str
    latencies_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the system's process, and its redis-server when it has one
    restart_s: float | None = None
    model_calls: int = 0
    tiers: Counter[str] = field(default_factory=Counter)
    rss_peak_mib: float | None = None
    rss_start_mib: float | None = None
    redis_mib: float | None = None
    l2_errors: int | None = None  # ours: Redis calls that failed or timed out
    answers: dict[int, Labels] = field(default_factory=dict)
    disagreements: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.latencies_ms)

    @property
    def throughput(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def hit_ratio(self) -> float:
        return 1.0 - self.model_calls / self.requests if self.requests else float("nan")

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.requests else float("nan")

    def add(self, segment: Segment) -> None:
        if segment.errors:
            raise RuntimeError(
                f"{self.system} on {self.workload}: {len(segment.errors)} requests failed, "
                f"first: {segment.errors[0]}"
            )
        self.latencies_ms = np.concatenate([self.latencies_ms, segment.latencies_ms])
        self.wall_s += segment.wall_s
        self.cpu_s += segment.cpu_s
        self.tiers.update(segment.tiers)


def rotated(items: Sequence[str], k: int) -> list[str]:
    k %= len(items)
    return [*items[k:], *items[:k]]


def split_segments(stream: np.ndarray, segments: int) -> list[list[int]]:
    return [part.tolist() for part in np.array_split(stream, max(1, min(segments, len(stream))))]
