"""Serve a model repository (`make triton-repository`) with a real Triton Inference Server.

Run by the Triton venv's Python (scripts/triton_venv.sh: nvidia-pytriton 0.7.0, which ships
`tritonserver` 2.51 and runs on a CPU, numpy < 2, onnxruntime), never the app's: it imports
nothing of this project but serving/triton_common.py.

    .venv-triton/bin/python serving/triton_serve.py --repository DIR --http-port 8000
    (make triton-serve DIR=.. PORT=..; gRPC on PORT+1, metrics on PORT+2 unless given)
    --response-cache-mb N: Triton's own local response cache on every model (off by default)

Each DIR/<task>/config.pbtxt (Triton's ModelConfig, text format) with its newest version folder's
model.onnx becomes one PyTriton-bound callable that runs the graph with ONNX Runtime: the same
name, inputs, output, max_batch_size and dynamic batching (so concurrent requests reach the
callable as one batch), and the config's `parameters` (cache_model_version, cache_probe,
cache_export_state), which `GET /v2/models/<task>/config` and tritonclient's get_model_config
return. Serves until Ctrl-C or SIGTERM, then stops tritonserver and exits 0.

With `--control` (the test server, testing/triton_server.py) it speaks serving/triton_common's
JSON-line protocol: `{"ready": true, ...}` once serving, then one answer per command on stdin:
`{"op": "calls"}` (rows, requests and callable batches per model so far),
`{"op": "delay", "seconds": s}` (each batch sleeps first), `{"op": "garbage", "mode": "nan" |
"shape" | null}` (answers NaN, or an output one column short); end of stdin stops it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: serving.triton_common

import numpy as np

from serving.triton_common import Protocol, add_port_arguments, ports, take_protocol_channel, triton_config

log = logging.getLogger("triton_serve")

DTYPES = {"TYPE_FP32": np.float32, "TYPE_FP16": np.float16, "TYPE_FP64": np.float64,
          "TYPE_INT64": np.int64, "TYPE_INT32": np.int32, "TYPE_INT8": np.int8, "TYPE_UINT8": np.uint8,
          "TYPE_BOOL": np.bool_}  # fmt: skip
GARBAGE = ("nan", "shape")


class RepositoryError(Exception):
    """The repository cannot be served; the message names the model and what is wrong."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: Any
    dims: tuple[int, ...]


@dataclass(frozen=True)
class ServedModel:
    """One model folder as served: its config's I/O, batching and parameters, its graph."""

    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    parameters: dict[str, str]  # config.pbtxt's, returned by /v2/models/<name>/config
    max_batch_size: int  # 0: no batching
    queue_delay_us: int
    graph: Path
    version: int = 1  # its version folder's number, the Triton model version calls may pin


