"""Prometheus metrics: per-request counters fed by the engine's listener, cache state
read at scrape time. Its own registry (no process-global state); no input data."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from admin.monitoring.health_metrics import gpu_metrics, redis_metrics
from admin.monitoring.remote_metrics import remote_metrics
from engine.pipeline.service import InferenceEngine, RequestRecord
from storage.log_writer import RequestLogWriter

LATENCY_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _CacheStateCollector(Collector):
    def __init__(self, engine: InferenceEngine, writer: RequestLogWriter | None) -> None:
        self._engine = engine
        self._writer = writer

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        state = self._engine.cache_state()
        counters = self._engine.counters()
        yield GaugeMetricFamily("infcache_l1_bytes", "Bytes held by the L1 cache", value=state["l1"]["bytes"])
        yield GaugeMetricFamily(
            "infcache_l1_entries", "Entries in the L1 cache", value=state["l1"]["entries"]
        )
        yield CounterMetricFamily("infcache_l1_evictions", "L1 capacity evictions",
                                  value=state["l1"]["evictions"])  # fmt: skip
        yield CounterMetricFamily(
            "infcache_l2_errors", "Failed or skipped L2 calls", value=counters.l2_errors
        )
        yield CounterMetricFamily("infcache_l2_corrupt_values", "Undecodable L2 values deleted",
                                  value=counters.corrupt_values)  # fmt: skip
        yield CounterMetricFamily("infcache_l2_forged_values", "L2 values refused: bad or no signature",
                                  value=counters.forged_values)  # fmt: skip
        yield from shadow_metrics(self._engine)
        yield from redis_metrics(self._engine)  # INFO of each Redis primary (admin.monitoring.health_metrics)
        yield from gpu_metrics()
        yield from remote_metrics(self._engine)  # remote models (admin.monitoring.remote_metrics)
        breaker = GaugeMetricFamily(
            "infcache_l2_breaker_state", "L2 circuit breaker: 0 closed, 1 half-open, 2 open, -1 disabled"
        )
        breaker.add_metric([], BREAKER_VALUES.get(state["l2"].get("breaker") or "", -1))
        yield breaker
        yield GaugeMetricFamily("infcache_generation", "Current cache generation", value=state["generation"])
        seconds = CounterMetricFamily("infcache_model_seconds", "Seconds spent in model forward passes",
                                      labels=["task", "backend"])  # fmt: skip
        models = self._engine.models
        calls = CounterMetricFamily("infcache_model_calls", "Model forward passes", labels=["task"])
        for task, value in counters.model_seconds.items():
            backend = getattr(models.get(task), "backend", "torch")  # the one serving the task now
            seconds.add_metric([task, backend], value)
            calls.add_metric([task], counters.model_calls.get(task, 0))
        yield seconds
        yield calls
        yield batch_size_histogram(counters.batch_sizes)
        if self._writer is not None:
            writer = self._writer.stats()
            yield CounterMetricFamily("infcache_log_rows_dropped", "Request-log rows dropped",
                                      value=writer.dropped)  # fmt: skip
            yield GaugeMetricFamily(
                "infcache_log_queue_depth", "Request-log rows waiting", value=writer.queued
            )


def shadow_metrics(engine: InferenceEngine) -> Iterator[CounterMetricFamily]:
    """Shadow verification by task (absent when SHADOW_SAMPLE_RATE is 0)."""
    shadow = engine.shadow
    if shadow is None:
        return
    stats = shadow.stats()
    checks = CounterMetricFamily("infcache_shadow_checks", "Cache hits recomputed and compared",
                                 labels=["task"])  # fmt: skip
    mismatches = CounterMetricFamily("infcache_shadow_mismatches", "Shadow checks that disagreed (evicted)",
                                     labels=["task"])  # fmt: skip
    for task in engine.models:
        checks.add_metric([task], stats.checks.get(task, 0))
        mismatches.add_metric([task], stats.mismatches.get(task, 0))
    yield checks
    yield mismatches
    yield CounterMetricFamily("infcache_shadow_dropped", "Sampled hits not checked (model busy, queue full)",
                              value=stats.dropped)  # fmt: skip


def batch_size_histogram(batch_sizes: dict[str, dict[int, int]]) -> HistogramMetricFamily:
    """Inputs per forward pass, per task, from the engine's exact counts by size."""
    family = HistogramMetricFamily(
        "infcache_batch_size", "Inputs per model forward pass", labels=["task"]
    )
    for task, by_size in batch_sizes.items():
        buckets = [
            (str(bound), sum(n for size, n in by_size.items() if size <= bound))
            for bound in BATCH_SIZE_BUCKETS
        ]
        buckets.append(("+Inf", sum(by_size.values())))
        family.add_metric([task], buckets, sum_value=sum(size * n for size, n in by_size.items()))
    return family


class _RequestCounts(Collector):
    """Requests by (task, tier, status, route) and engine latency by tier, counted exactly under
    one lock and rendered at scrape time: the per-request cost is a few dict and list updates,
    about a fifth of prometheus_client's Counter.inc and Histogram.observe (its bucket search is
    a Python loop), on every cached hit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, str, str], int] = {}
        # Per tier: the count in each bucket (not cumulative), the last one +Inf, then the sum.
        self._latency: dict[str, list[float]] = {}

    def observe(self, record: RequestRecord) -> None:
        tier = record.tier or "none"
        key = (record.task, tier, record.status, record.route)
        seconds = record.latency_ms / 1000.0
        bucket = bisect_left(LATENCY_BUCKETS_S, seconds)  # the first bound >= seconds, as `le` means
        with self._lock:
            self._requests[key] = self._requests.get(key, 0) + 1
            counts = self._latency.get(tier)
            if counts is None:
                counts = self._latency[tier] = [0] * (len(LATENCY_BUCKETS_S) + 2)
            counts[bucket] += 1
            counts[-1] += seconds

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        with self._lock:
            requests = dict(self._requests)
            latency = {tier: list(counts) for tier, counts in self._latency.items()}
        family = CounterMetricFamily("infcache_requests", "Requests by task, tier, status and route",
                                     labels=["task", "tier", "status", "route"])  # fmt: skip
        for key, count in requests.items():
            family.add_metric(list(key), count)
        yield family
        histogram = HistogramMetricFamily("infcache_request_latency_seconds", "Engine latency by tier",
                                          labels=["tier"])  # fmt: skip
        for tier, counts in latency.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), counts[:-1], strict=True):
                cumulative += int(count)
                buckets.append((floatToGoString(bound), cumulative))
            histogram.add_metric([tier], buckets, sum_value=counts[-1])
        yield histogram


class Metrics:
    """Owns one registry. `observe` is the engine listener; `render` is the /metrics body."""

    def __init__(self, engine: InferenceEngine, writer: RequestLogWriter | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = _RequestCounts()
        self.registry.register(self._requests)
        self.registry.register(_CacheStateCollector(engine, writer))
        self.observe = self._requests.observe  # the listener: one call on every request

    def render(self) -> bytes:
        return generate_latest(self.registry)
