"""The remote backend: a model's forward pass on an Open Inference Protocol v2 server (Triton,
KServe), for a MODELS_CONFIG entry with `backend: remote` (engine.models.config).

Only the forward pass moves (the classifiers call `_pass`, engine.models.onnx_backend.BackendSeam):
decoding, preprocessing, tokenising, softmax or pooling and top-k stay here, and so do keys, both
tiers, the micro-batcher (a remote model batches its misses: those that meet in one pass window
go in one call) and the fleet's single flight. Hits never reach the server.

Identity and exactness, at load (start-up, every reload) and whenever the remote comes back:
- the model's version, the key space, is the server's `cache_model_version`
  (`make triton-repository` writes it): a new model there is a new key space here;
- the probe set of the ONNX backend runs through the server: the same classes in order and scores
  within 1e-5 of the local model when the server serves the local version, else of the answers the
  repository recorded (`cache_probe`, for this very probe set); what the model computes once per
  version beside the graph (the text model's centroids) comes from `cache_export_state` then.
A remote that fails the check or does not answer is not used: its misses are refused
(RemoteUnavailableError: 503 with Retry-After, a Gradio error) and the reason shows in /readyz,
the console and /metrics. A breaker skips a server that fails calls (timeouts, refused
connections, garbage answers); a background check, backing off, brings it back by itself: the
full check, not a live miss, since the server may have come back with another model.

Garbage (a wrong shape, NaN or infinite values) is refused and counted, never cached. A pass in
flight while the server swaps its model may still be answered by the new one under the old key:
the server's answer does not say which model gave it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import RemoteUnavailableError
from engine.models.onnx_backend import _answers, _stored_answers, compare, export_path, probe_digest
from engine.models.remote_client import DTYPES, RemoteCallError, RemoteClient, ServedConfig, TensorSpec
from storage.breaker import BreakerState, CircuitBreaker

log = logging.getLogger(__name__)

CHECK_ESTIMATE_S = 1.0  # a probe check's own time, added to the breaker's delay in Retry-After


@dataclass(frozen=True)
class RemoteOptions:
    """Timeouts and backoff (settings.remote)."""

    connect_timeout_s: float = 1.0
    timeout_s: float = 5.0
    breaker_failures: int = 2
    breaker_reset_s: float = 1.0
    breaker_max_s: float = 30.0


class _Garbage(Exception):
    """The server answered, but not a usable tensor."""


class RemoteForward:
    """The forward pass on the server, with OnnxForward's call shape: `__call__(named tensors) ->
    torch.Tensor` and `.inputs`. Thread-safe; owns its client and its background check."""

    def __init__(self, client: RemoteClient, *, task: str, options: RemoteOptions,
                 export_dir: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._client = client
        self._export_dir = export_dir  # the local ONNX exports (their recorded probe answers)
        self.task = task
        self.breaker = CircuitBreaker(failure_threshold=options.breaker_failures,
                                      reset_s=options.breaker_reset_s, max_reset_s=options.breaker_max_s,
                                      clock=clock)  # fmt: skip
        self._lock = threading.Lock()
        self._served: ServedConfig | None = None
        self.usable = False
        self.status = "unchecked"  # ok | down (no answer) | refused (failed the check, garbage) | closed
        self.reason: str | None = "not checked yet"
        self.version: str | None = None  # the server's cache_model_version, once checked
        self.counts = {"calls": 0, "rows": 0, "failures": 0, "refused_answers": 0, "checks": 0}
        self._local = threading.local()  # the check's passes (and the local reference) in this thread
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.on_change: Callable[[str | None], None] = lambda _reason: None  # the model's backend_reason

    # ---- the forward pass ---------------------------------------------------------------------

    @property
    def inputs(self) -> tuple[str, ...]:
        served = self._served
        return tuple(spec.name for spec in served.inputs) if served is not None else ()

    @property
    def local_pass(self) -> bool:
        """Whether this thread computes the local model's reference (BackendSeam runs torch)."""
        return getattr(self._local, "reference", False)

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        checking = getattr(self._local, "checking", False)
        served = self._served
        closed = self.breaker.state is BreakerState.CLOSED
        if not checking and (not self.usable or not closed or served is None):
            raise self.refusal()
        assert served is not None
        try:
            arrays = _arrays(tensors, served.inputs)
        except KeyError as exc:
            raise self._failed("refused", f"the server's model takes input {exc.args[0]!r}, which this model "
                               "does not make", checking) from None  # fmt: skip
        rows = next(iter(arrays.values())).shape[0]
        step = served.max_batch if served.max_batch > 0 else 1
        try:
            parts = []
            for start in range(0, rows, step):  # the server's max_batch_size bounds one call
                chunk = {name: array[start : start + step] for name, array in arrays.items()}
                with self._lock:
                    self.counts["calls"] += 1
                    self.counts["rows"] += len(next(iter(chunk.values())))
                parts.append(_checked(self._client.infer(chunk, served.output.name), chunk, served.output))
        except RemoteCallError as exc:
            raise self._failed("down", str(exc), checking) from None
        except _Garbage as exc:
            with self._lock:
                self.counts["refused_answers"] += 1
            log.warning("%s: the remote model answered garbage (%s): refused, not cached", self.task, exc)
            raise self._failed("refused", f"an invalid answer: {exc}", checking) from None
        if not checking:
            self.breaker.record_success()
        return torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else parts[0])

    def refusal(self) -> RemoteUnavailableError:
        """What a miss gets while the remote is not used."""
        short = {"down": "not answering", "refused": "refused by its check", "closed": "replaced"}
        wait = self.breaker.retry_in_s() + CHECK_ESTIMATE_S
        return RemoteUnavailableError(self.task, short.get(self.status, "not checked yet"), wait)

    def _failed(self, status: str, message: str, checking: bool) -> RemoteUnavailableError:
        with self._lock:
            self.counts["failures"] += 1
        if checking:  # the check reports it as its reason
            raise _CheckFailed(status, message)
        self.breaker.record_failure()
        if self.breaker.state is not BreakerState.CLOSED and self.usable:
            self._set(False, status, message)
            log.warning("%s: the remote model is skipped (%s); checked again in the background", self.task,
                        message)  # fmt: skip
            self._wake.set()
        return RemoteUnavailableError(self.task, "not answering" if status == "down" else "invalid answers",
                                      self.breaker.retry_in_s() + CHECK_ESTIMATE_S)  # fmt: skip

    def _set(self, usable: bool, status: str, reason: str | None) -> None:
        with self._lock:
            self.usable, self.status, self.reason = usable, status, reason
        self.on_change(None if usable else f"remote {status}: {reason}")

    # ---- identity and the exactness check -------------------------------------------------------

    def check(self, model: Any) -> str | None:
        """Read the server's config and run the probe set through it (see the module's docstring).
        None when it passed (the model now has the server's version), else why not; never raises."""
        with self._lock:
            self.counts["checks"] += 1
        previous = model.version
        self._local.checking = True
        try:
            served = self._client.config()
            reason = self._verify(model, served)
        except RemoteCallError as exc:
            reason, status = str(exc), "down"
        except _CheckFailed as exc:
            reason, status = exc.reason, exc.status
        except Exception as exc:  # a local failure (the reference, the probe inputs): refused, said
            log.warning("%s: the remote check failed", self.task, exc_info=True)
            reason, status = f"{type(exc).__name__}: {exc}"[:300], "refused"
        else:
            status = "refused"
        finally:
            self._local.checking = False
        if reason is None:
            self.breaker.record_success()
            self._set(True, "ok", None)
            if previous != model.version:
                log.info("%s: the remote model's version is %s (was %s): a new key space", self.task,
                         model.version, previous)  # fmt: skip
            return None
        if model.version != previous:  # a failed check leaves the last verified key space
            model.version = previous
        if status == "down":
            self._client.reset()  # the next check connects afresh
        self.breaker.trip()
        self._set(False, status, reason)
        return reason

    def _verify(self, model: Any, served: ServedConfig) -> str | None:
        if not served.version:
            return "the server's model config has no cache_model_version (make triton-repository writes it)"
        self._served = served
        probes = model.probe_inputs()
        local_version = model.local_version
        adopt = getattr(model, "adopt_export_state", lambda _metadata: False)
        model.version = served.version  # the key space (restored by check() if this fails)
        if served.version == local_version:
            expected = self._reference(model, probes)
            # The server's state (computed by torch at its export) when it is this version's, else
            # the local model's own: either way the probe compares the answers with torch's.
            if not (served.export_state and adopt(served.export_state)):
                adopt(None)
        else:
            expected = _stored_answers(served.probe, probe_digest(probes))
            if expected is None:
                return (f"the server serves version {served.version}, not the local {local_version}, and its "
                        "cache_probe is missing or for another probe set")  # fmt: skip
            if getattr(model, "export_state_keys", ()) and not adopt(served.export_state):
                adopt(None)
                return f"the server's cache_export_state does not fit version {served.version}"
        self.version = served.version
        got = _answers(model.predict_batch, probes, model)  # each probe alone, then all as one batch
        if len(expected) == len(probes) and len(got) == 2 * len(probes):
            expected = expected + expected  # recorded by a model that did not batch: the batch must agree too
        difference = compare(expected, got)
        return None if difference is None else f"probe: {difference}"

    def _reference(self, model: Any, probes: list[Any]) -> list[Any]:
        """The local model's answers to the probe set: torch's, as the local ONNX export recorded them
        for this very probe set (the CPU backend trusts the same), else computed by torch now; once
        per local version."""
        memo = getattr(model, "_remote_reference", None)
        if memo is not None and memo[0] == model.local_version:
            return memo[1]  # type: ignore[no-any-return]
        recorded = _recorded_answers(self._export_dir, model, probe_digest(probes))
        if recorded is not None:
            model._remote_reference = (model.local_version, recorded)
            return recorded
        getattr(model, "adopt_export_state", lambda _metadata: False)(None)  # torch's own state, too
        self._local.reference = True
        try:
            answers = _answers(model.predict_batch, probes, model)
        finally:
            self._local.reference = False
        model._remote_reference = (model.local_version, answers)
        return answers

    # ---- the background check ---------------------------------------------------------------------

    def start(self, model: Any) -> str | None:
        """The first check, now; then a thread that checks again, backing off, whenever the remote
        is not used (not reachable at start, failed its check, skipped by the breaker)."""
        reason = self.check(model)
        self._thread = threading.Thread(target=self._watch, args=(model,), name=f"remote-check-{self.task}",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        return reason

    def _watch(self, model: Any) -> None:
        while not self._closed:
            if self.usable:
                self._wake.wait()
                self._wake.clear()
                continue
            delay = self.breaker.retry_in_s()
            if delay > 0:
                self._wake.wait(delay)
                self._wake.clear()
                continue
            if self._closed:
                return
            reason = self.check(model)
            if reason is None:
                log.info("%s: the remote model is back (version %s)", self.task, model.version)
            else:
                log.info("%s: the remote model is still not used (%s); next check in %.1f s", self.task,
                         reason, self.breaker.retry_in_s())  # fmt: skip

    def state(self) -> dict[str, Any]:
        """For /readyz, the console and /metrics (no URL: /readyz is public)."""
        with self._lock:
            counts = dict(self.counts)
            status, reason, usable = self.status, self.reason, self.usable
        return {"status": status, "usable": usable, "reason": reason, "model": self._client.model,
                "version": self.version, "breaker": str(self.breaker.state),
                "retry_in_s": round(self.breaker.retry_in_s(), 2), **counts}  # fmt: skip

    def close(self) -> None:
        """Idempotent: the check thread stops, the client closes, later misses are refused."""
        if self._closed:
            return
        self._closed = True
        self._set(False, "closed", "the model was replaced or the app is stopping")
        self._wake.set()
        self._client.close()


class _CheckFailed(Exception):
    """A pass of the check failed: `status` (down, refused) and the check's `reason`."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def _recorded_answers(export_dir: Path | None, model: Any, tag: str) -> list[Any] | None:
    """Torch's probe answers kept in the local ONNX export of the local version, if there is one."""
    if export_dir is None:
        return None
    path = export_path(export_dir, model.name, model.local_version)
    if not path.is_file():
        return None
    try:
        import onnx

        graph = onnx.load(str(path), load_external_data=False)
    except Exception:  # unreadable: torch computes the reference
        return None
    metadata = {entry.key: entry.value for entry in graph.metadata_props}
    if metadata.get("model_version") != model.local_version:
        return None
    return _stored_answers(metadata.get("probe"), tag)


def _arrays(tensors: Mapping[str, torch.Tensor], inputs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    """The tensors the server's model takes, in its types (raises KeyError naming a missing one)."""
    arrays = {}
    for spec in inputs:
        array = tensors[spec.name].detach().cpu().numpy()
        arrays[spec.name] = np.ascontiguousarray(array, dtype=DTYPES[spec.dtype][0])
    return arrays


def _checked(answer: np.ndarray, inputs: Mapping[str, np.ndarray], output: TensorSpec) -> np.ndarray:
    """The answer, if it is one: the batch's rows, the config's dims (a variable one as the inputs'
    same axis, the text model's tokens), finite floats (raises _Garbage)."""
    first = next(iter(inputs.values()))
    if answer.dtype.kind != "f" or answer.ndim != 1 + len(output.dims) or answer.shape[0] != first.shape[0]:
        raise _Garbage(f"{answer.dtype} {tuple(answer.shape)} for {first.shape[0]} inputs, expected "
                       f"float (batch, {', '.join(map(str, output.dims))})")  # fmt: skip
    for axis, dim in enumerate(output.dims, start=1):
        size = answer.shape[axis]
        expected = dim if dim > 0 else (first.shape[axis] if axis < first.ndim else None)
        if expected is not None and size != expected:
            raise _Garbage(f"shape {tuple(answer.shape)}: axis {axis} is {size}, expected {expected}")
    if not np.isfinite(answer).all():
        raise _Garbage("NaN or infinite values")
    answer = np.ascontiguousarray(answer, dtype=np.float32)
    return answer if answer.flags.writeable else answer.copy()  # torch wants a writable buffer


def attach_remote(model: Any, *, task: str, url: str, remote_model: str, options: RemoteOptions,
                  export_dir: Path | None = None) -> str | None:  # fmt: skip
    """Serve `model` (a classifier with the backend seam) through the server: its misses batch,
    its version becomes the server's once checked. Returns why the remote is not used yet (its
    misses are refused meanwhile; a background check backs off and retries), or None."""
    client = RemoteClient(url, remote_model, connect_timeout_s=options.connect_timeout_s,
                          timeout_s=options.timeout_s)  # fmt: skip
    forward = RemoteForward(client, task=task, options=options, export_dir=export_dir)
    model.batch_misses = True  # misses that meet in one pass window go in one remote call
    model.local_version = model.version
    forward.on_change = lambda reason: setattr(model, "backend_reason", reason)
    model.use_remote(forward)
    started = time.perf_counter()
    reason = forward.start(model)
    if reason is None:
        log.info("%s: remote model %r at %s, version %s, checked in %.2f s", task, remote_model, url,
                 model.version, time.perf_counter() - started)  # fmt: skip
    else:
        log.warning("%s: remote model %r at %s is not used yet (%s): its misses are refused; checked again "
                    "in the background", task, remote_model, url, reason)  # fmt: skip
    return reason