def read_model(folder: Path) -> ServedModel:
    """One model folder: config.pbtxt parsed as Triton parses it, the newest version's model.onnx."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config_path = folder / "config.pbtxt"
    try:
        config = text_format.Parse(config_path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    except (OSError, UnicodeDecodeError, text_format.ParseError) as exc:
        raise RepositoryError(f"{config_path}: {exc}") from None
    if config.name and config.name != folder.name:
        raise RepositoryError(f"{config_path}: name {config.name!r} is not the folder's ({folder.name!r})")
    if config.platform not in ("onnxruntime_onnx", "") or config.backend not in ("onnxruntime", ""):
        kind = config.platform or config.backend
        raise RepositoryError(f"{config_path}: only ONNX models are served here, not {kind}")
    versions = sorted((int(p.name), p) for p in folder.iterdir()
                      if p.name.isdigit() and (p / "model.onnx").is_file())  # fmt: skip
    if not versions:
        raise RepositoryError(f"{folder}: no version folder with a model.onnx (e.g. {folder}/1/model.onnx)")

    def tensors(items: Any) -> tuple[Tensor, ...]:
        found = []
        for item in items:
            type_name = model_config_pb2.DataType.Name(item.data_type)
            if type_name not in DTYPES:
                raise RepositoryError(f"{config_path}: tensor {item.name!r} is {type_name}, not served here")
            found.append(Tensor(item.name, DTYPES[type_name], tuple(item.dims)))
        return tuple(found)

    return ServedModel(
        name=folder.name, graph=versions[-1][1] / "model.onnx", version=versions[-1][0],
        max_batch_size=config.max_batch_size,
        queue_delay_us=config.dynamic_batching.max_queue_delay_microseconds,
        inputs=tensors(config.input), outputs=tensors(config.output),
        parameters={key: value.string_value for key, value in config.parameters.items()},
    )  # fmt: skip


def read_repository(directory: Path) -> list[ServedModel]:
    if not directory.is_dir():
        raise RepositoryError(f"{directory} is not a directory (make triton-repository DIR=.. writes one)")
    folders = sorted(p for p in directory.iterdir()
                     if (p / "config.pbtxt").is_file() and not p.name.startswith("."))  # fmt: skip
    if not folders:
        raise RepositoryError(f"{directory} holds no model folder (<model>/config.pbtxt)")
    return [read_model(folder) for folder in folders]


class Behaviour:
    """What the callables count and the faults the test server switches on; thread-safe."""

    def __init__(self, names: list[str]) -> None:
        self._lock = threading.Lock()
        self.rows = dict.fromkeys(names, 0)
        self.requests = dict.fromkeys(names, 0)
        self.batches = dict.fromkeys(names, 0)
        self.delay_s = 0.0
        self.garbage: str | None = None

    def count(self, name: str, *, rows: int, requests: int) -> tuple[float, str | None]:
        with self._lock:
            self.rows[name] += rows
            self.requests[name] += requests
            self.batches[name] += 1
            return self.delay_s, self.garbage

    def command(self, doc: dict[str, Any]) -> dict[str, Any]:
        op = doc.get("op")
        with self._lock:
            if op == "calls":
                return {"rows": dict(self.rows), "requests": dict(self.requests),
                        "batches": dict(self.batches)}  # fmt: skip
            if op == "delay":
                seconds = doc.get("seconds")
                number = isinstance(seconds, int | float) and not isinstance(seconds, bool)
                if not number or not 0 <= seconds <= 3600:
                    return {"error": f"delay seconds {seconds!r} is not a number from 0 to 3600"}
                self.delay_s = float(seconds)
                return {"delay": self.delay_s}
            if op == "garbage":
                mode = doc.get("mode")
                if mode not in (*GARBAGE, None):
                    return {"error": f"garbage mode {mode!r} is not one of {GARBAGE} or null"}
                self.garbage = mode
                return {"garbage": mode}
        return {"error": f"unknown op {op!r}"}


def make_infer(model: ServedModel, session: Any, behaviour: Behaviour) -> Callable[[list[Any]], list[dict]]:
    """The callable of one model: Triton's dynamic batcher hands it the requests of one batch; those
    whose inputs have the same shapes (texts of one token length, every image) run as one pass."""
    input_names = [t.name for t in model.inputs]
    output = model.outputs[0].name

    def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        arrays = [{name: np.asarray(request[name]) for name in input_names} for request in requests]
        rows = [len(a[input_names[0]]) for a in arrays]
        delay_s, garbage = behaviour.count(model.name, rows=sum(rows), requests=len(requests))
        if delay_s:
            time.sleep(delay_s)
        groups: dict[tuple, list[int]] = {}
        for index, feeds in enumerate(arrays):
            groups.setdefault(tuple(feeds[n].shape[1:] for n in input_names), []).append(index)
        answers: list[np.ndarray | None] = [None] * len(requests)
        for members in groups.values():
            feeds = {n: np.concatenate([arrays[i][n] for i in members]) for n in input_names}
            result = session.run([output], feeds)[0]
            bounds = np.cumsum([rows[i] for i in members])[:-1]
            for index, part in zip(members, np.split(result, bounds), strict=True):
                answers[index] = part
        if garbage == "nan":
            answers = [np.full_like(a, np.nan) for a in answers]
        elif garbage == "shape":
            answers = [np.ascontiguousarray(a[..., :-1]) for a in answers]
        return [{output: a} for a in answers]

    return infer


def session_of(graph: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads  # 0: ONNX Runtime's choice (every core)
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])


def bind_all(triton: Any, models: list[ServedModel], behaviour: Behaviour, threads: int,
             *, response_cache: bool = False) -> None:  # fmt: skip
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.model_config import Tensor as TritonTensor

    for model in models:
        batching = model.max_batch_size > 0
        triton.bind(
            model_name=model.name,
            model_version=model.version,
            infer_func=make_infer(model, session_of(model.graph, threads), behaviour),
            inputs=[TritonTensor(name=t.name, dtype=t.dtype, shape=t.dims) for t in model.inputs],
            outputs=[TritonTensor(name=t.name, dtype=t.dtype, shape=t.dims) for t in model.outputs],
            config=ModelConfig(batching=batching, max_batch_size=max(1, model.max_batch_size),
                               batcher=DynamicBatcher(max_queue_delay_microseconds=model.queue_delay_us),
                               response_cache=response_cache),
            strict=False,  # the garbage modes answer shapes the config does not allow, on purpose
        )  # fmt: skip
    # PyTriton 0.7.0 has no public setter for a model's `parameters`: its model config object, built
    # on first use and loaded into tritonserver by run(), carries them as backend_parameters.
    by_name = {m.name: m for m in models}
    for bound in triton._model_manager.models:
        bound._get_triton_model_config().backend_parameters.update(by_name[bound.model_name].parameters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, required=True, help="the model repository to serve")
    add_port_arguments(parser)
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads a model (0: all cores)")
    parser.add_argument("--control", action="store_true", help="the test server's stdin/stdout protocol")
    parser.add_argument("--workspace", type=Path, help="PyTriton's workspace (default: a temp dir)")
    parser.add_argument("--response-cache-mb", type=int, default=0,
                        help="Triton's own local response cache of this size on every model (0: off)")
    args = parser.parse_args()
    protocol: Protocol | None = take_protocol_channel() if args.control else None
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    for name in ("pytriton", "tritonclient"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        models = read_repository(args.repository)
    except RepositoryError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    from pytriton.triton import Triton, TritonSecurityConfig

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    behaviour = Behaviour([m.name for m in models])
    # No token on the statistics endpoint either: tritonclient's get_inference_statistics works.
    # Triton's response cache (off unless asked: this app caches in front of it; bench.remote compares).
    size = args.response_cache_mb * 2**20
    cache = {"cache_config": [f"local,size={size}"]} if size else {}
    triton = Triton(config=triton_config(args, **cache), workspace=args.workspace,
                    security_config=TritonSecurityConfig(restricted_endpoints=[]))  # fmt: skip
    try:
        bind_all(triton, models, behaviour, args.threads, response_cache=bool(args.response_cache_mb))
        triton.run()
        chosen = ports(args)
        for model in models:
            log.info("serving %s (%s, cache_model_version %s)", model.name, model.graph,
                     model.parameters.get("cache_model_version", "-"))  # fmt: skip
        log.info("HTTP on %s:%d, gRPC on %d, metrics on %d; Ctrl-C stops", args.address, chosen["http_port"],
                 chosen["grpc_port"], chosen["metrics_port"])  # fmt: skip
        if protocol is not None:
            protocol.emit({"ready": True, **chosen})
            threading.Thread(target=_commands, args=(protocol, behaviour, stop), daemon=True).start()
        while not stop.wait(1.0):
            if not triton.is_alive():
                log.error("tritonserver or a model's callable stopped")
                raise SystemExit(1)
    except KeyboardInterrupt:
        pass
    finally:
        triton.stop()
    log.info("stopped")


def _commands(protocol: Protocol, behaviour: Behaviour, stop: threading.Event) -> None:
    import json

    for line in sys.stdin:
        try:
            doc = json.loads(line)
        except ValueError:
            protocol.emit({"error": f"not a JSON line: {line.strip()[:80]!r}"})
            continue
        protocol.emit(behaviour.command(doc if isinstance(doc, dict) else {}))
    stop.set()


if __name__ == "__main__":
    main()
