"""A real Triton Inference Server with its local response cache, for `bench.triton_peer`.

Run by the Triton venv's Python (`scripts/triton_venv.sh`: nvidia-pytriton 0.7.0, which ships
`tritonserver` 2.51, and numpy < 2), never by the app's: it imports nothing of this project.

    .venv-triton/bin/python bench/triton_server.py --http-port P --grpc-port G --metrics-port M

PyTriton binds one Python callable per task (`text`, `image`) with the app's /v2 signature:
one BYTES input named `input`, shape [-1]; outputs `label` (BYTES) and `score` (FP32), shape
[N, k]. The callables do not classify anything: they answer fixed labels and scores (only
cache hits are measured, so what they answer does not matter). Triton's response cache is on
(`--cache-config local,size=...` and `response_cache { enable: true }` on each model), so a
repeated request is answered from the cache and never reaches its callable.

Protocol on stdout/stdin, one JSON object a line: once the models are loaded the server prints
`{"ready": true, "http_port": ..., ...}`; each line `calls` on stdin is answered with
`{"calls": {"text": n, "image": n}}` (the callables' invocations so far); end of stdin stops it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading

import numpy as np
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

TASKS = ("text", "image")
INPUT_NAME = "input"
TOP_K = 5
CALLS = dict.fromkeys(TASKS, 0)
_LOCK = threading.Lock()


def make_infer(task: str):
    labels = np.array([f"{task}_label_{i}".encode() for i in range(TOP_K)], dtype=object)
    scores = np.array([0.5 / (i + 1) for i in range(TOP_K)], dtype=np.float32)

    def infer(requests):
        with _LOCK:
            CALLS[task] += len(requests)
        answers = []
        for request in requests:
            n = request[INPUT_NAME].shape[0]
            answers.append({"label": np.tile(labels, (n, 1)), "score": np.tile(scores, (n, 1))})
        return answers

    return infer


# The protocol's own channel: the original stdout. PyTriton prints tritonserver's log to
# stdout, so stdout itself (fd 1 and sys.stdout) is pointed at stderr before anything starts.
_PROTOCOL = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr


def emit(payload: dict) -> None:
    _PROTOCOL.write(json.dumps(payload) + "\n")
    _PROTOCOL.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--cache-bytes", type=int, default=64 * 2**20)
    parser.add_argument("--log-verbose", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    config = TritonConfig(
        http_address="127.0.0.1", http_port=args.http_port,
        grpc_address="127.0.0.1", grpc_port=args.grpc_port,
        metrics_address="127.0.0.1", metrics_port=args.metrics_port,
        cache_config=[f"local,size={args.cache_bytes}"],
        log_verbose=args.log_verbose, exit_timeout_secs=5,
    )  # fmt: skip
    # No token on the statistics endpoint: loopback only, and the bench reads cache hit counts there.
    security = TritonSecurityConfig(restricted_endpoints=[])
    with Triton(config=config, security_config=security) as triton:
        for task in TASKS:
            triton.bind(
                model_name=task,
                infer_func=make_infer(task),
                inputs=[Tensor(name=INPUT_NAME, dtype=bytes, shape=(-1,))],
                outputs=[
                    Tensor(name="label", dtype=bytes, shape=(-1, -1)),
                    Tensor(name="score", dtype=np.float32, shape=(-1, -1)),
                ],
                config=ModelConfig(batching=False, response_cache=True),
                strict=True,
            )
        triton.run()
        emit({"ready": True, "http_port": args.http_port, "grpc_port": args.grpc_port,
              "metrics_port": args.metrics_port})  # fmt: skip
        for line in sys.stdin:
            if line.strip() == "calls":
                with _LOCK:
                    emit({"calls": dict(CALLS)})


if __name__ == "__main__":
    main()
