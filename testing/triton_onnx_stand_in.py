"""A Python-based stand-in for Triton's ONNX Runtime backend: `model.py` of a backend named
`onnxruntime` (Triton's "Python-based backends"), so that the tritonserver nvidia-pytriton ships
(which has only the Python backend) loads a model repository exactly as written, config.pbtxt
with `platform: "onnxruntime_onnx"` included (testing.triton_server.BareTritonServer).

Runs in Triton's Python-backend stub with the Triton venv's packages, never in the app: it
imports nothing of this project. Each request runs the version's model.onnx with ONNX Runtime.
"""

from __future__ import annotations

import json
from typing import Any

import onnxruntime
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        graph = f"{args['model_repository']}/{args['model_version']}/model.onnx"
        self.session = onnxruntime.InferenceSession(graph, providers=["CPUExecutionProvider"])
        self.inputs = [tensor["name"] for tensor in config["input"]]
        self.output = config["output"][0]["name"]

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            tensors = (pb_utils.get_input_tensor_by_name(request, name) for name in self.inputs)
            feeds = {name: tensor.as_numpy() for name, tensor in zip(self.inputs, tensors, strict=True)}
            result = self.session.run([self.output], feeds)[0]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(self.output, result)]))
        return responses
