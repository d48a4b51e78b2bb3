"""The CPU inference backend: a model's forward pass served by ONNX Runtime.

Only the forward pass changes (engine.models.image/text/hf call `_pass`): preprocessing, top-k,
batching, pass slots, single flight and the model version stay what they are. The graph is
exported from the loaded torch model once per model version and reused from `export_dir`:

    {export_dir}/{name}-{version}-torch{torch}-ort{onnxruntime}-opset{N}.onnx

written atomically (a temporary file, then a rename), with the model version in its metadata: a
file that does not load (corrupt, partial) is exported again, one that names another version is
never served. A probe set then runs on both backends; unless every answer's classes, in order,
are the same and every score is within PROBE_TOLERANCE, the model stays on torch and the reason
is kept (`backend_reason`: /readyz and the console show it).

Why the TorchScript exporter (`dynamo=False`): the models served here trace cleanly, it exports
MiniLM in seconds, and it is the one measured in issue 25. It restores the training flag of the
module it is given, recursively: the wrapper below is put in eval mode first (a wrapper left in
training mode turned dropout on in the served model), and the model is checked after.
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.errors import ModelError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "onnxruntime")
OPSET = 17
PROBE_TOLERANCE = 1e-5
_EXPORT_LOCK = threading.Lock()  # torch.onnx.export is not safe to run twice at once


class BackendUnavailable(Exception):
    """The onnxruntime backend cannot serve this model; the message says why (kept, shown)."""


@dataclass(frozen=True)
class ExportPlan:
    """What to export: `module(*example.values())` gives the tensor `output`; `dynamic` names
    each input's and the output's variable axes (batch, sequence)."""

    module: torch.nn.Module
    example: Mapping[str, torch.Tensor]
    dynamic: Mapping[str, Mapping[int, str]]
    output: str = "output"


class NamedOutput(torch.nn.Module):
    """Positional inputs (the exporter's) to a Hugging Face model's keyword inputs, and one field
    of its output (`logits`, `last_hidden_state`)."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str], field: str) -> None:
        super().__init__()
        self.model = model
        self._names = tuple(names)
        self._field = field
        self.eval()  # a new module trains by default, and the exporter would restore that (see above)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(**dict(zip(self._names, tensors, strict=True))), self._field)


class Forward(Protocol):
    """A forward pass the seam runs: OnnxForward, or engine.models.remote.RemoteForward."""

    inputs: tuple[str, ...]

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor: ...


class OnnxForward:
    """One ONNX Runtime session; `__call__` takes the named tensors the torch pass takes.
    `InferenceSession.run` is thread-safe: concurrent passes share the session."""

    def __init__(self, model: bytes | Path, *, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Idle worker threads spin by default: lower latency alone, but CPU burnt while passes
        # wait on each other (the pass slots run several) is what a miss costs the server.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        source = str(model) if isinstance(model, Path) else model
        started = time.perf_counter()
        self._session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        self.load_s = time.perf_counter() - started
        self.inputs = tuple(i.name for i in self._session.get_inputs())
        self._output = self._session.get_outputs()[0].name
        self.metadata = dict(self._session.get_modelmeta().custom_metadata_map)

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        feeds = {name: tensors[name].detach().cpu().numpy() for name in self.inputs}
        return torch.from_numpy(self._session.run([self._output], feeds)[0])


def versions_tag() -> str:
    import onnxruntime as ort

    return f"torch{torch.__version__.split('+')[0]}-ort{ort.__version__}-opset{OPSET}"


def export_path(export_dir: Path, name: str, version: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:60] or "model"
    return export_dir / f"{safe}-{version}-{versions_tag()}.onnx"


def export_bytes(plan: ExportPlan, metadata: Mapping[str, str]) -> bytes:
    """The ONNX graph of `plan`, with `metadata` (the model version, the probe's torch answers)
    in it (raises what the exporter raises)."""
    import onnx

    module = plan.module
    module.eval()  # the exporter restores the flags it found: eval is what they must be
    buffer = io.BytesIO()
    names = list(plan.example)
    with _EXPORT_LOCK, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, tuple(plan.example.values()), buffer, input_names=names, output_names=[plan.output],
            dynamic_axes={k: dict(v) for k, v in plan.dynamic.items()}, opset_version=OPSET,
            do_constant_folding=True, dynamo=False,
        )  # fmt: skip
    if any(m.training for m in module.modules()):
        raise BackendUnavailable("the model was in training mode around the export")
    graph = onnx.load_from_string(buffer.getvalue())
    for key, value in metadata.items():
        entry = graph.metadata_props.add()
        entry.key, entry.value = key, value
    return graph.SerializeToString()


def write_atomically(path: Path, data: bytes) -> None:
    """A reader sees the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def load_or_export(plan: Callable[[], ExportPlan], *, name: str, version: str, export_dir: Path | None,
                   threads: int, fresh: bool = False, metadata: Callable[[], Mapping[str, str]] = dict,
                   required: Sequence[str] = ()) -> OnnxForward:  # fmt: skip
    """The session for this model version: from its export file when one loads, names this
    version and holds every `required` metadata entry (what the model keeps there, e.g. the text
    model's centroids: a file written before it kept them is made again, once), else exported now
    (and written, when there is an `export_dir`) with `metadata()`."""
    def export(path: Path | None) -> bytes:
        started = time.perf_counter()
        exported = plan()
        log.info("exporting %s %s to ONNX (once per model version, then reused; ~%.0f s)…",
                 name, version, export_estimate_s(exported.module))  # fmt: skip
        data = export_bytes(exported, {**metadata(), "model_version": version})
        del exported
        if not gc.isenabled():
            # app.py pauses the collector for the start-up, then freezes what it built: the
            # exporter's traced graphs (~400,000 objects in reference cycles, ~80 MB for the
            # built-ins) would be kept for good. A running collector frees them in its young
            # generations, without a full collection holding the GIL for a second of a large
            # process (a replica's heartbeats, the event loop).
            gc.collect()
        log.info("exported %s %s to ONNX in %.1f s (%.0f MB)%s", name, version, time.perf_counter() - started,
                 len(data) / 1e6, f" → {path}" if path is not None else "")  # fmt: skip
        return data

    if export_dir is None:
        return OnnxForward(export(None), threads=threads)
    path = export_path(export_dir, name, version)
    if path.is_file() and not fresh:
        try:
            session = OnnxForward(path, threads=threads)
        except Exception as exc:  # onnxruntime raises its own types for a file it cannot parse
            log.warning("export %s does not load (%s): exporting again", path, exc)
        else:
            missing = [key for key in required if key not in session.metadata]
            if session.metadata.get("model_version") != version:
                log.warning("export %s names model version %r, not %s: exporting again",
                            path, session.metadata.get("model_version"), version)  # fmt: skip
            elif missing:
                log.info("export %s predates the %s it now keeps: exporting again", path, ", ".join(missing))
            else:
                log.info("reusing the ONNX export %s (session in %.2f s)", path, session.load_s)
                return session
    write_atomically(path, export(path))
    return OnnxForward(path, threads=threads)


def export_estimate_s(module: torch.nn.Module) -> float:
    """About how long the export takes, for the log (measured on 2 busy cores: 3.5 s for
    EfficientNet-Lite0's 18 MB, 6.4 s for MiniLM's 90 MB)."""
    size_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 1e6
    return 2.0 + size_mb / 20


def compare(torch_answers: Sequence[Any], onnx_answers: Sequence[Any]) -> str | None:
    """None when every answer has the same classes in the same order and scores within
    PROBE_TOLERANCE; else what differs."""
    if len(torch_answers) != len(onnx_answers):
        return f"{len(onnx_answers)} answers for {len(torch_answers)} probes"
    for index, (a, b) in enumerate(zip(torch_answers, onnx_answers, strict=True)):
        names_a, names_b = [n for n, _ in a.labels], [n for n, _ in b.labels]
        if names_a != names_b:
            return f"probe {index}: classes {names_b} where torch gives {names_a}"
        worst = max(abs(x - y) for (_, x), (_, y) in zip(a.labels, b.labels, strict=True))
        if not worst <= PROBE_TOLERANCE:
            return f"probe {index}: a score differs by {worst:.2e} (tolerance {PROBE_TOLERANCE:g})"
    return None


def resolve(requested: str, device: str) -> str:
    """auto: onnxruntime on the CPU, torch on CUDA (torch's kernels are the fast ones there)."""
    if requested == "auto":
        return "onnxruntime" if device == "cpu" else "torch"
    return requested


def attach(model: Any, requested: str, *, export_dir: Path | None, threads: int | None = None) -> None:
    """Serve `model` (a classifier with the backend seam) with onnxruntime when `requested`
    resolves to it and the probe agrees; otherwise leave it on torch with `backend_reason` set.
    Never raises for the backend's sake: a model that loaded with torch keeps serving."""
    wanted = resolve(requested, model.device)
    if wanted == "torch":
        model.backend_reason = "backend: torch" if requested == "torch" else f"auto: torch on {model.device}"
        return
    if model.device != "cpu":
        model.backend_reason = f"onnxruntime serves CPU models; this one is on {model.device}"
        log.warning("%s: %s", model.name, model.backend_reason)
        return
    threads = threads or torch.get_num_threads()
    started = time.perf_counter()
    reason = _try_attach(model, export_dir=export_dir, threads=threads, fresh=False)
    if reason is not None and export_dir is not None and "probe" in reason:
        # A reused file that loads but answers otherwise is as bad as a corrupt one: make it again.
        reason = _try_attach(model, export_dir=export_dir, threads=threads, fresh=True)
    if reason is None:
        model.backend, model.backend_reason = "onnxruntime", None
        log.info("%s %s: served by onnxruntime (session and probe in %.2f s)", model.name, model.version,
                 time.perf_counter() - started)  # fmt: skip
    else:
        model.backend, model.backend_reason = "torch", f"onnxruntime refused: {reason}"
        log.warning("%s %s stays on torch: %s", model.name, model.version, reason)


def _try_attach(model: Any, *, export_dir: Path | None, threads: int, fresh: bool) -> str | None:
    """Torch's answers to the probe are computed when the graph is exported and kept in its
    metadata (with a digest of the probe inputs): they are a function of the model version and
    the torch version, both in the file's name, so a start that reuses the export runs only
    onnxruntime's half of the probe (torch's half was most of the start-up's extra cost)."""
    model.use_onnx(None)
    try:
        probes = model.probe_inputs()
        tag = probe_digest(probes)
        computed: list[Any] = []

        def reference() -> list[Any]:
            if not computed:
                computed.extend(_answers(model.predict_batch, probes, model))
            return computed

        def metadata() -> dict[str, str]:
            probe = json.dumps({"tag": tag, "answers": [a.to_plain() for a in reference()]})
            return {"probe": probe, **getattr(model, "export_state", dict)()}

        session = load_or_export(model.export_plan, name=model.name, version=model.version,
                                 export_dir=export_dir, threads=threads, fresh=fresh, metadata=metadata,
                                 required=getattr(model, "export_state_keys", ()))  # fmt: skip
        adopt = getattr(model, "adopt_export_state", lambda _metadata: False)
        adopted = adopt(session.metadata)
        expected = _stored_answers(session.metadata.get("probe"), tag) or reference()
        model.use_onnx(session)
        got = _answers(model.predict_batch, probes, model)
    except Exception as exc:  # an exporter or runtime failure of any kind: torch keeps serving
        model.use_onnx(None)
        getattr(model, "adopt_export_state", lambda _metadata: False)(None)  # torch serves with its own
        log.debug("%s: the onnxruntime backend failed", model.name, exc_info=True)  # the why, on demand
        return f"{type(exc).__name__}: {exc}"[:500]
    difference = compare(expected, got)
    if difference is not None:
        model.use_onnx(None)
        if adopted:
            adopt(None)
        return f"probe: {difference}"
    model.use_onnx(session, fallback=True)
    return None


def probe_digest(probes: Sequence[Any]) -> str:
    """What the probe inputs are: a stored reference is used only for this very probe set."""
    digest = hashlib.sha256()
    for item in probes:
        for part in item.fingerprint_parts():
            digest.update(bytes(part))
    return digest.hexdigest()[:16]


def _stored_answers(raw: str | None, tag: str) -> list[Any] | None:
    from engine.models.base import Prediction

    try:
        doc = json.loads(raw) if raw else None
        if not isinstance(doc, dict) or doc.get("tag") != tag:
            return None
        return [Prediction.from_plain(answer) for answer in doc["answers"]]
    except (ValueError, KeyError, TypeError):  # unreadable: torch computes the reference again
        return None


def _answers(predict: Callable[[Sequence[Any]], list[Any]], probes: Sequence[Any], model: Any) -> list[Any]:
    """Each probe alone, and (for a model that batches misses) all of them as one pass too."""
    answers = [answer for item in probes for answer in predict([item])]
    if getattr(model, "batch_misses", False) and len(probes) > 1:
        answers += predict(list(probes))
    return answers


class TorchThreads:
    """Torch's intra-op threads for this process, from the models it serves: torch's default
    while any CPU model's forward pass runs on torch; one when ONNX Runtime runs every CPU pass
    and torch only preprocesses. Measured (bench.miss_profile, 2 cores): the idle threads of
    torch's pool spin after each small parallel op (an image's resize) while the ONNX pass runs,
    5 ms of CPU an image miss (24 against 16 ms a miss), more than a second thread saves on a
    1-2 ms resize. Process-wide (torch has no per-thread setting): the composition root owns it,
    applying it at start-up and after a model is swapped."""

    def __init__(self) -> None:
        self.default = torch.get_num_threads()

    def wanted(self, models: Iterable[Any]) -> int:
        on_torch = any(getattr(m, "device", "cpu") == "cpu" and getattr(m, "backend", "torch") == "torch"
                       for m in models)  # fmt: skip
        return self.default if on_torch else 1

    def apply(self, models: Iterable[Any]) -> int:
        wanted = self.wanted(models)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
            why = "a CPU model runs on torch" if wanted == self.default else "torch only preprocesses"
            log.info("torch intra-op threads: %d (%s)", wanted, why)
        return wanted

    def restore(self) -> None:
        torch.set_num_threads(self.default)


class BackendSeam:
    """The forward-pass seam a classifier mixes in: `_pass(tensors)` runs the ONNX session
    when one is attached, else the class's own `_torch_pass`.

    The torch module (`_model`) may be built on first use (`_load_torch_module`): a built-in
    served by onnxruntime from a reused export never builds it (no export, no probe reference,
    no pass the session fails on), which is most of a second start's cost. What the model
    computes with torch once per version and needs on either backend (the text model's intent
    centroids) it keeps in the export (`export_state`, `adopt_export_state`)."""

    backend: str = "torch"
    backend_reason: str | None = None
    _onnx: Forward | None = None
    _fallback: bool = False
    _torch_module: torch.nn.Module | None = None
    _torch_lock: threading.RLock | None = None
    export_state_keys: tuple[str, ...] = ()

    def _load_torch_module(self) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def _model(self) -> torch.nn.Module:
        module = self._torch_module
        if module is None:
            lock = self._torch_lock
            if lock is None:
                lock = self._torch_lock = threading.RLock()
            with lock:
                if self._torch_module is None:
                    started = time.perf_counter()
                    self._torch_module = self._load_torch_module()
                    log.info("%s: torch module built in %.2f s", getattr(self, "name", "model"),
                             time.perf_counter() - started)  # fmt: skip
                module = self._torch_module
        return module

    @_model.setter
    def _model(self, module: torch.nn.Module) -> None:
        self._torch_module = module

    def _refuse_training_mode(self) -> None:
        """A torch module in training mode is never served (dropout on); one not built is not."""
        module = self._torch_module
        if module is not None and module.training:
            raise ModelError("refusing to serve a model in training mode")

    def export_state(self) -> dict[str, str]:
        """Metadata entries kept in the export beside the graph (computed with torch)."""
        return {}

    def adopt_export_state(self, metadata: Mapping[str, str] | None) -> bool:
        """Takes what `export_state` kept (None: forget it); whether anything was taken."""
        return False

    def _torch_pass(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _pass(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        session = self._onnx
        if session is None or getattr(session, "local_pass", False):  # a remote's local reference
            return self._torch_pass(tensors)
        if not self._fallback:  # the probe: a failure must show, not be covered by torch
            return session(tensors)
        try:
            return session(tensors)
        except Exception as exc:  # an input shape the graph cannot take: torch answers it (within 1e-5)
            # One line, no traceback: an input can repeat this at will (the log is not a lever).
            log.warning("%s: onnxruntime failed on an input (%s: %s); torch answered it",
                        getattr(self, "name", "model"), type(exc).__name__, str(exc)[:200])  # fmt: skip
            return self._torch_pass(tensors)

    def use_onnx(self, session: OnnxForward | None, *, fallback: bool = False) -> None:
        """Attach a session (None: torch). `fallback`: once the probe has passed, a pass the
        session fails on is answered by torch instead of failing the request."""
        self._fallback = fallback
        self._onnx = session
        self.backend = "torch" if session is None else "onnxruntime"

    def use_remote(self, forward: Forward) -> None:
        """Attach a remote forward pass (engine.models.remote): no fallback, its misses are refused
        while it is not used."""
        self._fallback = False
        self._onnx = forward
        self.backend = "remote"

    def remote_state(self) -> dict[str, Any] | None:
        """The remote forward's state (engine.models.remote), None for a local model."""
        state = getattr(self._onnx, "state", None)
        return state() if callable(state) else None

    def close(self) -> None:
        """Releases what the forward pass holds (a remote's client and check thread)."""
        close = getattr(self._onnx, "close", None)
        if callable(close):
            close()
