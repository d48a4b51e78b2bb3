"""The deployable fleet, checked offline with the real tools: the Kubernetes manifests render
with `kubectl kustomize` and pass `kubernetes-validate` (schemas inside the PyPI package);
`nginx -t` takes the nginx config; `promtool check config` takes Prometheus's; the Grafana
dashboard asks only for metrics the app exports; and the Redis eviction policy of the compose
file never evicts the generation (every key the app writes but the two counters has a TTL).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from admin.monitoring.device_health import cuda_available
from engine.errors import InvalidInputError
from storage.redis.embedded import EmbeddedRedis
from tests.conftest import CountingTextModel
from tests.test_packaging import venv_tool

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "inference-cache.json"


def system_tool(name: str, package: str) -> str:
    found = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.is_file()), None
    )
    if found is None:
        pytest.fail(f"`{name}` is not installed: `make test` installs it as root, or "
                    f"`apt-get install -y {package}`.")  # fmt: skip
    return found


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, **kwargs)


def validator() -> str:
    return venv_tool("kubernetes-validate", "kubernetes-validate")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


# --- Kubernetes ---------------------------------------------------------------------------


def kustomize(folder: Path, out: Path) -> tuple[Path, dict[str, dict[str, Any]]]:
    """`kubectl kustomize folder` written to out/rendered.yaml, and its resources by kind/name."""
    done = run([system_tool("kubectl", "kubernetes-client"), "kustomize", str(folder)])
    assert done.returncode == 0, f"kubectl kustomize failed:\n{done.stderr}"
    rendered = out / "rendered.yaml"
    rendered.write_text(done.stdout)
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return rendered, {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


@pytest.fixture(scope="module")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    return kustomize(DEPLOY / "k8s", tmp_path_factory.mktemp("k8s"))


def test_kustomize_output_passes_kubernetes_validate(k8s) -> None:
    rendered, resources = k8s
    done = run([validator(), "--strict", "--quiet", str(rendered)])
    assert done.returncode == 0, f"kubernetes-validate refused the manifests:\n{done.stdout}{done.stderr}"
    assert set(resources) >= {
        "Deployment/inference-cache", "Service/inference-cache", "Secret/inference-cache-secrets",
        "ConfigMap/inference-cache-settings",
    }  # fmt: skip


def test_kubernetes_validate_catches_a_bad_manifest(k8s, tmp_path: Path) -> None:
    """The check can fail: a misspelt field in the Service is refused."""
    rendered, _ = k8s
    bad = tmp_path / "bad.yaml"
    bad.write_text(rendered.read_text().replace("sessionAffinity: ClientIP", "sessionAfinity: ClientIP"))
    done = run([validator(), "--strict", "--quiet", str(bad)])
    assert done.returncode != 0 and "sessionAfinity" in done.stdout + done.stderr


def test_deployment_service_secret_and_configmap_fit_together(k8s) -> None:
    _, resources = k8s
    deployment = resources["Deployment/inference-cache"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    sources = {next(iter(s)): next(iter(s.values()))["name"] for s in container["envFrom"]}
    assert sources == {"configMapRef": "inference-cache-settings", "secretRef": "inference-cache-secrets"}
    replica_id = next(e for e in container["env"] if e["name"] == "REPLICA_ID")
    assert replica_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    secret = resources["Secret/inference-cache-secrets"]["stringData"]
    assert set(secret) == {"ADMIN_TOKEN", "DATABASE_URL"}
    assert secret["DATABASE_URL"].startswith("postgresql+psycopg://")
    settings = resources["ConfigMap/inference-cache-settings"]["data"]
    assert "ADMIN_TOKEN" not in settings and settings["REDIS_URL"].startswith("redis://")
    service = resources["Service/inference-cache"]["spec"]
    assert service["sessionAffinity"] == "ClientIP"
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}
    redis_pod = resources["Deployment/inference-cache-redis"]["spec"]["template"]["spec"]
    redis_args = redis_pod["containers"][0]["args"]
    assert redis_args[redis_args.index("--maxmemory-policy") + 1] == "volatile-lru"


# --- nginx, Prometheus, Grafana -----------------------------------------------------------


def test_nginx_config_passes_nginx_t(compose, tmp_path: Path) -> None:
    config = (DEPLOY / "nginx" / "nginx.conf").read_text()
    upstream = re.search(r"upstream app \{(.*?)\}", config, re.S)
    assert upstream and "ip_hash;" in upstream.group(1), "sticky by client address"
    servers = re.findall(r"server (\S+?):7860", upstream.group(1))
    assert sorted(servers) == sorted(s for s in compose["services"] if s.startswith("app"))
    # nginx -t resolves upstream names; the compose service names exist only inside compose.
    local = tmp_path / "nginx.conf"
    local.write_text(re.sub(r"server app\d+:7860", "server 127.0.0.1:7860", config))
    done = run([system_tool("nginx", "nginx"), "-t", "-c", str(local), "-p", str(tmp_path), "-e", "stderr"])
    assert done.returncode == 0, f"nginx -t refused the config:\n{done.stderr}"
    broken = tmp_path / "broken.conf"
    broken.write_text(local.read_text().replace("ip_hash;", "ip_hash"))
    assert run([system_tool("nginx", "nginx"), "-t", "-c", str(broken), "-p", str(tmp_path),
                "-e", "stderr"]).returncode != 0  # fmt: skip


def checkable_prometheus_config(tmp_path: Path) -> Path:
    """prometheus.yml with its rule files where this checkout has them (the container's
    /etc/prometheus/ paths exist only inside compose)."""
    path = DEPLOY / "prometheus" / "prometheus.yml"
    local = tmp_path / "prometheus.yml"
    local.write_text(path.read_text().replace("/etc/prometheus/", f"{path.parent}/"))
    return local


def test_prometheus_config_scrapes_every_replica(compose, tmp_path: Path) -> None:
    path = DEPLOY / "prometheus" / "prometheus.yml"
    checkable = str(checkable_prometheus_config(tmp_path))
    done = run([system_tool("promtool", "prometheus"), "check", "config", checkable])
    assert done.returncode == 0, f"promtool refused the config:\n{done.stdout}{done.stderr}"
    jobs = yaml.safe_load(path.read_text())["scrape_configs"]
    targets = {t: group["labels"]["replica"] for job in jobs for group in job["static_configs"]
               for t in group["targets"]}  # fmt: skip
    replicas = {f"{name}:7860": service["environment"]["REPLICA_ID"]
                for name, service in compose["services"].items() if name.startswith("app")}  # fmt: skip
    assert targets == replicas
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in (
        compose["services"]["prometheus"]["volumes"]
    )


@pytest.fixture(scope="module")
def exported_metrics(tmp_path_factory: pytest.TempPathFactory, base_settings) -> set[str]:
    """Every sample name a replica's /metrics shows after a little traffic (hits, misses, L2)."""
    from runtime import build_runtime

    data = tmp_path_factory.mktemp("metrics")
    server = EmbeddedRedis(data_dir=data / "redis", maxmemory_mb=16, save=False)
    url = server.start()
    try:
        # Shadow verification on: its counters exist only then (the dashboard and alerts watch them).
        settings = base_settings.changed(
            server__data_dir=data / "app", redis__url=url, quality__shadow_sample_rate=0.01,
        )
        with build_runtime(settings, models={"text": CountingTextModel()}) as runtime:
            for message in ["a question", "a question", "another"]:
                runtime.engine.classify("text", message)
            body = runtime.metrics.render().decode()
    finally:
        server.close()
    return {sample.name for family in text_string_to_metric_families(body) for sample in family.samples}


