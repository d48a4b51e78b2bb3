"""A client of the app's REST API: the Open Inference Protocol v2 (KServe, Triton, MLServer), JSON.

`POST /v2/models/{task}/infer` with one BYTES input tensor named `input`: a text as a JSON
string; an image's file bytes base64-encoded, with `"parameters": {"content_type": "base64"}`
on the tensor. The answer's outputs are `label` (BYTES) and `score` (FP32), top-k in order;
its `parameters` carry the engine's `cache_info` (flat for a single element). Errors come
as `{"error": "..."}` with 400, 404, 413 or 503. One keep-alive `httpx.Client` per client.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import httpx

INPUT_NAME = "input"


@dataclass(frozen=True)
class OipAnswer:
    labels: tuple[tuple[str, float], ...]  # top-k (label, score), best first
    cache_info: dict[str, Any]


class OipError(RuntimeError):
    """A refused request: its HTTP status and the server's `error` message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def infer_body(raw: str | bytes) -> dict[str, Any]:
    """The JSON body of a one-element infer request: text as a string, bytes as base64."""
    tensor: dict[str, Any] = {"name": INPUT_NAME, "shape": [1], "datatype": "BYTES"}
    if isinstance(raw, bytes):
        tensor["data"] = [base64.b64encode(raw).decode("ascii")]
        tensor["parameters"] = {"content_type": "base64"}
    else:
        tensor["data"] = [raw]
    return {"inputs": [tensor]}


def parse_answer(body: dict[str, Any]) -> OipAnswer:
    """The first element's labels and scores, and its cache_info."""
    outputs = {tensor["name"]: tensor for tensor in body["outputs"]}
    label, score = outputs["label"], outputs["score"]
    k = label["shape"][-1] if label.get("shape") else len(label["data"])
    names, scores = _flat(label["data"])[:k], _flat(score["data"])[:k]
    parameters = dict(body.get("parameters") or {})
    infos = json.loads(parameters.pop("cache_info", "[]"))
    info = infos[0] if infos else parameters
    return OipAnswer(tuple((str(n), float(s)) for n, s in zip(names, scores, strict=True)), info)


def _flat(data: list[Any]) -> list[Any]:
    """OIP allows row-major nested lists as well as a flat one."""
    out: list[Any] = []
    for item in data:
        out.extend(_flat(item) if isinstance(item, list) else [item])
    return out


class OipHttpClient:
    """A keep-alive JSON client of one app's /v2 routes. Not thread-safe: one per client thread."""

    def __init__(self, base_url: str, *, timeout_s: float = 60.0) -> None:
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)

    def infer(self, task: str, raw: str | bytes) -> OipAnswer:
        response = self.http.post(f"/v2/models/{task}/infer", json=infer_body(raw))
        if response.status_code != 200:
            try:
                message = str(response.json().get("error"))
            except (ValueError, AttributeError):
                message = response.text[:300]
            raise OipError(response.status_code, message)
        return parse_answer(response.json())

    def ready(self) -> bool:
        return self.http.get("/v2/health/ready").status_code == 200

    def close(self) -> None:
        self.http.close()
