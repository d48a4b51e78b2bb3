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

The JSON-line protocol of serving/triton_common.py: once the models are loaded the server prints
`{"ready": true, "http_port": ..., ...}`; each line `{"op": "calls"}` on stdin is answered with
`{"calls": {"text": n, "image": n}}` (the callables' invocations so far); end of stdin stops it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: serving.triton_common

import numpy as np
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonSecurityConfig

from serving.triton_common import add_port_arguments, ports, take_protocol_channel, triton_config

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_port_arguments(parser)
    parser.add_argument("--cache-bytes", type=int, default=64 * 2**20)
    args = parser.parse_args()
    protocol = take_protocol_channel()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    config = triton_config(args, cache_config=[f"local,size={args.cache_bytes}"])
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
        protocol.emit({"ready": True, **ports(args)})
        for line in sys.stdin:
            if json.loads(line).get("op") == "calls":
                with _LOCK:
                    protocol.emit({"calls": dict(CALLS)})
            else:
                protocol.emit({"error": f"unknown command {line.strip()[:80]!r}"})


if __name__ == "__main__":
    main()
