"""Shared fixtures. Tests own what they start: every server and engine is closed here."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ModelError
from engine.inputs import CanonicalText, clean_text
from engine.models.base import Prediction
from runtime import Runtime, build_runtime, load_models
from settings import Settings
from storage.redis.embedded import EmbeddedRedis, free_port

SKIMAGE_PHOTOS = ("chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_right.png")


@pytest.fixture(scope="session")
def photo_dir() -> Path:
    import skimage

    return Path(skimage.__file__).parent / "data"


@pytest.fixture(scope="session")
def photo_bytes(photo_dir: Path) -> Callable[[str], bytes]:
    return lambda name: (photo_dir / name).read_bytes()


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is not installed: these tests need a real Redis. "
            "Run `make test` (installs it as root) or `apt-get install -y redis-server`."
        )
    return binary


@pytest.fixture
def redis_server(redis_binary: str, tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A private redis-server on a free loopback port, stopped after the test."""
    server = EmbeddedRedis(
        data_dir=tmp_path / "redis-under-test", maxmemory_mb=64, binary=redis_binary,
        port=free_port(), save=False,
    )  # fmt: skip
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """One real PostgreSQL server for the session (Debian's binaries, a temp cluster, a free
    loopback port); tests take a fresh database each from `database_url`."""
    from testing.postgres_server import PostgresServer, PostgresUnavailable

    try:
        server = PostgresServer().start()
    except PostgresUnavailable as exc:
        pytest.fail(str(exc))
    yield server
    server.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty request-log database on each backend: an SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'requests.sqlite3'}"
    import uuid

    return request.getfixturevalue("postgres_server").create_database(f"t_{uuid.uuid4().hex[:16]}")


