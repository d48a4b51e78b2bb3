"""The wire to a remote model (engine.models.remote): tritonclient over HTTP or gRPC, binary tensor
data, bounded timeouts. One worker thread owns the client: tritonclient's HTTP client is not
thread-safe and its gevent sockets belong to the thread that made them; a caller waits for its call
at most the call's timeout (the client's own timeouts free the worker soon after)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# The Triton config's data types that the exported graphs use, as numpy and as the wire names them.
DTYPES = {"TYPE_FP32": (np.float32, "FP32"), "TYPE_INT64": (np.int64, "INT64"),
          "TYPE_INT32": (np.int32, "INT32"), "TYPE_FP16": (np.float16, "FP16")}  # fmt: skip


def version_folder(model_version: str) -> str:
    """The Triton model version (its numbered folder) that `make triton-repository` gives this
    app's model version: a digest of it, so another model is always another number. Calls pin it
    (engine.models.remote): a server whose model was swapped refuses them, never answering from
    the new model under the old one's keys, even between two checks or during a pass."""
    digest = hashlib.sha256(model_version.encode()).digest()
    return str(int.from_bytes(digest[:6], "big") + 1)  # 1 .. 2**48: an int64 and exact in JSON


class RemoteCallError(Exception):
    """A call to the server failed: not reachable, too slow, or an error answer (the message says)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # TYPE_FP32, TYPE_INT64, ...
    dims: tuple[int, ...]  # without the batch axis; -1: variable


@dataclass(frozen=True)
class ServedConfig:
    """What the server says of the model: its I/O, its batch limit and this app's parameters."""

    inputs: tuple[TensorSpec, ...]
    output: TensorSpec
    max_batch: int  # 0: the server does not batch (one input a call)
    version: str | None  # cache_model_version
    probe: str | None  # cache_probe: {"tag": ..., "answers": [...]}
    export_state: dict[str, str]  # cache_export_state, e.g. the text model's centroids
    served_versions: tuple[str, ...] = ()  # the Triton version numbers the server has loaded

    @property
    def pinned(self) -> str | None:
        """The Triton version each call names: the one `version_folder` gives this model version
        when the server has it (a repository this app wrote), else the newest it serves (a
        repository written by hand: a model swapped within that number goes unseen until the next
        check), None when the server lists none."""
        if self.version and version_folder(self.version) in self.served_versions:
            return version_folder(self.version)
        numbers = [v for v in self.served_versions if v.isdigit()]
        return max(numbers, key=int) if numbers else None

    @classmethod
    def parse(cls, config: dict[str, Any], served_versions: tuple[str, ...] = ()) -> ServedConfig:
        """From the model configuration as JSON (HTTP's, or gRPC's with int64 values as strings)."""
        def tensor(doc: dict[str, Any]) -> TensorSpec:
            dtype = str(doc.get("data_type", ""))
            if dtype not in DTYPES:
                raise ValueError(f"tensor {doc.get('name')!r} has data type {dtype!r}")
            return TensorSpec(str(doc["name"]), dtype, tuple(int(d) for d in doc.get("dims", ())))

        params = {k: (v or {}).get("string_value") for k, v in (config.get("parameters") or {}).items()}
        outputs = [tensor(o) for o in config.get("output") or ()]
        if len(outputs) != 1:
            raise ValueError(f"the model has {len(outputs)} outputs; the exported graphs have one")
        raw_state = params.get("cache_export_state") or "{}"
        state = json.loads(raw_state)
        if not isinstance(state, dict) or not all(isinstance(v, str) for v in state.values()):
            raise ValueError("cache_export_state is not a JSON object of strings")
        return cls(inputs=tuple(tensor(i) for i in config.get("input") or ()), output=outputs[0],
                   max_batch=int(config.get("max_batch_size") or 0),
                   version=params.get("cache_model_version"), probe=params.get("cache_probe"),
                   export_state=state, served_versions=served_versions)  # fmt: skip


