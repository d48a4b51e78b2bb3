"""Redis and device health: INFO of every primary (storage.redis.health) in `/metrics`, the
admin API and its warnings, on a real Redis with a maxmemory, one without, and a 3-primary
cluster; GPU figures present on CUDA and absent (and said so) on the CPU."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from admin.insights.charts import gpu_figure, health_html
from admin.monitoring.device_health import NO_CUDA, DeviceMonitor, GpuSample, cuda_available
from admin.monitoring.health_metrics import gpu_metrics
from storage.redis.embedded import EmbeddedRedis
from testing.redis_servers import LocalCluster
from tests.conftest import CountingTextModel
from tests.test_sizing import TOKEN, get

pytestmark = pytest.mark.redis
MIB = 2**20


def metric_samples(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def fill(client: redis.Redis, share: float) -> None:
    """Write 256 KiB values (not under the app's prefix: Redis memory is Redis's) until
    used_memory reaches `share` of maxmemory, or Redis starts evicting."""
    blob = b"x" * (256 * 1024)
    limit = int(client.config_get("maxmemory")["maxmemory"])
    i = 0
    while int(client.info("memory")["used_memory"]) < share * limit and i < 2000:
        if int(client.info("stats")["evicted_keys"]):
            return
        with client.pipeline(transaction=False) as pipe:
            for _ in range(8):
                pipe.set(f"ballast:{i}", blob)
                i += 1
            pipe.execute()


def test_memory_limit_policy_evictions_in_metrics_and_warnings(serve, redis_server: EmbeddedRedis) -> None:
    url, runtime = serve(
        models={"text": CountingTextModel()}, redis__url=redis_server.url, server__admin_token=TOKEN,
    )
    runtime.engine.classify("text", "hello")
    client = redis.Redis.from_url(redis_server.url)
    try:
        status, body = get(url + "/admin/api/health")
        assert status == 200
        (node,) = body["redis"]["nodes"]
        assert node["up"] and node["maxmemory"] == 64 * MIB and node["policy"] == "allkeys-lru"
        assert node["fill"] < 0.7 and body["redis"]["warnings"] == []
        fill(client, 0.75)  # past 70 % of 64 MiB
        status, body = get(url + "/admin/api/health")
        (node,) = body["redis"]["nodes"]
        assert node["fill"] >= 0.7 and node["evicted_keys"] == 0
        assert any("% of its 67.1 MB limit is used" in w for w in body["redis"]["warnings"]), body
        fill(client, 1.5)  # past the limit: allkeys-lru evicts (used memory stays at the limit)
        samples = metric_samples(url)
        node_label = (("node", node["node"]),)
        assert samples["infcache_redis_maxmemory_bytes"][node_label] == 64 * MIB
        assert samples["infcache_redis_used_memory_bytes"][node_label] <= 64 * MIB * 1.05
        assert samples["infcache_redis_evicted_keys_total"][node_label] > 0
        assert samples["infcache_redis_up"][node_label] == 1
        assert samples["infcache_redis_maxmemory_policy"][(*node_label, ("policy", "allkeys-lru"))] == 1

        client.config_set("maxmemory", 0)  # no limit: the allkeys-LRU defence is off, and said so
        status, body = get(url + "/admin/api/health")
        assert any("no maxmemory limit is set" in w and "allkeys-LRU defence is off" in w
                   for w in body["redis"]["warnings"]), body  # fmt: skip
        assert metric_samples(url)["infcache_redis_maxmemory_bytes"][node_label] == 0
        sizing = get(url + "/admin/api/sizing?window=5m")[1]
        assert sizing["tasks"]["text"]["l2"]["limit_set"] is False
    finally:
        client.close()


def test_without_l2_there_is_no_redis_to_watch(serve) -> None:
    url, _ = serve(models={"text": CountingTextModel()}, redis__url="off", server__admin_token=TOKEN)
    status, body = get(url + "/admin/api/health")
    assert status == 200 and body["redis"] == {"enabled": False, "warn_ratio": 0.7}
    assert not any(name.startswith("infcache_redis_") for name in metric_samples(url))


def test_gpu_figures_on_cuda_and_a_plain_statement_on_the_cpu(serve) -> None:
    url, _ = serve(models={"text": CountingTextModel()}, redis__url="off", server__admin_token=TOKEN)
    gpu = get(url + "/admin/api/health")[1]["gpu"]
    gpu_metrics = {n for n in metric_samples(url) if n.startswith("infcache_gpu_")}
    if cuda_available():
        assert gpu["enabled"] and gpu["devices"] and gpu["devices"][0]["memory_total_bytes"] > 0
        assert {"infcache_gpu_memory_used_bytes", "infcache_gpu_memory_total_bytes"} <= gpu_metrics
    else:
        assert gpu == {"enabled": False, "note": NO_CUDA, "devices": [], "trend": []}
        assert gpu_metrics == set()


@pytest.fixture(scope="module")
def cluster(redis_binary: str) -> Iterator[LocalCluster]:
    with LocalCluster(maxmemory_mb=32) as local:
        yield local


def test_every_primary_of_a_cluster_is_reported(serve, cluster: LocalCluster) -> None:
    url, runtime = serve(
        models={"text": CountingTextModel()}, redis__url=cluster.url, server__admin_token=TOKEN,
    )
    for i in range(30):
        runtime.engine.classify("text", f"spread {i}")
    nodes = {f"127.0.0.1:{port}" for port in cluster.ports}
    body = get(url + "/admin/api/health")[1]
    assert {n["node"] for n in body["redis"]["nodes"]} == nodes
    assert all(n["up"] and n["maxmemory"] == 32 * MIB for n in body["redis"]["nodes"])
    samples = metric_samples(url)
    for name in ("infcache_redis_used_memory_bytes", "infcache_redis_maxmemory_bytes",
                 "infcache_redis_evicted_keys_total", "infcache_redis_expired_keys_total"):  # fmt: skip
        assert {dict(labels)["node"] for labels in samples[name]} == nodes, name
    sizing = get(url + "/admin/api/sizing?window=1h")[1]
    assert sizing["overall"]["l2"]["current_bytes"] == 3 * 32 * MIB  # the cluster's memory together


def sample(utilization: float | None, used_gb: float) -> GpuSample:
    return GpuSample(device="cuda:0", name="NVIDIA H200", utilization=utilization,
                     memory_used_bytes=int(used_gb * 1e9), memory_total_bytes=int(140e9),
                     torch_allocated_bytes=int(1e9))  # fmt: skip


def test_gpu_samples_become_metrics_a_trend_and_cards() -> None:
    """What a CUDA replica shows, from samples as read_gpus returns them (this suite's CPU has none)."""
    families = {f.name: f for f in gpu_metrics([sample(0.42, 14.0)])}
    assert families["infcache_gpu_utilization_ratio"].samples[0].value == 0.42
    assert families["infcache_gpu_memory_used_bytes"].samples[0].labels == {"device": "cuda:0"}
    assert "infcache_gpu_utilization_ratio" not in {f.name for f in gpu_metrics([sample(None, 1.0)])}
    assert list(gpu_metrics([])) == []

    readings = iter([[sample(0.1, 10.0)], [sample(0.9, 70.0)]])
    monitor = DeviceMonitor(period_s=0.05, reader=lambda: next(readings, [sample(0.5, 50.0)]),
                            cuda=lambda: True)  # fmt: skip
    try:
        monitor.start()
        deadline = time.monotonic() + 5
        while len(monitor.trend()) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        monitor.close()
    trend = monitor.trend()
    assert [p["gpus"][0]["utilization"] for p in trend[:2]] == [0.1, 0.9]
    gpu = {"enabled": True, "note": None, "devices": trend[-1]["gpus"], "trend": trend}
    figure = gpu_figure(gpu)
    assert [trace.name for trace in figure.data] == ["cuda:0 busy", "cuda:0 memory"]
    assert list(figure.data[0].y[:2]) == [10.0, 90.0] and list(figure.data[1].y[:2]) == [10.0 / 1.4, 50.0]
    cards = health_html({"redis": {"enabled": False}, "gpu": gpu})
    assert "cuda:0 NVIDIA H200" in cards and "50 % busy" in cards
    assert DeviceMonitor(cuda=lambda: False).start().trend() == []  # the CPU: no thread, no trend