@pytest.fixture(scope="session", autouse=True)
def onnx_export_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One ONNX export cache for the session (engine.models.onnx_backend): every runtime and
    every `python app.py` the tests start reuses the export instead of paying it again."""
    import os

    folder = tmp_path_factory.mktemp("onnx")
    before = os.environ.get("ONNX_EXPORT_DIR")
    os.environ["ONNX_EXPORT_DIR"] = str(folder)  # inherited by the app processes tests start
    yield folder
    if before is None:
        os.environ.pop("ONNX_EXPORT_DIR", None)
    else:
        os.environ["ONNX_EXPORT_DIR"] = before


@pytest.fixture(scope="session")
def base_settings(tmp_path_factory: pytest.TempPathFactory, onnx_export_dir: Path) -> Settings:
    return Settings.from_env({}).changed(
        models__onnx_export_dir=onnx_export_dir,
        server__data_dir=tmp_path_factory.mktemp("data"),
        redis__url="off",
        redis__socket_timeout_s=0.2,
        redis__breaker_reset_s=0.5,
        fleet__generation_refresh_s=0.2,
        # Off: a sampled hit would run the stand-in models' predict_batch again and move their
        # call counts; tests of shadow verification turn it on.
        quality__shadow_sample_rate=0.0,
    )


@pytest.fixture(scope="session")
def real_models(base_settings: Settings) -> dict[str, Any]:
    """The two real models, loaded once for the whole session, as the app serves them (its
    default INFERENCE_BACKEND: onnxruntime on the CPU)."""
    return load_models(base_settings)


@pytest.fixture(scope="session")
def torch_models(base_settings: Settings) -> dict[str, Any]:
    """The same two models on plain torch (the benchmarks' baselines, the backend's reference)."""
    return load_models(base_settings.changed(models__inference_backend="torch"))


class CountingTextModel:
    """A tiny deterministic stand-in for unit tests where the model is not the subject.

    Scores depend only on the text, so every tier must return identical outputs.
    `fail_next` makes the next call raise (a model failure, not the input's fault).
    """

    task = "text"
    name = "stand-in"
    device = "cpu"
    cheap_canonicalize = True

    def __init__(self, version: str = "standin-v1", delay_s: float = 0.0, *, cheap: bool = True) -> None:
        import threading

        # cheap=False: behave like the image model, whose raw-input aliases go to Redis too.
        self.cheap_canonicalize = cheap
        self.version = version
        self.calls = 0
        self.delay_s = delay_s
        self.fail_next = False
        self._lock = threading.Lock()

    def canonicalize(self, raw: Any) -> CanonicalText:
        return clean_text(raw, max_chars=200)

    def predict_batch(self, inputs: Sequence[CanonicalText]) -> list[Prediction]:
        import time
        import zlib

        with self._lock:
            self.calls += 1
            fail, self.fail_next = self.fail_next, False
        if self.delay_s:
            time.sleep(self.delay_s)
        if fail:
            raise RuntimeError("simulated CUDA out of memory")
        out = []
        for item in inputs:
            seed = zlib.crc32(item.text.encode())
            a = (seed % 1000) / 1000.0
            out.append(Prediction((("alpha", 1.0 - a / 2), ("beta", a / 2))))
        return out


class FailingModel(CountingTextModel):
    def predict_batch(self, inputs: Sequence[CanonicalText]) -> list[Prediction]:
        with self._lock:
            self.calls += 1
        raise ModelError("the stand-in model always fails")


@pytest.fixture
def make_runtime(base_settings: Settings, tmp_path: Path) -> Iterator[Callable[..., Runtime]]:
    """Build runtimes (engine + stores) with setting overrides; all closed at teardown."""
    built: list[Runtime] = []

    def factory(*, models: dict[str, Any] | None = None, **overrides: Any) -> Runtime:
        settings = base_settings.changed(server__data_dir=tmp_path / f"rt{len(built)}", **overrides)
        runtime = build_runtime(settings, models=models or {"text": CountingTextModel()})
        built.append(runtime)
        return runtime

    yield factory
    for runtime in reversed(built):
        runtime.close()


@pytest.fixture
def serve(make_runtime: Callable[..., Runtime]) -> Iterator[Callable[..., tuple[str, Runtime]]]:
    """Serve apps built from `make_runtime(**args)` on free ports; all stopped at teardown."""
    from ui.server import serve_runtime

    servers: list[Any] = []

    def start(**runtime_args: Any) -> tuple[str, Runtime]:
        runtime = make_runtime(**runtime_args)
        server = serve_runtime(runtime, port=free_port())  # the path `make run` serves
        servers.append(server)
        return server.url, runtime

    yield start
    for server in servers:
        server.close()


@pytest.fixture(scope="session")
def triton_repository(tmp_path_factory: pytest.TempPathFactory, base_settings: Settings) -> Path:
    """The built-in models' Triton/KServe repository as `make triton-repository` writes it (files
    only: each module that needs a server starts its own, testing.triton_server)."""
    from engine.models.config import DEFAULT_SPECS
    from runtime import load_options
    from serving.repository import write_repository

    folder = tmp_path_factory.mktemp("triton-repository")
    write_repository(folder, DEFAULT_SPECS, load_options(base_settings))
    return folder


@pytest.fixture(scope="module")
def remote_model(base_settings: Settings) -> Iterator[Callable[..., Any]]:
    """`remote_model(task, url, **remote_options)`: a built-in served through an OIP server, built as
    the loader builds a `backend: remote` entry (short backoff, so that tests wait for the breaker
    and the background check, never for defaults; a call's timeout long enough for a busy machine,
    a test of timeouts sets its own); all closed at the module's end."""
    from dataclasses import replace

    from engine.models.config import DEFAULT_SPECS, ModelSpec
    from engine.models.loader import build_model
    from engine.models.remote import RemoteOptions
    from runtime import load_options

    fast = RemoteOptions(connect_timeout_s=0.5, timeout_s=10.0, breaker_failures=1, breaker_reset_s=0.2,
                         breaker_max_s=1.0)  # fmt: skip
    built: list[Any] = []

    def build(task: str, url: str, *, exports: bool = True, **options: Any) -> Any:
        """`exports=False`: no local ONNX export to take torch's recorded probe answers from (torch
        computes them)."""
        spec = next(s for s in DEFAULT_SPECS if s.task == task)
        spec = ModelSpec(task=spec.task, kind=spec.kind, source=spec.source, backend="remote", remote_url=url)
        loading = replace(load_options(base_settings), remote=replace(fast, **options))
        model = build_model(spec, loading if exports else replace(loading, export_dir=None))
        built.append(model)
        return model

    yield build
    for model in built:
        model.close()
