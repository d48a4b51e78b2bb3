"""Loads the models MODELS_CONFIG names (engine.models.config), each checked with one
forward pass; the composition root loads them at start-up and a live reload (engine.lifecycle.reload)
loads one again. Every failure names the entry."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.startup_clock import phase
from engine.errors import ModelLoadError
from engine.inputs import CanonicalImage
from engine.models.base import TOP_K, Classifier
from engine.models.config import ModelConfigError, ModelSpec
from engine.models.device import describe, select_device
from engine.models.onnx_backend import attach, resolve
from engine.models.remote import RemoteOptions, attach_remote

log = logging.getLogger(__name__)

CHECK_TEXT = "Hello, is this thing on?"


@dataclass(frozen=True)
class LoadOptions:
    """The app-wide defaults and input limits (from Settings) a model is built with."""

    device: str = "auto"
    half_precision: bool = False
    max_upload_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_text_chars: int = 2000
    # The forward pass (engine.models.onnx_backend): auto | torch | onnxruntime, and where exports
    # are kept (None: exported in memory at every load, never written).
    backend: str = "torch"
    export_dir: Path | None = None
    # The cores an ONNX session's passes share: up to `miss_concurrency_cpu` passes at once (the
    # engine's pass slots; a batching model's batches too: engine.capacity.passes).
    cpu_cores: int = 1
    miss_concurrency_cpu: int = 1
    # `backend: remote` entries (engine.models.remote): timeouts and backoff.
    remote: RemoteOptions = field(default_factory=RemoteOptions)

    def session_threads(self) -> int:
        """Intra-op threads of one ONNX session: the cores divided among the passes that may
        run at once (`miss_concurrency_cpu`, batched or not). Measured on 2 cores: EfficientNet-
        Lite0 with 1 thread costs 10.5 ms CPU a pass, with 2 threads 12.8 ms CPU for 7.1 ms wall;
        MiniLM (bench.miss_cost's messages, ~19 tokens), two passes of 2 messages at once cost
        5.7 ms CPU a message on 1 thread each, 6.8 ms on a 2-thread session (and answer later),
        one message alone 5.9 ms for 5.9 ms wall against 7.4 for 4.5. With as many passes as
        cores at once, more threads per pass only add that overhead; a lone long message is what
        gives it up (256 tokens: 71 ms on one thread, 41 on two; MISS_CONCURRENCY_CPU=1 chooses
        that latency)."""
        return max(1, self.cpu_cores // max(1, self.miss_concurrency_cpu))


def build_model(spec: ModelSpec, options: LoadOptions) -> Classifier:
    """Load one model and check it with a forward pass (raises ModelLoadError naming the entry)."""
    try:
        if spec.remote:
            return _build_remote(spec, options)
        lazy = _lazy_torch(spec, options)
        model = _construct(spec, options, lazy_torch=lazy)
        if not lazy:
            check_model(model)
        # After the torch check: a model that loads always serves, on torch if need be. A lazy one
        # (a built-in that onnxruntime serves from a kept export) builds its torch module only if
        # the export must be made, the probe must be answered by torch or the check fails over to it.
        attach(model, spec.backend or options.backend, export_dir=options.export_dir,
               threads=options.session_threads())  # fmt: skip
        if lazy:
            check_model(model)
    except ModelConfigError:
        raise
    except ModelLoadError as exc:
        raise ModelLoadError(f"{spec.label()}: {exc}") from exc
    except Exception as exc:  # any failure of a user's files is a load failure, named
        log.warning("loading %s failed", spec.label(), exc_info=True)
        raise ModelLoadError(f"{spec.label()}: {type(exc).__name__}: {exc}") from exc
    return model


def _build_remote(spec: ModelSpec, options: LoadOptions) -> Classifier:
    """The local pieces (processor or tokenizer, labels, the local version; a built-in's torch
    module only if the check needs the local answers) and the remote forward pass, checked on the
    probe set (which stands for check_model's pass). A remote that is not used yet does not fail
    the load: its misses are refused until a background check passes."""
    assert spec.remote_url is not None  # checked by the config
    model = _construct(spec, options, lazy_torch=spec.builtin)
    attach_remote(model, task=spec.task, url=spec.remote_url, remote_model=spec.remote_model or spec.task,
                  options=options.remote, export_dir=options.export_dir)  # fmt: skip
    return model


def load_all(specs: Sequence[ModelSpec], options: LoadOptions) -> dict[str, Classifier]:
    models: dict[str, Classifier] = {}
    for index, spec in enumerate(specs):
        try:
            with phase(f"model {spec.task} ({spec.source})"):
                models[spec.task] = build_model(spec, options)
        except ModelLoadError as exc:
            # Re-labelled with the entry's position: the message says which line to fix.
            message = str(exc).replace(spec.label(), spec.label(index), 1)
            raise ModelConfigError(message) from exc
    return models


def check_model(model: Classifier) -> None:
    """One forward pass on a neutral input: a model that cannot answer is never served."""
    kind = getattr(model, "kind", "")
    if kind.startswith("image"):
        sample = CanonicalImage(np.full((64, 64, 3), 127, dtype=np.uint8))
    else:
        sample = model.canonicalize(CHECK_TEXT)
    answers = model.predict_batch([sample])
    if len(answers) != 1 or not answers[0].labels:
        raise ModelLoadError("the check pass gave no answer")
    scores = [score for _, score in answers[0].labels]
    if not all(math.isfinite(s) and 0.0 <= s <= 1.0 + 1e-6 for s in scores):
        raise ModelLoadError(f"the check pass gave scores outside [0, 1]: {scores}")


def _lazy_torch(spec: ModelSpec, options: LoadOptions) -> bool:
    """Whether a built-in may leave its torch module unbuilt: onnxruntime will serve it on the
    CPU from an export kept in `export_dir` (one made now builds the module to export it)."""
    if not spec.source.startswith("builtin:") or options.export_dir is None:
        return False
    device = describe(select_device(spec.device or options.device))
    return resolve(spec.backend or options.backend, device) == "onnxruntime" and device == "cpu"


def _construct(spec: ModelSpec, options: LoadOptions, *, lazy_torch: bool = False) -> Classifier:
    device = spec.device or options.device
    if spec.source == "transformers":
        from engine.models.hf import HFImageClassifier, HFTextClassifier

        assert spec.path is not None  # checked by the config
        common = {"task": spec.task, "folder": spec.path, "device": device, "top_k": spec.top_k,
                  "max_batch": spec.max_batch, "ttl_s": spec.ttl_s}  # fmt: skip
        if spec.kind == "image-classification":
            return HFImageClassifier(
                max_upload_bytes=options.max_upload_bytes, max_image_pixels=options.max_image_pixels, **common
            )
        return HFTextClassifier(max_text_chars=options.max_text_chars, **common)
    model: Classifier
    if spec.source == "builtin:efficientnet-lite0":
        from engine.models.image import ImageClassifier

        model = ImageClassifier(
            device=device, half_precision=options.half_precision,
            max_upload_bytes=options.max_upload_bytes, max_image_pixels=options.max_image_pixels,
            lazy_torch=lazy_torch,
        )  # fmt: skip
    else:
        from engine.models.text import TextClassifier

        model = TextClassifier(device=device, max_text_chars=options.max_text_chars, lazy_torch=lazy_torch)
    # The built-ins take their serving options as attributes; a top_k other than the default
    # changes the answers, so it changes the version too (the default keeps today's version).
    model.task = spec.task
    model.max_batch = spec.max_batch  # type: ignore[attr-defined]
    model.ttl_s = spec.ttl_s  # type: ignore[attr-defined]
    if spec.top_k is not None and spec.top_k != TOP_K:
        model.top_k = spec.top_k  # type: ignore[attr-defined]
        model.version = hashlib.sha256(f"{model.version}|top_k={spec.top_k}".encode()).hexdigest()[:16]
    return model
