"""The model repository (serving.repository) served by a real tritonserver (serving/triton_serve.py,
through testing.triton_server), checked through the real tritonclient over HTTP and gRPC.

One repository of the built-in models and one server for the module (the server starts in
~15-20 s on 2 busy cores; the kill/start test pays a second start). The Triton venv is made on
first use (scripts/triton_venv.sh); a venv that cannot be made fails here with its message.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from engine.models.base import Prediction
from engine.models.config import DEFAULT_SPECS
from engine.models.onnx_backend import OnnxForward, compare, export_path, probe_digest
from engine.models.remote_client import version_folder
from runtime import load_options
from serving.repository import PARAMETERS, ExportedModel, graph_io, main, write_model, write_repository
from settings import Settings
from testing.triton_server import (
    SERVE_SCRIPT,
    BareTritonServer,
    TritonRepositoryServer,
    TritonSetupError,
    triton_python,
)

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def models(real_models: dict[str, Any]) -> dict[str, Any]:
    """The built-ins loaded as the app loads them (the session's; never changed here)."""
    return real_models


@pytest.fixture(scope="module")
def repository(
    tmp_path_factory: pytest.TempPathFactory, base_settings: Settings, models: dict[str, Any]
) -> tuple[Path, list[ExportedModel]]:
    """The built-ins' repository, from the models loaded above (the command loads them itself)."""
    folder = tmp_path_factory.mktemp("repository")
    return folder, write_repository(folder, DEFAULT_SPECS, load_options(base_settings), loaded=models)


@pytest.fixture(scope="module")
def server(repository: tuple[Path, list[ExportedModel]]) -> Iterator[TritonRepositoryServer]:
    try:
        with TritonRepositoryServer(repository[0]) as running:
            yield running
    except TritonSetupError as exc:
        pytest.fail(f"the Triton server did not start: {exc}")


@pytest.fixture(scope="module")
def local_passes(repository: tuple[Path, list[ExportedModel]]) -> dict[str, OnnxForward]:
    """ONNX Runtime sessions of the repository's graphs, in this process (the reference)."""
    folder = repository[0]
    return {m.task: OnnxForward(folder / m.task / version_folder(m.model_version) / "model.onnx", threads=1)
            for m in repository[1]}  # fmt: skip


def parsed_config(folder: Path) -> Any:
    """config.pbtxt parsed with Triton's own ModelConfig protobuf (what tritonserver parses)."""
    return text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def test_the_repository_holds_the_exported_graph_and_the_app_s_versions(
    repository: tuple[Path, list[ExportedModel]], models: dict[str, Any], base_settings: Settings
) -> None:
    folder, written = repository
    assert sorted(p.name for p in folder.iterdir()) == ["image", "text"]  # nothing left beside them
    for exported in written:
        model = models[exported.task]
        config = parsed_config(folder / exported.task)
        assert (config.name, config.platform, config.max_batch_size) == (
            exported.task,
            "onnxruntime_onnx",
            32,
        )
        assert config.dynamic_batching.max_queue_delay_microseconds > 0
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        assert sorted(parameters) == sorted(PARAMETERS)
        assert parameters["cache_model_version"] == model.version
        probe = json.loads(parameters["cache_probe"])
        assert probe["tag"] == probe_digest(model.probe_inputs()) and len(probe["answers"]) >= 3
        assert json.loads(parameters["cache_export_state"]) == model.export_state()
        # The graph is the ONNX Runtime backend's own export, byte for byte, and the config names its I/O.
        graph = (folder / exported.task / version_folder(model.version) / "model.onnx").read_bytes()
        assert graph == export_path(base_settings.export_dir, model.name, model.version).read_bytes()
        inputs, outputs, metadata = graph_io(graph)
        assert metadata["model_version"] == model.version and metadata["probe"] == parameters["cache_probe"]
        assert [
            (i.name, model_config_pb2.DataType.Name(i.data_type), tuple(i.dims)) for i in config.input
        ] == [(t.name, t.data_type, t.dims) for t in inputs]
        assert [o.name for o in config.output] == ["output"] == [t.name for t in outputs]
    image, text = (parsed_config(folder / task) for task in ("image", "text"))
    assert [tuple(i.dims) for i in image.input] == [(3, 224, 224)] and tuple(image.output[0].dims) == (1000,)
    assert [i.name for i in text.input] == ["input_ids", "position_ids", "segment_ids"]  # GRAPH_INPUTS
    assert {model_config_pb2.DataType.Name(i.data_type) for i in text.input} == {"TYPE_INT64"}
    assert tuple(text.output[0].dims) == (-1, 384)


def test_writing_again_replaces_a_model_folder_cleanly(
    tmp_path: Path, repository: tuple[Path, list[ExportedModel]]
) -> None:
    image = next(m for m in repository[1] if m.task == "image")
    write_model(tmp_path, image)
    (tmp_path / "image" / "2").mkdir()  # a stale version folder an older export left
    (tmp_path / "image" / "2" / "model.onnx").write_bytes(b"stale")
    (tmp_path / "other").mkdir()  # another model: not ours to touch
    write_model(tmp_path, dataclasses.replace(image, model_version="0123456789abcdef"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image", "other"]  # no staging or old folder left
    # One version folder, the digest of the new version (calls pin it: the old number is gone).
    assert sorted(p.name for p in (tmp_path / "image").iterdir()) == sorted(
        [version_folder("0123456789abcdef"), "config.pbtxt"]
    )
    assert (
        parsed_config(tmp_path / "image").parameters["cache_model_version"].string_value == "0123456789abcdef"
    )


def test_tritonserver_itself_loads_the_repository_as_written(
    repository: tuple[Path, list[ExportedModel]], models: dict[str, Any], local_passes: dict[str, OnnxForward]
) -> None:
    """Triton parses and checks each config.pbtxt as written (platform onnxruntime_onnx, the I/O,
    batching, parameters); the pip tritonserver has no ONNX Runtime backend library, so a
    Python-based stand-in named `onnxruntime` runs the graphs (testing/triton_onnx_stand_in.py)."""
    bare = BareTritonServer(repository[0])
    try:
        bare.start()
    except TritonSetupError as exc:
        bare.close()
        pytest.fail(f"tritonserver did not load the repository: {exc}")
    client = triton_http.InferenceServerClient(bare.http_address)
    try:
        for task, model in models.items():
            config = client.get_model_config(task)
            assert (config["platform"], config["backend"], config["max_batch_size"]) == (
                "onnxruntime_onnx", "onnxruntime", 32,
            )  # fmt: skip
            assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
            assert config["parameters"]["cache_model_version"]["string_value"] == model.version
        pixels = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
        tensor = triton_http.InferInput("pixels", [2, 3, 224, 224], "FP32")
        tensor.set_data_from_numpy(pixels)
        served = client.infer("image", [tensor]).as_numpy("output")
        expected = local_passes["image"]({"pixels": torch.from_numpy(pixels)}).numpy()
        assert np.abs(served - expected).max() <= TOLERANCE
    finally:
        client.close()
        bare.close()


def test_the_server_s_config_carries_the_app_s_versions(
    server: TritonRepositoryServer, models: dict[str, Any]
) -> None:
    http = triton_http.InferenceServerClient(server.http_address)
    grpc = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        for task, model in models.items():
            assert http.is_model_ready(task) and grpc.is_model_ready(task)
            by_http = http.get_model_config(task)["parameters"]
            by_grpc = grpc.get_model_config(task, as_json=True)["config"]["parameters"]
            for parameters in (by_http, by_grpc):
                assert parameters["cache_model_version"]["string_value"] == model.version
                assert json.loads(parameters["cache_probe"]["string_value"])["tag"] == probe_digest(
                    model.probe_inputs()
                )
            assert http.get_model_config(task)["max_batch_size"] == 32
            # The Triton version is the digest folder the remote backend pins in its calls.
            served = version_folder(model.version)
            assert http.get_model_metadata(task)["versions"] == [served]
            assert grpc.get_model_metadata(task, as_json=True)["versions"] == [served]
    finally:
        http.close()
        grpc.close()


class ServedForward:
    """A model's forward pass sent to the server (an OnnxForward's call shape), each output also
    computed by the local ONNX Runtime session of the same graph: the largest difference is kept."""

    def __init__(self, client: Any, protocol: Any, task: str, local: OnnxForward) -> None:
        self.client, self.protocol, self.task, self.local = client, protocol, task, local
        self.inputs = local.inputs
        self.worst = 0.0
        self.calls = 0

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        arrays = {name: tensors[name].detach().cpu().numpy() for name in self.inputs}
        inputs = []
        for name, array in arrays.items():
            kind = "FP32" if array.dtype == np.float32 else "INT64"
            tensor = self.protocol.InferInput(name, list(array.shape), kind)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        served = self.client.infer(self.task, inputs).as_numpy("output")
        here = self.local(tensors).numpy()
        assert served.shape == here.shape and served.dtype == np.float32
        self.worst = max(self.worst, float(np.abs(served - here).max()))
        self.calls += 1
        return torch.from_numpy(served.copy())


@pytest.mark.parametrize("protocol", [triton_http, triton_grpc], ids=["http", "grpc"])
def test_served_answers_equal_the_local_pass_and_the_recorded_torch_answers(
    server: TritonRepositoryServer, models: dict[str, Any], repository: tuple[Path, list[ExportedModel]],
    local_passes: dict[str, OnnxForward], protocol: Any,
) -> None:  # fmt: skip
    address = server.http_address if protocol is triton_http else server.grpc_address
    client = protocol.InferenceServerClient(address)
    try:
        for task, model in models.items():
            forward = ServedForward(client, protocol, task, local_passes[task])
            probes = model.probe_inputs()
            model = copy.copy(model)  # its own forward pass; the session's model keeps its own
            model.use_onnx(forward)
            answers = [a for item in probes for a in model.predict_batch([item])]
            together = model.predict_batch(list(probes))  # one request of several rows
            assert forward.calls >= len(probes) and forward.worst <= TOLERANCE, (task, forward.worst)
            recorded = json.loads(parsed_config(repository[0] / task).parameters["cache_probe"].string_value)
            torch_answers = [Prediction.from_plain(a) for a in recorded["answers"]]
            assert compare(torch_answers[: len(probes)], answers) is None
            # torch's answers to the probes as one pass, where the model batches its misses
            torch_together = torch_answers[len(probes) :] or torch_answers
            assert compare(torch_together, together) is None
    finally:
        client.close()


def image_input(rows: int = 1, value: float = 0.0) -> Any:
    tensor = triton_http.InferInput("pixels", [rows, 3, 224, 224], "FP32")
    tensor.set_data_from_numpy(np.full((rows, 3, 224, 224), value, dtype=np.float32))
    return tensor


def test_concurrent_requests_reach_the_callable_in_fewer_batches(server: TritonRepositoryServer) -> None:
    before = server.counts()
    n = 16
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def one(index: int) -> None:
        client = triton_http.InferenceServerClient(server.http_address)
        try:
            start.wait()
            assert client.infer("image", [image_input(value=index / n)]).as_numpy("output").shape == (1, 1000)
        except BaseException as exc:  # reported below, from the test's thread
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    after = server.counts()
    rows = after["rows"]["image"] - before["rows"]["image"]
    batches = after["batches"]["image"] - before["batches"]["image"]
    assert rows == n and after["requests"]["image"] - before["requests"]["image"] == n
    assert batches < rows, f"{rows} concurrent requests ran as {batches} batches: the batcher did not batch"


def test_garbage_and_delay_switches(server: TritonRepositoryServer) -> None:
    client = triton_http.InferenceServerClient(server.http_address)
    try:
        server.set_garbage("nan")
        assert np.isnan(client.infer("image", [image_input()]).as_numpy("output")).all()
        server.set_garbage("shape")
        assert client.infer("image", [image_input(2)]).as_numpy("output").shape == (2, 999)
        server.set_garbage(None)
        assert np.isfinite(client.infer("image", [image_input()]).as_numpy("output")).all()
        server.set_delay(0.4)
        started = time.perf_counter()
        client.infer("image", [image_input()])
        assert time.perf_counter() - started >= 0.4
        server.set_delay(0)
        with pytest.raises(TritonSetupError, match="garbage mode"):
            server.set_garbage("zeros")
        with pytest.raises(TritonSetupError, match="delay seconds"):
            server.set_delay(-1)
    finally:
        client.close()


def test_killed_and_started_again_on_the_same_ports(
    server: TritonRepositoryServer, models: dict[str, Any]
) -> None:
    client = triton_http.InferenceServerClient(server.http_address)
    try:
        server.kill()
        assert not server.running()
        with pytest.raises(Exception):  # noqa: B017 - refused connection, whatever tritonclient wraps it in
            client.infer("image", [image_input()])
        server.start()
        assert client.infer("image", [image_input()]).as_numpy("output").shape == (1, 1000)
        assert server.calls() == {"image": 1, "text": 0}  # counted since this start
        assert client.get_model_config("text")["parameters"]["cache_model_version"]["string_value"] == (
            models["text"].version
        )
    finally:
        client.close()


def test_sigterm_stops_the_server_cleanly(server: TritonRepositoryServer) -> None:
    """Last of the module's server tests: SIGTERM (Ctrl-C's twin, what `docker stop` and
    Kubernetes send) unloads the models, stops tritonserver and exits 0, leaving no process and
    no shared memory behind."""
    client = triton_http.InferenceServerClient(server.http_address)
    try:
        client.infer("image", [image_input()])  # the data plane's shared memory is in use
    finally:
        client.close()
    segments = server.shared_memory()
    group = psutil.Process(server.pid).children(recursive=True)
    assert segments and any(p.name() == "tritonserver" for p in group)
    assert server.stop() == 0
    assert not server.running() and not psutil.wait_procs(group, timeout=10)[1]
    assert server.left_behind() == set(), "a clean stop left shared memory behind"
    assert not [p for p in segments if p.exists()]
    assert "stopped" in server.log_tail(3)


def test_the_serve_script_refuses_a_bad_repository_with_a_message(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.pbtxt").write_text('name: "bad" max_batch_size: [')
    done = subprocess.run([str(triton_python()), str(SERVE_SCRIPT), "--repository", str(tmp_path),
                           "--http-port", "1"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "bad/config.pbtxt" in done.stderr and "Traceback" not in done.stderr


def test_the_command_writes_the_tasks_of_models_config(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    models: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - task: photo\n    kind: image-classification\n"
                      "    source: builtin:efficientnet-lite0\n    max_batch: 8\n")  # fmt: skip
    monkeypatch.setenv("MODELS_CONFIG", str(config))
    assert main([str(tmp_path / "repo")]) == 0
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["photo"]
    written = parsed_config(tmp_path / "repo" / "photo")
    assert (written.name, written.max_batch_size) == ("photo", 8)
    assert written.parameters["cache_model_version"].string_value == models["image"].version
    assert f"cache_model_version {models['image'].version}" in capsys.readouterr().out


def test_the_command_refuses_a_bad_models_config_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MODELS_CONFIG", str(tmp_path / "missing.yaml"))
    assert main([str(tmp_path / "repo")]) == 1
    assert "MODELS_CONFIG" in caplog.text and "Traceback" not in caplog.text
    assert not (tmp_path / "repo").exists()
