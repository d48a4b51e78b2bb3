"""MODELS_CONFIG: which models this app serves, one entry per task.

    models:
      - task: sentiment                 # classify_sentiment, REST model "sentiment", a UI tab
        kind: text-classification       # or image-classification
        source: transformers            # a local folder written by save_pretrained
        path: /data/models/sentiment
        device: cpu                     # optional: auto | cpu | cuda (default: DEVICE)
        backend: onnxruntime            # optional: auto | torch | onnxruntime (default: INFERENCE_BACKEND)
        max_batch: 8                    # optional: inputs per forward pass (1: no batching)
        top_k: 3                        # optional: classes per answer (default 5)
        ttl_s: 3600                     # optional: L2 TTL of its answers (default CACHE_TTL_S)
      - task: image
        kind: image-classification
        source: builtin:efficientnet-lite0   # builtin:minilm-intents is the text one
      - task: text
        kind: text-classification
        source: builtin:minilm-intents       # still needed: the tokenizer, the labels, the local version
        backend: remote                      # misses' forward passes on an Open Inference Protocol v2 server
        remote_url: grpc://triton:8001       # or http://host:port (Triton, KServe)
        remote_model: text                   # optional: the server's model name (default: the task)

A bad entry fails start-up with a message naming it (its index and task), never later. A remote
entry is served as engine.models.remote describes: pre- and post-processing here, the forward pass
on the server, the key space the server's model version.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from engine.errors import ModelLoadError

KINDS = ("text-classification", "image-classification")
BUILTINS = {
    "builtin:efficientnet-lite0": "image-classification",
    "builtin:minilm-intents": "text-classification",
}
SOURCES = ("transformers", *BUILTINS)
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "onnxruntime", "remote")  # engine.models.onnx_backend, engine.models.remote
REMOTE_SCHEMES = ("http", "grpc")
# A task becomes an API name (classify_<task>), a URL segment and a Redis key part:
# lower-case letters, digits, '_' and '-', and never ':' (the key separator).
TASK_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
_KEYS = {"task", "kind", "source", "path", "device", "backend", "max_batch", "top_k", "ttl_s", "remote_url",
         "remote_model"}
# A Triton/KServe model name: what its repository's folder may be called.
REMOTE_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class ModelConfigError(ModelLoadError):
    """MODELS_CONFIG (or one of its entries) cannot be served; the message names the entry."""


@dataclass(frozen=True)
class ModelSpec:
    """One served model. `path` only for source transformers; None options take the app's defaults."""

    task: str
    kind: str
    source: str
    path: Path | None = None
    device: str | None = None
    max_batch: int | None = None
    top_k: int | None = None
    ttl_s: int | None = None
    backend: str | None = None
    remote_url: str | None = None  # backend remote: "http://host:port" or "grpc://host:port"
    remote_model: str | None = None  # backend remote: the server's model name (None: the task)

    @property
    def remote(self) -> bool:
        return self.backend == "remote"

    @property
    def builtin(self) -> bool:
        return self.source in BUILTINS

    def label(self, index: int | None = None) -> str:
        """How error messages name the entry."""
        where = f"entry {index + 1}" if index is not None else "entry"
        return f"MODELS_CONFIG {where} (task {self.task!r})"


DEFAULT_SPECS = (
    ModelSpec(task="image", kind="image-classification", source="builtin:efficientnet-lite0"),
    ModelSpec(task="text", kind="text-classification", source="builtin:minilm-intents"),
)


