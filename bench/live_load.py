"""The live load the L2 p99 benches share (bench.cleanup_p99, bench.warmup_p99): an engine
whose L1 keeps nothing, so every hit is a Redis round trip, and a loop of cached messages
from a few threads, each request's latency recorded."""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from engine.cache.generation import LocalGeneration
from engine.inputs import CanonicalText, clean_text
from engine.models.base import Classifier, Prediction
from engine.pipeline.service import CachePolicy, InferenceEngine
from storage.breaker import CircuitBreaker
from storage.memory import MemoryStore
from storage.redis.clients import make_nodes
from storage.redis.embedded import EmbeddedRedis
from storage.redis.store import RedisStore


class FixedTextModel:
    """A text model whose answer is always the same, after `forward_s` of sleep: the benches
    measure the cache's round trips, not a network."""

    task, name, device, kind = "text", "fixed", "cpu", "text-classification"
    cheap_canonicalize = True

    def __init__(self, version: str, forward_s: float = 0.0) -> None:
        self.version = version
        self._forward_s = forward_s

    def canonicalize(self, raw: object) -> CanonicalText:
        return clean_text(raw, max_chars=200)

    def predict_batch(self, inputs: Sequence[CanonicalText]) -> list[Prediction]:
        if self._forward_s:
            time.sleep(self._forward_s)
        return [Prediction((("a", 0.75), ("b", 0.25))) for _ in inputs]


def run_for(workers: list[threading.Thread], seconds: float, stop: threading.Event) -> None:
    """Start `workers`, let them run `seconds`, set `stop` and wait for them all."""
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()


def phase_args(
    description: str, *, seconds: float, rounds: int, rounds_help: str, count: tuple[str, int, str]
) -> argparse.Namespace:
    """The benches' command line: `--seconds` per phase, `--rounds` of phases in turn, and one
    count of their own (`count`: flag, default, help)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seconds", type=float, default=seconds, help="length of each phase")
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    flag, default, help_ = count
    parser.add_argument(flag, type=int, default=default, help=help_)
    return parser.parse_args()


@contextlib.contextmanager
def l2_bench(
    model: Classifier, *, prefix: str, maxmemory_mb: int
) -> Iterator[tuple[RedisStore, InferenceEngine]]:
    """A private redis-server and an `l2_only_engine` on it, for the block."""
    logging.basicConfig(level=logging.WARNING)
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(data_dir=Path(tmp), maxmemory_mb=maxmemory_mb) as server,
    ):
        store, engine = l2_only_engine(server.start(), model, prefix=prefix)
        try:
            yield store, engine
        finally:
            engine.close()
            store.close()


def l2_only_engine(url: str, model: Classifier, *, prefix: str) -> tuple[RedisStore, InferenceEngine]:
    """A store on `url` and a text engine over it whose L1 holds nothing."""
    store = RedisStore(make_nodes(url, socket_timeout_s=1.0), prefix=prefix,
                       breaker=CircuitBreaker(failure_threshold=5, reset_s=1.0))  # fmt: skip
    engine = InferenceEngine(
        models={"text": model}, l1=MemoryStore(max_bytes=0, default_ttl_s=1.0), l2=store,
        generation=LocalGeneration(), policy=CachePolicy(prefix=prefix, l1_ttl_s=1.0, l2_ttl_s=3600,
                                                         negative_ttl_s=60),
    )  # fmt: skip
    return store, engine


def live_latencies(
    engine: InferenceEngine, texts: list[str], seconds: float, *, threads: int = 4, pause_s: float = 0.0
) -> list[float]:
    """Milliseconds per request of `threads` clients cycling through `texts` for `seconds`,
    each resting `pause_s` between requests."""
    stop = time.monotonic() + seconds
    samples: list[float] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        mine = []
        n = index
        while time.monotonic() < stop:
            started = time.perf_counter()
            engine.classify("text", texts[n % len(texts)])
            mine.append((time.perf_counter() - started) * 1000.0)
            n += threads
            if pause_s:
                time.sleep(pause_s)
        with lock:
            samples.extend(mine)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return samples


def paired_phases(
    engine: InferenceEngine,
    texts: list[str],
    *,
    rounds: int,
    seconds: float,
    background: Callable[[int], Callable[[], None]],
    prepare: Callable[[int], None] | None = None,
    pause_s: float = 0.0,
) -> tuple[list[float], list[float]]:
    """The benches' measuring loop: `rounds` times, `prepare(round)`, a baseline phase of live
    load, then the same load while `background(round)` runs (it starts the work and returns what
    ends the phase). Returns (baseline, during) latencies, each pooled over its rounds, so that
    drift of a shared machine falls on both sides alike."""
    baseline: list[float] = []
    during: list[float] = []
    for round_ in range(rounds):
        if prepare is not None:
            prepare(round_)
        baseline += live_latencies(engine, texts, seconds, pause_s=pause_s)
        end = background(round_)
        during += live_latencies(engine, texts, seconds, pause_s=pause_s)
        end()
    return baseline, during


def print_p99s(baseline: list[float], during: list[float], *, without: str, with_: str, note: str) -> None:
    """Both sides' p99, `note` after the second's request count, and their ratio."""
    p99_base, p99_during = float(np.percentile(baseline, 99)), float(np.percentile(during, 99))
    print(f"{without}{p99_base:.3f} ms ({len(baseline)} requests)")
    print(f"{with_}{p99_during:.3f} ms ({len(during)} requests; {note})")
    print(f"ratio: {p99_during / p99_base:.3f} (target <= 1.10)")
