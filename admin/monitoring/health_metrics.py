"""Redis memory per primary and GPU figures for `/metrics`, read at scrape time.

Redis: `infcache_redis_used_memory_bytes`, `infcache_redis_maxmemory_bytes` (0: no limit),
`infcache_redis_evicted_keys_total`, `infcache_redis_expired_keys_total`, `infcache_redis_up`
and `infcache_redis_maxmemory_policy` (1 for the policy in use), each by `node`; absent without
L2. GPU (CUDA only; absent on the CPU): `infcache_gpu_utilization_ratio` (without NVML absent),
`infcache_gpu_memory_used_bytes`, `infcache_gpu_memory_total_bytes`,
`infcache_gpu_torch_allocated_bytes`, by `device`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from admin.monitoring.device_health import GpuSample, read_gpus
from engine.pipeline.service import InferenceEngine
from storage.redis.health import read_health


def _gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def redis_metrics(engine: InferenceEngine) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    store = engine.l2_store()
    if store is None:
        return
    nodes = read_health(store)
    up = _gauge("infcache_redis_up", "Whether the Redis primary answered INFO", "node")
    used = _gauge("infcache_redis_used_memory_bytes", "Redis used_memory", "node")
    limit = _gauge("infcache_redis_maxmemory_bytes", "Redis maxmemory (0: no limit)", "node")
    policy = _gauge("infcache_redis_maxmemory_policy", "Redis maxmemory-policy in use (1)", "node", "policy")
    evicted = CounterMetricFamily("infcache_redis_evicted_keys", "Keys evicted for memory", labels=["node"])
    expired = CounterMetricFamily("infcache_redis_expired_keys", "Keys expired (TTL)", labels=["node"])
    for n in nodes:
        up.add_metric([n.node], 1 if n.up else 0)
        if not n.up:
            continue
        used.add_metric([n.node], n.used_memory or 0)
        limit.add_metric([n.node], n.maxmemory or 0)
        policy.add_metric([n.node, n.policy or ""], 1)
        evicted.add_metric([n.node], n.evicted_keys or 0)
        expired.add_metric([n.node], n.expired_keys or 0)
    yield from (up, used, limit, policy, evicted, expired)


def gpu_metrics(gpus: list[GpuSample] | None = None) -> Iterator[GaugeMetricFamily]:
    """`gpus`: samples already read (the default reads them now); none on the CPU."""
    gpus = read_gpus() if gpus is None else gpus
    if not gpus:
        return
    families = {
        "memory_used_bytes": _gauge("infcache_gpu_memory_used_bytes", "GPU memory in use (all processes)",
                                    "device"),
        "memory_total_bytes": _gauge("infcache_gpu_memory_total_bytes", "GPU memory", "device"),
        "torch_allocated_bytes": _gauge("infcache_gpu_torch_allocated_bytes",
                                        "GPU memory held by this process's tensors", "device"),
    }  # fmt: skip
    utilization = _gauge("infcache_gpu_utilization_ratio", "GPU busy share (NVML)", "device")
    for g in gpus:
        for name, family in families.items():
            family.add_metric([g.device], getattr(g, name))
        if g.utilization is not None:
            utilization.add_metric([g.device], g.utilization)
    yield from families.values()
    if any(g.utilization is not None for g in gpus):
        yield utilization