class RemoteClient:
    """One server, one model. `config()` and `infer()` raise RemoteCallError; `close()` is
    idempotent, and a call after it raises too."""

    def __init__(self, url: str, model: str, *, connect_timeout_s: float, timeout_s: float) -> None:
        scheme, _, address = url.partition("://")
        if scheme not in ("http", "grpc") or not address:
            raise ValueError(f"remote URL {url!r}: use http://host:port or grpc://host:port")
        self.url, self.model = url, model
        self._grpc = scheme == "grpc"
        self._address = address
        self._connect_s, self._timeout_s = connect_timeout_s, timeout_s
        self._client: Any = None  # made in, and only used by, the worker thread
        self._closed = threading.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"remote-{model}")

    @property
    def deadline_s(self) -> float:
        """The longest a call waits: connecting, then the call itself."""
        return self._connect_s + self._timeout_s

    def _connected(self) -> Any:
        if self._client is None:
            if self._grpc:
                import tritonclient.grpc as grpcclient

                self._client = grpcclient.InferenceServerClient(url=self._address)
            else:
                import tritonclient.http as httpclient

                self._client = httpclient.InferenceServerClient(
                    url=self._address, connection_timeout=self._connect_s, network_timeout=self._timeout_s,
                )  # fmt: skip
        return self._client

    def _call(self, work: Any, what: str) -> Any:
        if self._closed.is_set():
            raise RemoteCallError("the client is closed")
        try:
            future: Future[Any] = self._worker.submit(work)
        except RuntimeError:  # shut down meanwhile
            raise RemoteCallError("the client is closed") from None
        try:
            return future.result(timeout=self.deadline_s + 0.5)
        except FutureTimeout:
            future.cancel()
            raise RemoteCallError(f"{what}: no answer within {self.deadline_s:.1f} s") from None
        except RemoteCallError:
            raise
        except Exception as exc:  # tritonclient, gevent, grpc and socket errors alike: the server failed
            text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise RemoteCallError(f"{what}: {type(exc).__name__}{': ' + text if text else ''}") from None

    def config(self) -> ServedConfig:
        def work() -> ServedConfig:
            client = self._connected()
            if self._grpc:
                answer = client.get_model_config(self.model, as_json=True, client_timeout=self.deadline_s)
                doc = answer["config"]
                metadata = client.get_model_metadata(self.model, as_json=True, client_timeout=self.deadline_s)
            else:
                doc = client.get_model_config(self.model)
                metadata = client.get_model_metadata(self.model)
            try:
                versions = tuple(str(v) for v in (metadata or {}).get("versions") or ())
                return ServedConfig.parse(doc, versions)
            except (ValueError, KeyError, TypeError) as exc:
                raise RemoteCallError(f"the model config of {self.model!r} is not usable: {exc}") from None

        return self._call(work, "reading the model config")  # type: ignore[no-any-return]

    def infer(self, arrays: dict[str, np.ndarray], output: str, version: str | None = None) -> np.ndarray:
        """One call with these inputs (batch axis first), binary tensor data both ways; `version`:
        the Triton model version it must reach (the server refuses the call without it)."""
        def work() -> np.ndarray:
            client = self._connected()
            if self._grpc:
                import tritonclient.grpc as module
            else:
                import tritonclient.http as module  # type: ignore[no-redef]
            inputs = []
            for name, array in arrays.items():
                wire = module.InferInput(name, list(array.shape), _wire_type(array))
                if self._grpc:
                    wire.set_data_from_numpy(array)
                else:
                    wire.set_data_from_numpy(array, binary_data=True)
                inputs.append(wire)
            if self._grpc:
                wanted = [module.InferRequestedOutput(output)]
                result = client.infer(self.model, inputs, model_version=version or "", outputs=wanted,
                                      client_timeout=self.deadline_s)  # fmt: skip
            else:
                wanted = [module.InferRequestedOutput(output, binary_data=True)]
                result = client.infer(self.model, inputs, model_version=version or "", outputs=wanted)
            answer = result.as_numpy(output)
            if answer is None:
                raise RemoteCallError(f"the answer has no output {output!r}")
            return np.asarray(answer)

        return self._call(work, "inference")  # type: ignore[no-any-return]

    def _release(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # closing a client whose server is gone: nothing left to free
                log.debug("closing the %s client failed", self.url, exc_info=True)
            self._client = None

    def reset(self) -> None:
        """Drop the connection; the next call makes a new one. After the server restarted, a gRPC
        channel would otherwise wait out its own reconnect backoff (up to minutes)."""
        try:
            self._worker.submit(self._release)
        except RuntimeError:  # closed
            pass

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.reset()
        self._worker.shutdown(wait=False, cancel_futures=False)


def _wire_type(array: np.ndarray) -> str:
    for numpy_type, wire in DTYPES.values():
        if array.dtype == numpy_type:
            return wire
    raise RemoteCallError(f"cannot send a tensor of {array.dtype}")
