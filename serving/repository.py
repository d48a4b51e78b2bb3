"""The Triton/KServe model repository of the served models: `python -m serving.repository DIR`
(`make triton-repository DIR=..`).

The models are loaded as the app loads them (settings from the environment, MODELS_CONFIG or the
built-ins), on the CPU with the ONNX Runtime backend, so the graph is the one that backend
exports and keeps in the export dir (engine.models.onnx_backend, reused when it is there),
probe-checked as the app checks it. For each task:

    DIR/<task>/config.pbtxt      platform onnxruntime_onnx, the graph's inputs and output
                                 (the batch axis implicit), dynamic batching, and parameters
                                 cache_model_version, cache_probe, cache_export_state
    DIR/<task>/1/model.onnx      the exported graph, byte for byte

`cache_model_version` is the model version this app puts in its cache keys; `cache_probe` the
probe set's tag and torch's answers to it (the export's "probe" metadata), which a replica that
has no local model checks the server against; `cache_export_state` what the model keeps beside
its graph (the text model's intent centroids), JSON.

A model's folder is written beside the old one and swapped in (the old one moved aside, the new
one renamed in, the old one removed): a reader never sees a new graph with an old config.
Folders of tasks that are not served are left alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.models.base import Classifier
from engine.models.config import ModelConfigError, ModelSpec
from engine.models.loader import LoadOptions, build_model
from engine.models.onnx_backend import export_path, probe_digest, write_atomically
from runtime import load_options, model_specs
from settings import Settings, SettingsError

log = logging.getLogger(__name__)

VERSION_DIR = "1"  # Triton's model version folder (the app's version is in the parameters)
DEFAULT_MAX_BATCH = 32
QUEUE_DELAY_US = 2000
PARAMETERS = ("cache_model_version", "cache_probe", "cache_export_state")
# ONNX TensorProto element types -> Triton's data types.
DATA_TYPES = {1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 6: "TYPE_INT32", 7: "TYPE_INT64",
              9: "TYPE_BOOL", 10: "TYPE_FP16", 11: "TYPE_FP64"}  # fmt: skip


class RepositoryError(Exception):
    """The repository cannot be written; the message says which model and why."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output as Triton's config names it: dims without the batch axis, -1 variable."""

    name: str
    data_type: str
    dims: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ExportedModel:
    """What one task's folder holds."""

    task: str
    graph: bytes
    model_version: str
    probe: str
    export_state: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def parameters(self) -> dict[str, str]:
        return dict(zip(PARAMETERS, (self.model_version, self.probe, self.export_state), strict=True))

    def config_text(self) -> str:
        """config.pbtxt: Triton's ModelConfig in protobuf text format."""
        lines = [f"name: {quote(self.task)}", 'platform: "onnxruntime_onnx"',
                 f"max_batch_size: {self.max_batch_size}"]  # fmt: skip
        for field, tensors in (("input", self.inputs), ("output", self.outputs)):
            lines.append(f"{field} [")
            entries = [f"  {{ name: {quote(t.name)} data_type: {t.data_type} "
                       f"dims: [ {', '.join(map(str, t.dims))} ] }}" for t in tensors]  # fmt: skip
            lines.append(",\n".join(entries))
            lines.append("]")
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {QUEUE_DELAY_US} }}")
        lines += [f"parameters {{ key: {quote(key)} value {{ string_value: {quote(value)} }} }}"
                  for key, value in self.parameters().items()]  # fmt: skip
        return "\n".join(lines) + "\n"


def quote(value: str) -> str:
    """A protobuf text-format string literal: printable ASCII as is, the rest as octal bytes."""
    out = []
    for byte in value.encode():
        char = chr(byte)
        if char in '"\\':
            out.append("\\" + char)
        elif 32 <= byte < 127:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def graph_io(graph: bytes) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], dict[str, str]]:
    """The graph's inputs and outputs (batch axis dropped) and its metadata."""
    import onnx

    model = onnx.load_from_string(graph)

    def specs(values: Any) -> tuple[TensorSpec, ...]:
        found = []
        for value in values:
            tensor = value.type.tensor_type
            if tensor.elem_type not in DATA_TYPES:
                raise RepositoryError(f"tensor {value.name!r} has ONNX element type {tensor.elem_type}, "
                                      "which this exporter does not map to a Triton type")  # fmt: skip
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
            if not dims or dims[0] != -1:
                raise RepositoryError(f"tensor {value.name!r} has no variable batch axis first ({dims})")
            found.append(TensorSpec(value.name, DATA_TYPES[tensor.elem_type], tuple(dims[1:])))
        return tuple(found)

    initializers = {i.name for i in model.graph.initializer}
    inputs = specs(v for v in model.graph.input if v.name not in initializers)
    return inputs, specs(model.graph.output), {p.key: p.value for p in model.metadata_props}


def export_options(options: LoadOptions) -> LoadOptions:
    """The app's options with the forward pass on ONNX Runtime on the CPU (what is exported)."""
    return dataclasses.replace(options, device="cpu", backend="onnxruntime")