def load_config(path: Path) -> tuple[ModelSpec, ...]:
    """Read and check a MODELS_CONFIG file (raises ModelConfigError naming what is wrong)."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelConfigError(f"MODELS_CONFIG {path} cannot be read: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"MODELS_CONFIG {path} is not valid YAML: {exc}") from None
    entries = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ModelConfigError(f"MODELS_CONFIG {path} needs a non-empty list under 'models:'")
    base = path.resolve().parent
    specs: list[ModelSpec] = []
    for index, entry in enumerate(entries):
        spec = parse_entry(entry, index, base=base)
        if any(s.task == spec.task for s in specs):
            raise ModelConfigError(f"{spec.label(index)}: task {spec.task!r} is defined twice")
        specs.append(spec)
    return tuple(specs)


def parse_entry(entry: Any, index: int, *, base: Path) -> ModelSpec:
    where = f"MODELS_CONFIG entry {index + 1}"
    if not isinstance(entry, dict):
        raise ModelConfigError(f"{where}: expected a mapping with task, kind and source")
    task = entry.get("task")
    if not isinstance(task, str) or not TASK_NAME.match(task):
        raise ModelConfigError(
            f"{where}: task {task!r} must be 1-40 lower-case letters, digits, '_' or '-', "
            "starting with a letter"
        )
    where = f"{where} (task {task!r})"
    unknown = set(entry) - _KEYS
    if unknown:
        raise ModelConfigError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    kind, source = entry.get("kind"), entry.get("source")
    if kind not in KINDS:
        raise ModelConfigError(f"{where}: unknown kind {kind!r} (use {' or '.join(KINDS)})")
    if source not in SOURCES:
        raise ModelConfigError(f"{where}: unknown source {source!r} (use {', '.join(SOURCES)})")
    if source in BUILTINS and BUILTINS[source] != kind:
        raise ModelConfigError(f"{where}: {source} is an {BUILTINS[source]} model, not {kind}")
    path: Path | None = None
    if source == "transformers":
        raw_path = entry.get("path")
        if not isinstance(raw_path, str) or not raw_path.strip():
            raise ModelConfigError(f"{where}: source transformers needs 'path' (a save_pretrained folder)")
        path = Path(raw_path).expanduser()
        path = path if path.is_absolute() else base / path  # relative to the config file
        if not (path / "config.json").is_file():
            raise ModelConfigError(f"{where}: no model folder at {path} (config.json not found)")
    elif "path" in entry:
        raise ModelConfigError(f"{where}: 'path' is only for source transformers")
    device = entry.get("device")
    if device is not None and device not in DEVICES:
        raise ModelConfigError(f"{where}: device {device!r} must be one of {', '.join(DEVICES)}")
    backend = entry.get("backend")
    if backend is not None and backend not in BACKENDS:
        raise ModelConfigError(f"{where}: backend {backend!r} must be one of {', '.join(BACKENDS)}")
    remote_url, remote_model = _remote(entry, backend, where)
    return ModelSpec(
        task=task, kind=kind, source=source, path=path, device=device,
        max_batch=_positive(entry, "max_batch", where), top_k=_positive(entry, "top_k", where),
        ttl_s=_positive(entry, "ttl_s", where), backend=backend, remote_url=remote_url,
        remote_model=remote_model,
    )  # fmt: skip


def _remote(entry: dict[str, Any], backend: str | None, where: str) -> tuple[str | None, str | None]:
    """`remote_url` (and `remote_model`) for backend remote only; the URL is checked here, so a typo
    stops the start rather than refusing every miss later."""
    if backend != "remote":
        extra = [name for name in ("remote_url", "remote_model") if name in entry]
        if extra:
            raise ModelConfigError(f"{where}: {' and '.join(extra)} only go with 'backend: remote'")
        return None, None
    url = entry.get("remote_url")
    if not isinstance(url, str) or not url.strip():
        raise ModelConfigError(f"{where}: backend remote needs 'remote_url' (http://host:port or grpc://host:port)")
    url = url.strip()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ModelConfigError(f"{where}: remote_url {url!r} is not a URL: {exc}") from None
    if parts.scheme not in REMOTE_SCHEMES:
        raise ModelConfigError(
            f"{where}: remote_url {url!r} must start with http:// or grpc:// (the server's HTTP or gRPC port)"
        )
    if not parts.hostname or port is None:
        raise ModelConfigError(f"{where}: remote_url {url!r} needs a host and a port ({parts.scheme}://host:port)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ModelConfigError(
            f"{where}: remote_url {url!r} takes only {parts.scheme}://host:port (no path, query or user)"
        )
    model = entry.get("remote_model", entry.get("task"))
    if not isinstance(model, str) or not REMOTE_MODEL_NAME.match(model):
        raise ModelConfigError(
            f"{where}: remote_model {model!r} must be the server's model name "
            "(letters, digits, '_', '.', '-')"
        )
    return f"{parts.scheme}://{parts.netloc}", model


def _positive(entry: dict[str, Any], name: str, where: str) -> int | None:
    value = entry.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"{where}: {name} must be a positive integer, not {value!r}")
    return value
