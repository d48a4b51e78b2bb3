"""The live load the L2 p99 benches share (bench.cleanup_p99, bench.warmup_p99): an engine
whose L1 keeps nothing, so every hit is a Redis round trip, and a loop of cached messages
from a few threads, each request's latency recorded."""

from __future__ import annotations

import threading
import time

from engine.generation import LocalGeneration
from engine.models.base import Classifier
from engine.service import CachePolicy, InferenceEngine
from storage.breaker import CircuitBreaker
from storage.memory import MemoryStore
from storage.redis_clients import make_nodes
from storage.redis_store import RedisStore


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