def test_dashboard_asks_only_for_exported_metrics(exported_metrics: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = {panel["title"]: [t["expr"] for t in panel["targets"]] for panel in dashboard["panels"]}
    every_expr = [expr for panel in exprs.values() for expr in panel]
    asked = {name for expr in every_expr for name in re.findall(r"\binfcache_\w+", expr)}
    if not cuda_available():  # GPU figures exist on CUDA only (admin.monitoring.health_metrics)
        asked = {name for name in asked if not name.startswith("infcache_gpu_")}
    assert asked and asked <= exported_metrics, f"not exported: {sorted(asked - exported_metrics)}"
    for expr in every_expr:  # nothing but the app's metrics
        assert re.findall(r"\binfcache_\w+", expr), expr
    wanted = {
        "hit rate": "infcache_requests_total", "requests by tier": "infcache_requests_total",
        "latency by tier": "infcache_request_latency_seconds_bucket",
        "model seconds": "infcache_model_seconds_total", "batch size": "infcache_batch_size",
        "l2 errors": "infcache_l2_errors_total", "breaker state": "infcache_l2_breaker_state",
    }  # fmt: skip
    for title_part, metric in wanted.items():
        panel = next((t for t in exprs if title_part in t.lower()), None)
        assert panel is not None, f"no panel for {title_part}"
        assert any(metric in e for e in exprs[panel]), (panel, exprs[panel])
    for title in ("L2 errors by replica", "L2 breaker state by replica"):
        assert all("by (replica)" in e for e in exprs[title])


def test_grafana_provisioning_points_at_the_dashboard(compose) -> None:
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/inference-cache.yml").read_text())
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    assert uids == {datasource["datasources"][0]["uid"]}
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert "prometheus" in compose["services"]
    mounts = dict(v.rsplit(":", 2)[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


# --- Redis eviction ----------------------------------------------------------------------


def test_compose_eviction_policy_never_evicts_the_generation(
    make_runtime, compose, redis_server: EmbeddedRedis
) -> None:
    """Every key the app writes has a TTL except the generation and the fleet's operation epoch;
    Redis under the compose file's policy, filled past maxmemory, evicts and keeps them."""
    command = compose["services"]["redis"]["command"]
    policy = command[command.index("--maxmemory-policy") + 1]
    runtime = make_runtime(models={"text": CountingTextModel(cheap=False)}, redis__url=redis_server.url)
    prefix = runtime.settings.cache.prefix
    runtime.admin.bump_version(actor="test")
    for i in range(40):
        runtime.engine.classify("text", f"message {i % 25}")
    with pytest.raises(InvalidInputError):
        runtime.engine.classify("text", "")  # a remembered rejection
    runtime.engine.flush("l1")
    runtime.engine.classify("text", "message 1")  # read back from L2
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = [k.decode() for k in client.scan_iter(count=1000)]
        without_ttl = {k for k in keys if client.ttl(k) < 0}
        assert len(keys) > 25, keys  # results, aliases, a rejection, the generation...
        assert without_ttl <= {f"{prefix}:meta:generation", f"{prefix}:meta:fleet_epoch"}, without_ttl
        assert f"{prefix}:meta:generation" in without_ttl
        generation = client.get(f"{prefix}:meta:generation")

        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 512 * 1024)
        client.config_set("maxmemory-policy", policy)
        filler = b"x" * 8192
        for i in range(400):  # 3 MB of cache-like entries (each with a TTL) into 0.5 MB of room
            client.set(f"{prefix}:text:filler:{i}", filler, ex=3600)
        assert int(client.info("stats")["evicted_keys"]) > 0
        assert client.get(f"{prefix}:meta:generation") == generation
        assert runtime.admin.bump_version(actor="test")["generation"] == int(generation) + 1
    finally:
        client.close()