def export_model(spec: ModelSpec, options: LoadOptions, *, loaded: Classifier | None = None,
                 fresh: bool = False) -> ExportedModel:  # fmt: skip
    """Load one served model as the app does, on ONNX Runtime, and take its exported graph.
    `loaded`: the same model already loaded that way (with these options), used if it is."""
    assert options.export_dir is not None
    if loaded is not None and _served_from_export(loaded, options.export_dir):
        model = loaded
    else:
        # backend/device replaced: an entry served remotely (or on CUDA) is exported from its source.
        model = build_model(dataclasses.replace(spec, device="cpu", backend="onnxruntime"), options)
    if model.backend != "onnxruntime":
        raise RepositoryError(f"{spec.label()}: the ONNX Runtime backend refused it: {model.backend_reason}")
    graph = export_path(options.export_dir, model.name, model.version).read_bytes()
    inputs, outputs, metadata = graph_io(graph)
    if metadata.get("model_version") != model.version:
        raise RepositoryError(f"{spec.label()}: the export names version {metadata.get('model_version')!r}, "
                              f"the model is {model.version}")  # fmt: skip
    if _probe_tag(metadata.get("probe")) != probe_digest(model.probe_inputs()):
        if fresh:
            raise RepositoryError(f"{spec.label()}: a fresh export's probe answers are not for its probe set")
        return _fresh_export(spec, options)
    if [o.name for o in outputs] != ["output"]:
        names = [o.name for o in outputs]
        raise RepositoryError(f"{spec.label()}: the graph's outputs are {names}, not ['output']")
    return ExportedModel(
        task=spec.task, graph=graph, model_version=model.version, probe=metadata["probe"],
        export_state=json.dumps(model.export_state()),
        max_batch_size=getattr(model, "max_batch", None) or DEFAULT_MAX_BATCH,
        inputs=inputs, outputs=outputs,
    )  # fmt: skip


def _served_from_export(model: Any, export_dir: Path) -> bool:
    return (getattr(model, "backend", None) == "onnxruntime" and getattr(model, "device", None) == "cpu"
            and export_path(export_dir, model.name, model.version).is_file())  # fmt: skip


def _probe_tag(raw: str | None) -> str | None:
    try:
        doc = json.loads(raw) if raw else None
    except ValueError:
        return None
    return doc.get("tag") if isinstance(doc, dict) else None


def _fresh_export(spec: ModelSpec, options: LoadOptions) -> ExportedModel:
    """The kept export's probe answers are for another probe set (the app, which computes its
    reference again then, still serves it): export once more into a scratch dir."""
    log.info("%s: the kept export's probe answers are stale: exporting again", spec.label())
    with tempfile.TemporaryDirectory(prefix="onnx-export-") as scratch:
        return export_model(spec, dataclasses.replace(options, export_dir=Path(scratch)), fresh=True)


def write_model(repository: Path, model: ExportedModel) -> Path:
    """DIR/<task>/ written beside the old one, then swapped in; returns the folder."""
    repository.mkdir(parents=True, exist_ok=True)
    target = repository / model.task
    staging = Path(tempfile.mkdtemp(prefix=f".{model.task}.new-", dir=repository))
    try:
        write_atomically(staging / VERSION_DIR / "model.onnx", model.graph)
        write_atomically(staging / "config.pbtxt", model.config_text().encode())
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from a server run as another user
        old = repository / f".{model.task}.old-{os.getpid()}"
        if target.exists():
            os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_repository(repository: Path, specs: Sequence[ModelSpec], options: LoadOptions, *,
                     loaded: Mapping[str, Classifier] | None = None) -> list[ExportedModel]:  # fmt: skip
    """Every served task's folder (export first, then write: a failing model writes nothing).
    `loaded`: models already loaded by the app's loader with these options, by task (reused)."""
    options = export_options(options)
    if options.export_dir is None:
        raise RepositoryError("no ONNX export dir (ONNX_EXPORT_DIR or DATA_DIR/onnx)")
    loaded = loaded or {}
    models = [export_model(spec, options, loaded=loaded.get(spec.task)) for spec in specs]
    for model in models:
        folder = write_model(repository, model)
        log.info("%s: version %s, a %d MB graph, inputs %s", folder, model.model_version,
                 len(model.graph) // 2**20, ", ".join(t.name for t in model.inputs))  # fmt: skip
    return models


def main(argv: Sequence[str] | None = None) -> int:
    from process_setup import configure_logging

    parser = argparse.ArgumentParser(
        prog="python -m serving.repository",
        description="Write a Triton/KServe model repository of the served models (MODELS_CONFIG or the "
        "built-ins), loaded as the app loads them.",
    )
    parser.add_argument("directory", type=Path, help="the model repository to write (created if missing)")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        settings = Settings.from_env()
        models = write_repository(args.directory, model_specs(settings), load_options(settings))
    except (SettingsError, ModelConfigError, RepositoryError, OSError) as exc:
        logging.getLogger("serving").error("triton-repository: %s", exc)
        return 1
    for model in models:
        print(f"{args.directory / model.task}: cache_model_version {model.model_version}")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
