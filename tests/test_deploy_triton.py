"""The Triton variant of the deployable fleet, checked offline as the fleet is (tests/test_deploy.py):
the kustomize overlay deploy/triton renders with `kubectl kustomize` and passes
`kubernetes-validate`; docker-compose.triton.yml follows the Compose spec and, merged over
docker-compose.yml as `docker compose -f .. -f ..` merges it, makes CPU-only front ends of the
replicas whose MODELS_CONFIG points at the Triton service that serves the exported repository.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from engine.models.config import BACKENDS, load_config
from tests.test_deploy import kustomize, run, validator
from tests.test_packaging import check_compose_schema

ROOT = Path(__file__).resolve().parent.parent
OVERLAY = ROOT / "deploy" / "triton"
MODELS = OVERLAY / "models.yaml"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_TRITON = ROOT / "docker-compose.triton.yml"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:"


def remote_entries() -> list[dict[str, Any]]:
    entries = yaml.safe_load(MODELS.read_text())["models"]
    assert entries and all(e["backend"] == "remote" for e in entries)
    return entries


def test_the_models_file_sends_every_built_in_to_the_triton_service() -> None:
    entries = remote_entries()
    assert sorted(e["task"] for e in entries) == ["image", "text"]
    assert {urlsplit(e["remote_url"]).netloc for e in entries} == {"triton:8001"}
    assert {urlsplit(e["remote_url"]).scheme for e in entries} == {"grpc"}
    if "remote" in BACKENDS:  # the engine's own parser, where this checkout has the remote backend
        assert [s.task for s in load_config(MODELS)] == ["image", "text"]


# --- Kubernetes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def overlay(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    return kustomize(OVERLAY, tmp_path_factory.mktemp("k8s-triton"))


def test_the_overlay_passes_kubernetes_validate(overlay) -> None:
    rendered, resources = overlay
    done = run([validator(), "--strict", "--quiet", str(rendered)])
    assert done.returncode == 0, f"kubernetes-validate refused the manifests:\n{done.stdout}{done.stderr}"
    assert {"Deployment/inference-cache", "Deployment/triton", "Service/triton"} <= set(resources)


def test_triton_serves_the_repository_its_init_container_exports(overlay) -> None:
    _, resources = overlay
    pod = resources["Deployment/triton"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (server,) = pod["containers"]
    assert init["image"] == "inference-cache:latest"
    assert init["command"][:3] == ["python", "-m", "serving.repository"]
    repository = init["command"][3]
    exported = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    served = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert exported["models"] == repository == served["models"]
    assert f"--model-repository={repository}" in server["args"]
    assert server["image"].startswith(TRITON_IMAGE)
    assert server["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # The init container exports the models the front ends serve: the same models file.
    init_env = {e["name"]: e["value"] for e in init["env"]}
    config_volume = next(v for v in pod["volumes"] if v["name"] == "models-config")["configMap"]["name"]
    assert init_env["MODELS_CONFIG"] == f"{exported['models-config']}/models.yaml"
    models_map = resources[f"ConfigMap/{config_volume}"]["data"]["models.yaml"]
    assert yaml.safe_load(models_map) == yaml.safe_load(MODELS.read_text())
    # The Service reaches the gRPC port models.yaml names.
    service = resources["Service/triton"]["spec"]
    assert (
        service["selector"].items()
        <= resources["Deployment/triton"]["spec"]["template"]["metadata"]["labels"].items()
    )
    grpc = next(p for p in service["ports"] if p["name"] == "grpc")
    assert grpc["targetPort"] in {p["name"] for p in server["ports"]}
    assert {urlsplit(e["remote_url"]).port for e in remote_entries()} == {grpc["port"]}


def test_the_replicas_are_cpu_front_ends_reading_the_models_file(overlay) -> None:
    _, resources = overlay
    settings = resources["ConfigMap/inference-cache-settings"]["data"]
    assert settings["DEVICE"] == "cpu" and settings["REDIS_URL"].startswith("redis://")  # the base's, kept
    pod = resources["Deployment/inference-cache"]["spec"]["template"]["spec"]
    (app,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in app["volumeMounts"]}
    assert settings["MODELS_CONFIG"] == f"{mounts['models-config']}/models.yaml"
    assert mounts["data"] == "/data"  # the base's volume, kept
    config_volume = next(v for v in pod["volumes"] if v["name"] == "models-config")["configMap"]["name"]
    assert config_volume.startswith("inference-cache-models") and f"ConfigMap/{config_volume}" in resources
    assert "nvidia.com/gpu" not in app["resources"].get("limits", {})
    assert app["readinessProbe"]["httpGet"]["path"] == "/readyz"


# --- docker compose -----------------------------------------------------------------------


def merged(base: Any, override: Any) -> Any:
    """Compose's merge of two files, for what these files use: mappings merge key by key, a
    service's `volumes` by target path; other values are replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if key == "volumes" and isinstance(value, list) and isinstance(base.get(key), list):
                by_target = {v.split(":")[1]: v for v in base[key]}
                by_target.update({v.split(":")[1]: v for v in value})
                out[key] = list(by_target.values())
            else:
                out[key] = merged(base.get(key), value) if key in base else value
        return out
    return override


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return merged(yaml.safe_load(COMPOSE.read_text()), yaml.safe_load(COMPOSE_TRITON.read_text()))


def test_the_triton_compose_file_follows_the_compose_spec(tmp_path: Path, compose: dict[str, Any]) -> None:
    check_compose_schema(COMPOSE_TRITON)
    whole = tmp_path / "docker-compose.merged.yml"
    whole.write_text(yaml.safe_dump(compose))
    check_compose_schema(whole)


@pytest.mark.parametrize("replica", ["app1", "app2"])
def test_compose_replicas_are_cpu_front_ends_of_triton(compose: dict[str, Any], replica: str) -> None:
    app = compose["services"][replica]
    env = app["environment"]
    assert env["DEVICE"] == "cpu" and env["REPLICA_ID"] == f"app-{replica[-1]}"  # the base's env, kept
    assert env["REDIS_URL"].startswith("redis://")
    mounts = dict(v.split(":")[:2][::-1] for v in app["volumes"])
    assert mounts[env["MODELS_CONFIG"]] == "./deploy/triton/models.yaml"
    assert mounts["/data"] == f"{replica}-data"
    assert app["depends_on"]["triton"]["condition"] == "service_healthy"
    assert app["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "deploy" not in app, "the front ends ask for no GPU"


def test_compose_triton_serves_what_the_job_exports(compose: dict[str, Any]) -> None:
    services = compose["services"]
    job, triton = services["triton-repository"], services["triton"]
    assert job["command"][:3] == ["python", "-m", "serving.repository"]
    assert job["environment"]["MODELS_CONFIG"] == services["app1"]["environment"]["MODELS_CONFIG"]
    job_volume, job_path = next(v.split(":")[:2] for v in job["volumes"] if v.startswith("triton-models:"))
    served_volume, served_path = next(v.split(":")[:2] for v in triton["volumes"])
    assert job_volume == served_volume and job_volume in compose["volumes"]
    repository = job["command"][3]
    assert f"--model-repository={served_path}{repository.removeprefix(job_path)}" in triton["command"]
    assert triton["image"].startswith(TRITON_IMAGE)
    assert triton["depends_on"]["triton-repository"]["condition"] == "service_completed_successfully"
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    assert "triton" in {urlsplit(e["remote_url"]).hostname for e in remote_entries()}
