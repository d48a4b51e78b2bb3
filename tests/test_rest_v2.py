"""The Open Inference Protocol v2 REST API, through the real `tritonclient[http]` client
(plain httpx and raw sockets for the requests tritonclient cannot send)."""

from __future__ import annotations

import base64
import gzip
import json
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from fastapi import FastAPI
from gradio_client import Client
from sqlalchemy import select
from tritonclient.utils import InferenceServerException

from api import DirectInfer, build_oip_router, oip_body_limit
from runtime import Runtime, build_runtime
from settings import Settings
from storage.redis.embedded import EmbeddedRedis
from storage.sql import RequestRow, make_engine
from testing.raw_http import exchange
from tests.conftest import CountingTextModel, FailingModel, free_port
from ui.server import BackgroundServer, build_app, serve_runtime

PARCEL = "Where is my parcel? It's a week late"
CACHE_INFO_FIELDS = {"tier", "key", "model", "model_version", "generation", "latency_ms", "device", "backend",
                     "age_s"}  # fmt: skip
SMALL_UPLOAD = 30_000  # stand-in servers: a body limit of oip_body_limit(30 000) = 105 536 bytes


@dataclass
class Served:
    url: str
    runtime: Runtime
    client: triton.InferenceServerClient

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=30, **kwargs)


def _serve(runtime: Runtime) -> tuple[BackgroundServer, Served]:
    server = serve_runtime(runtime, port=free_port())  # the path `make run` serves
    client = triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=120)
    return server, Served(server.url, runtime, client)


@pytest.fixture(scope="module")
def real_served(
    real_models: dict[str, Any],
    base_settings: Settings,
    redis_binary: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    """The real models behind a real Redis, served once for this module (each test flushes)."""
    folder = tmp_path_factory.mktemp("rest")
    redis = EmbeddedRedis(data_dir=folder / "redis", maxmemory_mb=64, binary=redis_binary, port=free_port(),
                          save=False)  # fmt: skip
    redis.start()
    runtime = build_runtime(base_settings.changed(server__data_dir=folder / "data", redis__url=redis.url),
                            models=real_models)  # fmt: skip
    server, served = _serve(runtime)
    try:
        yield served
    finally:
        served.client.close()
        server.close()
        runtime.close()
        redis.close()


@pytest.fixture
def real(real_served: Served) -> Served:
    """The module's server with every tier empty, so that tiers are predictable."""
    real_served.runtime.engine.flush("all")
    return real_served


@pytest.fixture
def serve_standin(make_runtime) -> Iterator[Callable[..., Served]]:
    """Servers over stand-in models (the model is not the subject), small upload limit."""
    started: list[tuple[BackgroundServer, Served]] = []

    def start(**runtime_args: Any) -> Served:
        runtime_args.setdefault("limits__max_upload_bytes", SMALL_UPLOAD)
        started.append(_serve(make_runtime(**runtime_args)))
        return started[-1][1]

    yield start
    for server, served in reversed(started):
        served.client.close()
        server.close()


def text_input(texts: list[str], *, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("input", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_), binary_data=binary)
    return tensor


def image_input(files: list[bytes]) -> triton.InferInput:
    tensor = triton.InferInput("input", [len(files)], "BYTES")
    tensor.set_data_from_numpy(np.array(files, dtype=np.object_), binary_data=True)
    return tensor


def outputs(*, binary: bool) -> list[triton.InferRequestedOutput]:
    return [triton.InferRequestedOutput(name, binary_data=binary) for name in ("label", "score")]


def answers(result: triton.InferResult) -> tuple[list[list[str]], np.ndarray, list[dict[str, Any]]]:
    """(labels per element, scores per element, cache_info per element)."""
    # tritonclient gives BYTES as bytes from binary data and as str from JSON.
    labels = [[v.decode() if isinstance(v, bytes) else v for v in row] for row in result.as_numpy("label")]
    cache_info = json.loads(result.get_response()["parameters"]["cache_info"])
    return labels, result.as_numpy("score"), cache_info


def json_body(data: list[Any], *, shape: list[int] | None = None, **input_fields: Any) -> dict[str, Any]:
    tensor = {
        "name": "input",
        "shape": shape or [len(data)],
        "datatype": "BYTES",
        "data": data,
        **input_fields,
    }
    return {"inputs": [tensor]}


def refusal(call: Callable[[], Any]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as error:
        call()
    return error.value


# ---- answers ------------------------------------------------------------------


def test_text_json_and_binary_answer_as_the_gradio_path(real: Served) -> None:
    result = real.client.infer("text", [text_input([PARCEL], binary=False)], outputs=outputs(binary=False))
    assert result.get_output("label")["data"]  # JSON, not binary, as asked
    labels, scores, infos = answers(result)
    assert labels[0][0] == "order_status" and len(labels[0]) == 5 and scores.shape == (1, 5)
    assert scores.dtype == np.float32 and np.all(np.diff(scores[0]) <= 0)
    params = result.get_response()["parameters"]
    assert infos[0]["tier"] == "miss" and set(infos[0]) == CACHE_INFO_FIELDS
    assert {k: params[k] for k in CACHE_INFO_FIELDS} == infos[0]  # flat fields for one element
    assert result.get_response()["model_version"] == real.runtime.engine.models["text"].version

    # The same message (spacing, case) in binary: a hit on the same key, the same answer.
    again = real.client.infer("text", [text_input(["  where is my PARCEL?  it's a week late "], binary=True)])
    assert "data" not in again.get_output("label")  # binary by default (tritonclient asks so)
    again_labels, again_scores, again_infos = answers(again)
    assert again_infos[0]["tier"] == "l1" and again_infos[0]["key"] == infos[0]["key"]
    assert again_labels == labels and np.array_equal(again_scores, scores)

    # Gradio's path serves the entry REST wrote, and gives the same classes and scores.
    label, info = Client(real.url + "/", verbose=False).predict(PARCEL, api_name="/classify_text")
    assert info["tier"] == "l1" and info["key"] == infos[0]["key"]
    assert [c["label"] for c in label["confidences"]] == labels[0]
    assert np.array_equal(np.float32([c["confidence"] for c in label["confidences"]]), scores[0])


def test_image_binary_and_json_base64(real: Served, photo_bytes) -> None:
    chelsea = photo_bytes("chelsea.png")
    labels, scores, infos = answers(real.client.infer("image", [image_input([chelsea])]))
    assert labels[0][0] == "tabby" and infos[0]["tier"] == "miss"
    assert infos[0]["model"] == "efficientnet-lite0" and scores.shape == (1, 5)

    body = json_body([base64.b64encode(chelsea).decode()], parameters={"content_type": "base64"})
    response = real.post("/v2/models/image/infer", json=body)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    answer = response.json()
    by_name = {o["name"]: o for o in answer["outputs"]}
    assert by_name["label"]["data"] == labels[0] and by_name["label"]["shape"] == [1, 5]
    assert np.array_equal(np.float32(by_name["score"]["data"]), scores[0])  # JSON equals binary exactly
    assert answer["parameters"]["tier"] == "l1" and answer["parameters"]["key"] == infos[0]["key"]

    engine_answer = real.runtime.engine.classify("image", chelsea)  # the engine itself, from the cache
    assert [n for n, _ in engine_answer.prediction.labels] == labels[0]
    assert np.array_equal(np.float32([s for _, s in engine_answer.prediction.labels]), scores[0])


def test_a_large_json_body_is_counted_once(
    real: Served, photo_bytes: Callable[[str], bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A photo in base64 (a body over 256 KiB, parsed on the event loop): its JSON separators are
    counted once, to choose the event loop, and not again by the parser (api/oip.py `_infer`)."""
    import api.oip
    import api.tensors

    counted: list[int] = []
    count = api.tensors.json_separators

    def counting(data: bytes) -> int:
        counted.append(len(data))
        return count(data)

    monkeypatch.setattr(api.oip, "json_separators", counting)
    monkeypatch.setattr(api.tensors, "json_separators", counting)
    photo = base64.b64encode(photo_bytes("chelsea.png")).decode()
    encoded = json.dumps(json_body([photo], parameters={"content_type": "base64"})).encode()
    assert 2 * api.tensors.MAX_JSON_VALUES < len(encoded) <= api.oip.INLINE_BINARY_BYTES  # both would count
    headers = {"content-type": "application/json"}
    for tier in ("miss", "l1"):
        response = real.post("/v2/models/image/infer", content=encoded, headers=headers)
        assert response.status_code == 200 and response.json()["parameters"]["tier"] == tier
    assert counted == [len(encoded)] * 2


def test_a_batch_answers_each_element_through_the_cache(real: Served, photo_bytes) -> None:
    texts = ["I was charged twice for the same order", "I forgot my password and can't log in",
             "Can I talk to a real person please?"]  # fmt: skip
    first_labels, first_scores, _ = answers(real.client.infer("text", [text_input(texts[:1], binary=True)]))
    labels, scores, infos = answers(real.client.infer("text", [text_input(texts, binary=True)]))
    assert scores.shape == (3, 5) and len(infos) == 3
    assert [i["tier"] for i in infos] == ["l1", "miss", "miss"]  # the first was asked alone before
    assert labels[0] == first_labels[0] and np.array_equal(scores[0], first_scores[0])
    assert len({i["key"] for i in infos}) == 3
    assert labels[1][0] == "account_login" and labels[2][0] == "human_agent"
    again = real.client.infer("text", [text_input(texts, binary=False)], outputs=outputs(binary=False))
    again_labels, again_scores, again_infos = answers(again)
    assert [i["tier"] for i in again_infos] == ["l1"] * 3
    assert again_labels == labels and np.array_equal(again_scores, scores)
    assert "tier" not in again.get_response()["parameters"]  # flat fields only for one element

    photos = [photo_bytes("chelsea.png"), photo_bytes("coffee.png")]
    image_labels, image_scores, image_infos = answers(real.client.infer("image", [image_input(photos)]))
    assert [row[0] for row in image_labels] == ["tabby", "espresso"] and image_scores.shape == (2, 5)
    assert [i["tier"] for i in image_infos] == ["miss", "miss"]


class BatchingTextModel(CountingTextModel):
    """A stand-in that opts into the engine's micro-batching, as the real text model does."""

    batch_misses = True


def test_a_batchs_misses_run_together(serve_standin) -> None:
    model = BatchingTextModel(delay_s=0.3)
    served = serve_standin(models={"text": model})
    texts = [f"My order number {n} never arrived" for n in range(8)]
    _, _, infos = answers(served.client.infer("text", [text_input(texts, binary=True)]))
    assert [i["tier"] for i in infos] == ["miss"] * 8
    # One at a time would take 8 forward passes; together, the first runs alone and the
    # others wait for it and share the next one.
    assert model.calls <= 3, model.calls


def test_outputs_chosen_one_by_one_and_request_id(real: Served) -> None:
    asked = [triton.InferRequestedOutput("score", binary_data=False), triton.InferRequestedOutput("label")]
    result = real.client.infer("text", [text_input([PARCEL], binary=True)], outputs=asked, request_id="r-1",
                               request_compression_algorithm="gzip")  # fmt: skip
    response = result.get_response()
    assert response["id"] == "r-1" and [o["name"] for o in response["outputs"]] == ["score", "label"]
    assert "data" in response["outputs"][0] and "data" not in response["outputs"][1]
    assert result.as_numpy("label")[0, 0] == b"order_status"
    only_label = real.client.infer("text", [text_input([PARCEL], binary=False)],
                                   outputs=[triton.InferRequestedOutput("label", binary_data=False)],
                                   request_compression_algorithm="deflate")  # fmt: skip
    assert only_label.as_numpy("score") is None and only_label.get_response()["parameters"]["tier"] == "l1"


# ---- metadata -------------------------------------------------------------------


def test_health_and_metadata(real: Served) -> None:
    client = real.client
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    for task, model in real.runtime.engine.models.items():
        meta = client.get_model_metadata(task)
        assert meta["name"] == task and meta["versions"] == [model.version]
        assert meta["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
        assert [(o["name"], o["datatype"]) for o in meta["outputs"]] == [
            ("label", "BYTES"),
            ("score", "FP32"),
        ]
        assert client.is_model_ready(task) and client.is_model_ready(task, model_version=model.version)
        assert client.get_model_metadata(task, model_version=model.version) == meta
        assert not client.is_model_ready(task, model_version="not-" + model.version)
    version = real.runtime.engine.models["text"].version
    pinned = client.infer("text", [text_input([PARCEL], binary=True)], model_version=version)
    assert pinned.get_response()["model_version"] == version
    error = refusal(lambda: client.infer("text", [text_input([PARCEL], binary=True)], model_version="v0"))
    assert error.status() == "404" and version in error.message()


def test_unknown_model_is_404(real: Served) -> None:
    client = real.client
    error = refusal(lambda: client.infer("nope", [text_input(["hi"], binary=True)]))
    assert error.status() == "404" and error.message() == "Unknown model 'nope'. Models: image, text."
    assert refusal(lambda: client.get_model_metadata("nope")).status() == "404"
    assert not client.is_model_ready("nope")
    response = httpx.get(real.url + "/v2/models/nope/ready")
    assert response.status_code == 404 and "Unknown model" in response.json()["error"]


def test_openapi_page_lists_the_v2_routes(real: Served) -> None:
    schema = httpx.get(real.url + "/openapi.json").json()
    assert {"/v2", "/v2/health/ready", "/v2/models/{model}", "/v2/models/{model}/infer"} <= set(
        schema["paths"]
    )
    page = httpx.get(real.url + "/docs")
    assert page.status_code == 200 and "swagger" in page.text.lower()


# ---- errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "payload", "message"),
    [
        ("text", "", "The message is empty. Please type a question."),
        ("text", " \t\n ", "The message is empty. Please type a question."),
        ("image", b"this is a text file, not a picture\n", "This file is not an image we can read."),
        ("image", b"", "The uploaded file is empty (0 bytes)."),
        ("image", None, "The image file is truncated or corrupted."),  # a truncated PNG
    ],
)
def test_bad_input_is_400_with_the_engines_message(real: Served, photo_bytes, task, payload, message) -> None:
    if payload is None:
        payload = photo_bytes("coffee.png")[:3000]
    tensor = image_input([payload]) if task == "image" else text_input([payload], binary=False)
    for _ in range(2):  # the second time from the negative cache
        error = refusal(lambda: real.client.infer(task, [tensor]))
        assert error.status() == "400" and error.message().startswith(message)
        single = error.message()
    if task == "text":
        batch = text_input(["fine", payload], binary=True)
    else:
        batch = image_input([photo_bytes("chelsea.png"), payload])
    error = refusal(lambda: real.client.infer(task, [batch]))
    assert error.status() == "400" and error.message() == f"Element 1: {single}"


def test_a_failing_model_is_503_and_nothing_is_cached(serve_standin) -> None:
    served = serve_standin(models={"text": FailingModel()})
    for _ in range(2):
        error = refusal(lambda: served.client.infer("text", [text_input(["hello"], binary=True)]))
        assert error.status() == "503" and error.message() == "The text model failed: ModelError."
    assert served.runtime.engine.models["text"].calls == 2  # not cached, not remembered


def _body_limit() -> int:
    return oip_body_limit(SMALL_UPLOAD)


def test_oversized_bodies_are_413(serve_standin) -> None:
    served = serve_standin()
    limit = _body_limit()
    assert limit == 4 * 10_000 + 64 * 1024
    # tritonclient (Content-Length): a batch whose body is over the limit.
    error = refusal(lambda: served.client.infer("text", [text_input(["y" * 45_000] * 3, binary=True)]))
    assert error.status() == "413" and f"{limit:,} bytes" in error.message()
    # Chunked, without Content-Length: counted while streaming, about 3 MB offered.
    chunks = (b"x" * 65536 for _ in range(50))
    response = served.post("/v2/models/text/infer", content=chunks)
    assert response.status_code == 413 and response.json()["error"].startswith("The request body is larger")
    # Exactly at the limit is not refused for its size.
    padded = json.dumps(json_body(["hello"])).encode()
    padded += b" " * (limit - len(padded))
    assert served.post("/v2/models/text/infer", content=padded).status_code == 200


def test_a_declared_oversize_is_refused_before_the_body_is_sent(serve_standin) -> None:
    served = serve_standin()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = f"POST /v2/models/text/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {_body_limit() + 1}\r\n\r\n".encode())
        reply = b""  # no byte of the body is ever sent
        while b"}" not in reply and (chunk := sock.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"larger than the limit" in reply


def test_a_chunked_body_is_read_no_further_than_the_limit(make_runtime) -> None:
    """In process, with an endless body: the router stops pulling chunks at the limit."""
    limit = 100_000
    app = FastAPI()
    app.include_router(build_oip_router(make_runtime().engine, max_body_bytes=limit))
    pulled = 0

    async def endless() -> Any:
        nonlocal pulled
        while True:
            pulled += 8192
            yield b"x" * 8192

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v2/models/text/infer", content=endless())

    response = anyio.run(post)
    assert response.status_code == 413
    assert limit < pulled <= limit + 8192


def _binary_request(header: dict[str, Any], tail: bytes) -> dict[str, Any]:
    head = json.dumps(header).encode()
    return {"content": head + tail, "headers": {"Inference-Header-Content-Length": str(len(head))}}


def _bytes_element(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


def _nested(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with the value "NESTED" a list 1,000 deep: repr() of it recursed past Python's
    limit in a refusal message (a 500)."""
    return {"content": json.dumps(body).replace('"NESTED"', "[" * 1000 + "]" * 1000).encode()}


def _binary_input(size: int, count: int = 1) -> dict[str, Any]:
    return {"inputs": [{"name": "input", "shape": [count], "datatype": "BYTES",
                        "parameters": {"binary_data_size": size}}]}  # fmt: skip


MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    ("not json", {"content": b"{inputs: nope"}, "not valid JSON"),
    ("not utf-8", {"content": b'{"inputs": "\xff"}'}, "not valid JSON"),
    ("deeply nested", {"content": b"[" * 100_000}, "not valid JSON"),
    ("a list", {"json": [1, 2]}, "must be a JSON object"),
    ("no inputs", {"json": {"outputs": []}}, "no 'inputs' list"),
    ("two inputs", {"json": {"inputs": json_body(["a"])["inputs"] * 2}}, "takes one input"),
    ("input not an object", {"json": {"inputs": ["hello"]}}, "must be a JSON object"),
    ("wrong name", {"json": {"inputs": [{**json_body(["a"])["inputs"][0], "name": "text"}]}},
     "Unknown input 'text'"),
    ("wrong datatype", {"json": {"inputs": [{**json_body(["a"])["inputs"][0], "datatype": "FP32"}]}},
     "must have datatype BYTES, not 'FP32'"),
    ("shape mismatch", {"json": json_body(["a"], shape=[2])},
     "Shape [2] holds 2 elements but the data holds 1"),
    ("too much data", {"json": json_body(["a", "b", "c"], shape=[2])}, "data holds more"),
    ("nested data", {"json": json_body([["a"], ["b", "c"]], shape=[2, 1])}, "data holds more"),
    ("no shape", {"json": {"inputs": [{"name": "input", "datatype": "BYTES", "data": ["a"]}]}},
     "needs a shape"),
    ("negative shape", {"json": json_body(["a"], shape=[-1])}, "needs a shape"),
    ("empty shape", {"json": json_body([], shape=[0])}, "has no elements"),
    ("too many elements", {"json": json_body(["a"] * 65)}, "At most 64 elements"),
    ("number data", {"json": json_body([42])}, "must be strings; element 0 is int"),
    ("no data", {"json": {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES"}]}}, "has no data"),
    ("bad base64", {"json": json_body(["not base64!"], parameters={"content_type": "base64"})},
     "Element 0 is not valid base64"),
    ("bad content_type", {"json": json_body(["a"], parameters={"content_type": "np"})}, "content_type 'np'"),
    ("bad parameters", {"json": json_body(["a"], parameters=[1])}, "must be a JSON object"),
    ("unknown output", {"json": {**json_body(["a"]), "outputs": [{"name": "probs"}]}},
     "Unknown output 'probs'"),
    ("classification", {"json": {**json_body(["a"]),
                                 "outputs": [{"name": "label", "parameters": {"classification": 3}}]}},
     "classification extension is not supported"),
    ("binary_data_output not bool",
     {"json": {**json_body(["a"]), "parameters": {"binary_data_output": "yes"}}},
     "binary_data_output must be true or false"),
    ("id not a string", {"json": {**json_body(["a"]), "id": 7}}, "'id' must be a string"),
    ("binary bytes missing", {"json": _binary_input(9)}, "declares binary_data_size 9, but only 0 bytes"),
    ("binary bytes short", _binary_request(_binary_input(9), _bytes_element(b"hi")),
     "declares binary_data_size 9, but only 6 bytes"),
    ("binary and data", _binary_request({"inputs": [{**_binary_input(6)["inputs"][0], "data": ["a"]}]},
                                        _bytes_element(b"hi")), "both data and binary_data_size"),
    ("binary length prefix past the end", _binary_request(_binary_input(6), b"\xff\x00\x00\x00hi"),
     "element 0 declares 255 bytes but 2 remain"),
    ("binary stray bytes", _binary_request(_binary_input(8), _bytes_element(b"hi") + b"xx"),
     "2 stray bytes at the end"),
    ("binary count mismatch", _binary_request(_binary_input(12, 3), _bytes_element(b"hi") * 2),
     "The shape holds 3 elements but the binary data holds 2"),
    ("trailing bytes", _binary_request(_binary_input(6), _bytes_element(b"hi") + b"extra"),
     "5 unexpected bytes follow"),
    ("bytes after plain JSON", _binary_request(json_body(["a"]), b"extra"), "no input has binary_data_size"),
    ("header length not a number", {"content": json.dumps(json_body(["a"])).encode(),
                                    "headers": {"Inference-Header-Content-Length": "ten"}},
     "Inference-Header-Content-Length must be"),
    ("header length past the body", {"content": json.dumps(json_body(["a"])).encode(),
                                     "headers": {"Inference-Header-Content-Length": "99999"}},
     "Inference-Header-Content-Length must be"),
    ("text not utf-8", _binary_request(_binary_input(6), _bytes_element(b"\xff\xfe")),
     "The message is not valid UTF-8 text."),
    ("header length a Latin-1 digit", {"content": json.dumps(json_body(["a"])).encode(),
                                       "headers": {"Inference-Header-Content-Length": b"\xb2"}},  # '²'
     "Inference-Header-Content-Length must be"),
    ("id a lone surrogate", {"content": b'{"id": "\\ud800", ' + json.dumps(json_body(["a"])).encode()[1:]},
     "'id' is not valid Unicode text"),
    ("output twice", {"json": {**json_body(["a"]), "outputs": [{"name": "label"}, {"name": "label"}]}},
     "Output 'label' is requested twice"),
    ("gzip that is not gzip", {"content": b"plain", "headers": {"Content-Encoding": "gzip"}},
     "not valid gzip"),
    ("truncated gzip", {"content": gzip.compress(json.dumps(json_body(["a"])).encode())[:20],
                        "headers": {"Content-Encoding": "gzip"}}, "not one complete gzip stream"),
    # Issue 23: bounded before any work proportional to them (each a 500, or seconds of CPU, before).
    ("60,000 dimensions", {"json": json_body(["a"], shape=[2**62 + 1] * 60_000)},
     "has a shape of 60,000 dimensions; at most 8"),
    ("nine dimensions", {"json": json_body(["a"], shape=[1] * 9)}, "at most 8"),
    ("dimensions of 2,201 digits", {"json": json_body(["a"], shape=[10**2200] * 2)},
     "an integer of 2,201 digits; at most 20"),
    ("a dimension past the cap", {"json": json_body(["a"], shape=[2**63, 2**63])}, "At most 64 elements"),
    ("a product past the cap", {"json": json_body(["a"], shape=[8, 8, 2])}, "At most 64 elements"),
    ("a zero beside a huge dimension", {"json": json_body([], shape=[0, 2**64 - 1])}, "has no elements"),
    # orjson reads an integer past 64 bits as a float (1e30) and refuses one past a double.
    ("a huge integer anywhere", {"json": {**json_body(["a"]), "parameters": {"priority": 10**400}}},
     "an integer of 401 digits"),
    ("binary_data_size past 64 bits", _binary_request(_binary_input(10**25), _bytes_element(b"hi")),
     "binary_data_size of input 'input' must be a non-negative integer"),
    ("binary_data_size of 64 bits", _binary_request(_binary_input(2**64 - 1), _bytes_element(b"hi")),
     "declares binary_data_size 18446744073709551615, but only 6 bytes"),
    ("header length of 5,000 digits", {"content": json.dumps(json_body(["a"])).encode(),
                                       "headers": {"Inference-Header-Content-Length": "9" * 5000}},
     "Inference-Header-Content-Length must be a byte count"),
    ("a million empty binary elements", _binary_request(_binary_input(4_000_000), b"\0" * 4_000_000),
     "The shape holds 1 elements but the binary data holds more"),
    ("too many JSON values", {"content": b'{"inputs": [' + b"[]," * 200_000 + b"[]]}"},
     "holds too many values (over 131,072)"),
    ("a name nested 1,000 deep", _nested({"inputs": [{"name": "NESTED"}]}), "Unknown input a list"),
    ("a datatype nested 1,000 deep", _nested({"inputs": [{"name": "input", "datatype": "NESTED"}]}),
     "must have datatype BYTES, not a list"),
    ("binary_data_output nested 1,000 deep",
     _nested({**json_body(["a"]), "parameters": {"binary_data_output": "NESTED"}}),
     "binary_data_output must be true or false, not a list"),
    ("an output name nested 1,000 deep", _nested({**json_body(["a"]), "outputs": [{"name": "NESTED"}]}),
     "Unknown output a list"),
    ("content_type nested 1,000 deep", _nested(json_body(["a"], parameters={"content_type": "NESTED"})),
     "content_type a list is not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "request_args", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_are_400_with_a_clear_message(
    real_served: Served,
    caplog: pytest.LogCaptureFixture,
    case: str,
    request_args: dict[str, Any],
    message: str,
) -> None:
    with caplog.at_level("WARNING", logger="api.oip"):
        response = real_served.post("/v2/models/text/infer", **request_args)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error and "Traceback" not in error
    assert any(r.levelname == "WARNING" and "refused POST /v2/models/text/infer: 400" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_a_refusal_quotes_what_was_sent_in_bounded_length(
    real_served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    huge = "x" * 2_000_000  # an output name of 2 MB: neither echoed back whole nor logged whole
    body = {**json_body(["a"]), "outputs": [{"name": huge}]}
    with caplog.at_level("WARNING", logger="api.oip"):
        response = real_served.post("/v2/models/text/infer", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error.startswith("Unknown output 'xxx") and len(error) <= 500
    logged = [r.getMessage() for r in caplog.records if "refused POST /v2/models/text" in r.getMessage()]
    assert logged and all(len(line) < 1_000 for line in logged)


@pytest.mark.parametrize("path", ["/v2/models/text/infer", "/v2/models/text/versions/x/infer"])
def test_other_methods_on_an_infer_route_are_405(real_served: Served, path: str) -> None:
    # Not the 404 of the catch-all Gradio mount behind the API routes.
    for method in ("GET", "PUT", "DELETE"):
        response = httpx.request(method, real_served.url + path, timeout=30)
        assert response.status_code == 405 and response.headers["allow"] == "POST", (method, response.text)
        assert "not allowed" in response.json()["error"]
    assert real_served.post("/v2/models/text/infer", json=json_body(["hello"])).status_code == 200


def test_a_file_reference_without_the_filedata_marker_is_refused(real: Served, tmp_path) -> None:
    """Gradio checks only references marked `meta: {"_type": "gradio.FileData"}` against its
    upload folder; an unmarked one must not make the server open the path it names."""
    secret = tmp_path / "never-uploaded.txt"
    secret.write_text("not for the caller")
    before = real.runtime.engine.counters()
    for path in (str(secret), str(tmp_path / "missing.png"), "/etc/hostname"):
        response = real.post("/gradio_api/call/classify_image", json={"data": [{"path": path}]})
        assert response.status_code == 400, (path, response.text)
        assert "must be uploaded first" in response.json()["detail"]
    after = real.runtime.engine.counters()
    assert (after.model_calls, after.invalid) == (before.model_calls, before.invalid)  # no file was read


def test_image_bytes_must_be_base64_or_binary(real: Served) -> None:
    response = real.post("/v2/models/image/infer", json=json_body(["iVBORw0KGgo="]))
    assert response.status_code == 400 and '"content_type": "base64"' in response.json()["error"]


def test_encodings_of_the_body(serve_standin) -> None:
    served = serve_standin()
    bomb = gzip.compress(b" " * 10_000_000)  # 10 MB of JSON whitespace, ~10 KB on the wire
    assert len(bomb) < _body_limit()
    response = served.post("/v2/models/text/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 413
    deflated = zlib.compress(json.dumps(json_body(["hello"])).encode())
    response = served.post("/v2/models/text/infer", content=deflated, headers={"Content-Encoding": "deflate"})
    assert response.status_code == 200 and response.json()["parameters"]["tier"] == "miss"
    response = served.post("/v2/models/text/infer", content=b"{}", headers={"Content-Encoding": "br"})
    assert response.status_code == 415 and "br" in response.json()["error"]


# ---- the serving path -------------------------------------------------------------


def test_request_log_and_metrics_carry_route_rest(serve_standin) -> None:
    served = serve_standin()
    served.client.infer("text", [text_input(["hello", "hello there"], binary=True)])
    served.client.infer("text", [text_input(["hello"], binary=False)])
    refusal(lambda: served.client.infer("text", [text_input([""], binary=True)]))
    metrics = httpx.get(served.url + "/metrics").text
    rest_lines = [line for line in metrics.splitlines()
                  if line.startswith("infcache_requests_total{") and 'route="rest"' in line]  # fmt: skip
    assert any('tier="miss"' in line and line.endswith(" 2.0") for line in rest_lines), rest_lines
    assert any('tier="l1"' in line and line.endswith(" 1.0") for line in rest_lines), rest_lines
    assert any('status="invalid"' in line for line in rest_lines), rest_lines

    served.runtime.log_writer.flush()
    db = make_engine(served.runtime.settings.effective_database_url)
    try:
        with db.connect() as conn:
            rows = conn.execute(select(RequestRow.route, RequestRow.tier, RequestRow.status)
                                .order_by(RequestRow.id)).all()  # fmt: skip
    finally:
        db.dispose()
    assert sorted(rows, key=str) == sorted(
        [("rest", "miss", "ok"), ("rest", "miss", "ok"), ("rest", "l1", "ok"), ("rest", None, "invalid")],
        key=str,
    )


def test_a_slow_miss_blocks_neither_the_server_nor_hits(serve_standin) -> None:
    served = serve_standin(models={"text": CountingTextModel(delay_s=1.5)})
    body = json_body(["cached question"])
    assert served.post("/v2/models/text/infer", json=body).status_code == 200  # now cached
    slow = threading.Thread(target=served.post, args=("/v2/models/text/infer",),
                            kwargs={"json": json_body(["slow miss"])})  # fmt: skip
    slow.start()
    time.sleep(0.3)  # the miss is in the model now
    started = time.monotonic()
    live = httpx.get(served.url + "/v2/health/live")
    hit = served.post("/v2/models/text/infer", json=body)
    elapsed = time.monotonic() - started
    assert slow.is_alive(), "the miss finished early: nothing was in flight"
    slow.join(timeout=30)
    assert live.status_code == 200 and hit.json()["parameters"]["tier"] == "l1"
    assert elapsed < 1.0, f"health and a hit took {elapsed:.2f}s behind a 1.5 s miss"


@pytest.mark.parametrize(
    ("method", "path", "params"),
    [
        ("POST", "/v2/models/text/infer", {"model": "text"}),
        ("POST", "/v2/models/image/versions/abc123/infer", {"model": "image", "version": "abc123"}),
        ("GET", "/v2/models/text/infer", None),  # FastAPI's 405
        ("POST", "/v2/models//infer", None),
        ("POST", "/v2/models/a/b/infer", None),
        ("POST", "/v2/models/text/versions//infer", None),
        ("POST", "/v2/models/text/ready", None),
        ("POST", "/v2/models/text/inference", None),
        ("POST", "/gradio_api/call/classify_text", None),
    ],
)
def test_direct_infer_takes_exactly_the_infer_routes(make_runtime, method, path, params) -> None:
    direct = DirectInfer(make_runtime().engine, max_body_bytes=1000)
    assert direct.path_params({"type": "http", "method": method, "path": path}) == params


def test_the_fastapi_routes_answer_as_the_direct_path(make_runtime) -> None:
    """Another server (no ServingApp in front) reaches the same handler through FastAPI."""
    runtime = make_runtime(limits__max_upload_bytes=SMALL_UPLOAD)
    direct_server, direct = _serve(runtime)
    with BackgroundServer(build_app(runtime), port=free_port()) as routed_server:
        first = direct.post("/v2/models/text/infer", json=json_body(["routed twice"])).json()
        routed = httpx.post(routed_server.url + "/v2/models/text/infer", json=json_body(["routed twice"]))
        assert routed.status_code == 200
        body = routed.json()
        assert first["parameters"]["tier"] == "miss" and body["parameters"]["tier"] == "l1"
        assert body["outputs"] == first["outputs"] and body["model_version"] == first["model_version"]
        for path, status in (("/v2/models/nope/infer", 404), ("/v2/models/text/infer", 400)):
            body = json_body(["" if status == 400 else "x"])
            answers = [httpx.post(url + path, json=body) for url in (direct.url, routed_server.url)]
            assert [a.status_code for a in answers] == [status, status]
            assert answers[0].json() == answers[1].json()
    direct.client.close()
    direct_server.close()


def test_an_unexpected_failure_is_a_500_without_a_trace(make_runtime, caplog) -> None:
    engine = make_runtime().engine

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("secret internal detail")

    engine.classify_from_memory = broken  # type: ignore[method-assign]
    direct = DirectInfer(engine, max_body_bytes=1000)

    async def post() -> httpx.Response:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            scope["path_params"] = direct.path_params(scope)
            await direct(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v2/models/text/infer", json=json_body(["boom"]))

    response = anyio.run(post)
    assert response.status_code == 500 and response.json() == {"error": "Internal server error."}
    assert "secret internal detail" in caplog.text and "Traceback" in caplog.text  # logged, not sent


def test_which_bodies_are_taken_on_the_event_loop() -> None:
    """Small bodies, JSON bodies up to INLINE_BINARY_BYTES holding few values (a photo's base64
    string), and binary-extension bodies up to that size whose JSON header is small and asks for
    no base64, are parsed and looked up on the event loop; the rest in a thread."""
    from api.oip import INLINE_BINARY_BYTES, INLINE_JSON_VALUES, INLINE_PARSE_BYTES, _inline

    header = (b'{"inputs":[{"name":"input","shape":[1],"datatype":"BYTES",'
              b'"parameters":{"binary_data_size":9}}]}')  # fmt: skip
    photo = header + bytes(300_000)
    assert _inline(b"x" * INLINE_PARSE_BYTES, None)
    one_photo = json.dumps(json_body([base64.b64encode(bytes(240_000)).decode()],
                                     parameters={"content_type": "base64"})).encode()  # fmt: skip
    assert len(one_photo) > INLINE_PARSE_BYTES and _inline(one_photo, None)
    many_values = b"[" + b",".join([b"0"] * (INLINE_JSON_VALUES + 1)) + b"]" + b" " * INLINE_PARSE_BYTES
    assert not _inline(many_values, None)  # orjson's cost grows with the values, not the bytes
    assert not _inline(b" " * (INLINE_BINARY_BYTES + 1), None)
    assert _inline(photo, str(len(header)))
    assert not _inline(header + bytes(INLINE_BINARY_BYTES), str(len(header)))
    b64 = header.replace(b'"binary_data_size"', b'"content_type":"base64","binary_data_size"')
    assert not _inline(b64 + bytes(300_000), str(len(b64)))
    for bad in ("", "12x", "²", "9" * 30, str(INLINE_PARSE_BYTES + 1)):
        assert not _inline(photo, bad)


def test_kept_outputs_follow_a_recomputed_answer_under_the_same_key() -> None:
    """The REST door keeps a one-element answer's encoded outputs by key (api.repeats); an entry
    evicted (shadow verification) and computed again with another answer must be encoded anew."""
    from api.oip import _encoded_outputs, _outputs
    from api.repeats import Repeats
    from api.tensors import RequestedOutput, encode_outputs, parse_infer_request
    from engine.models.base import Prediction
    from engine.pipeline.results import ClassifyResult

    outputs = [{"name": "label"}, {"name": "score", "parameters": {"binary_data": True}}]
    body = json.dumps({"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}],
                       "outputs": outputs})  # fmt: skip
    parsed = parse_infer_request(body.encode(), None, input_name="input", max_elements=4)
    assert parsed.outputs == (RequestedOutput("label", None), RequestedOutput("score", True))

    def result(labels: tuple[tuple[str, float], ...], latency_ms: float) -> ClassifyResult:
        return ClassifyResult(Prediction(labels), "l1", "infcache:text:v1:0:kept-outputs", "m", "v1", 0,
                              latency_ms, "cpu", 1.0)  # fmt: skip

    repeats = Repeats()
    first = result((("a", 0.75), ("b", 0.25)), 0.1)
    once = _encoded_outputs(repeats, parsed, [first])
    assert _encoded_outputs(repeats, parsed, [result(first.prediction.labels, 0.2)]) is once  # kept
    assert _encoded_outputs(Repeats(), parsed, [first]) is not once  # another server's memory
    other = result((("b", 0.5), ("a", 0.5)), 0.3)
    fresh = _encoded_outputs(repeats, parsed, [other])
    assert fresh is not once and b'"b","a"' in fresh.described_json
    assert fresh == encode_outputs(_outputs(parsed, [other]))


def _comparable(lines: list[bytes], body: bytes) -> tuple[list[bytes], Any]:
    """What must not differ between two answers of one hit: all but the date, the lengths, and
    the latency and age (which cache_info reports per answer; the lengths follow from them)."""
    varying = (b"date:", b"content-length:", b"inference-header-content-length:")
    kept = [line.split(b":")[0] if line.lower().startswith(varying) else line for line in lines]
    lengths = [int(line.split(b":")[1]) for line in lines
               if line.lower().startswith(b"inference-header-content-length:")]  # fmt: skip
    header_length = lengths[0] if lengths else len(body)
    header = json.loads(body[:header_length])
    for info in [header["parameters"], *json.loads(header["parameters"].pop("cache_info"))]:
        info.pop("latency_ms"), info.pop("age_s")
    return kept, (header, body[header_length:])


def test_a_cached_hit_is_answered_at_once_as_its_task_would(serve_standin, monkeypatch) -> None:
    """ui.limits asks api.oip's answer_now for a small complete request before it makes a task:
    a hit is answered there, a miss goes on to the task; both answers are the same bytes but
    for the date and the per-answer latency and age."""
    import api.oip
    from ui.limits import LimitedHttpToolsProtocol

    served = serve_standin()
    host, port = served.url.removeprefix("http://").split(":")
    answered_now: list[bool] = []
    real_answer_now = api.oip._answer_now

    def spy(*args: Any) -> Any:
        answer = real_answer_now(*args)
        answered_now.append(answer is not None)
        return answer

    monkeypatch.setattr(api.oip, "_answer_now", spy)
    as_json = {"id": "r1", **json_body(["hello at once"]), "outputs": [{"name": "label"}, {"name": "score"}]}
    binary_header = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES",
                                 "parameters": {"binary_data_size": 17}}],
                     "parameters": {"binary_data_output": True}}  # fmt: skip
    bodies = {
        "json": (json.dumps(as_json).encode(), b""),
        "binary": (json.dumps(binary_header).encode(), b"\x0d\x00\x00\x00hello, binary"),
    }

    def request(kind: str) -> bytes:
        header, data = bodies[kind]
        extra = b"Inference-Header-Content-Length: %d\r\n" % len(header) if data else b""
        head = b"POST /v2/models/text/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        return head + b"Content-Length: %d\r\n%b\r\n%b%b" % (len(header) + len(data), extra, header, data)

    for kind in bodies:
        answered_now.clear()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            miss = exchange(sock, request(kind))
            hit = exchange(sock, request(kind))
        assert answered_now == [False, True], (miss, hit)  # the miss through the task, the hit at once
        assert b'"tier":"miss"' in miss[1] and b'"tier":"l1"' in hit[1]
        monkeypatch.setattr(LimitedHttpToolsProtocol, "answer_at_once", False)  # each new connection
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            through_task = exchange(sock, request(kind))
        monkeypatch.setattr(LimitedHttpToolsProtocol, "answer_at_once", True)
        assert answered_now == [False, True]  # not asked
        assert hit[0][0] == b"HTTP/1.1 200 OK"
        assert _comparable(*hit) == _comparable(*through_task)
    # Both hits are in the request log and the metrics, as any hit.
    metrics = httpx.get(served.url + "/metrics").text
    assert any(line.startswith("infcache_requests_total{") and 'route="rest"' in line and 'tier="l1"' in line
               and line.endswith(" 4.0") for line in metrics.splitlines()), metrics  # fmt: skip


@pytest.mark.parametrize(
    "element",
    ["", "YWJj", "YQ==", "YWI=", "YQ=", "YQ", "YQ===", "=YWJj", "YQ==YQ==", "ab=c", "YWJj\n", "YW Jj",
     "YWJj-_", "YR==", "Y\u00e9Jj", b"YWJj", b"YQ=", b"\xffYWJj", "iaA8=", "5xqEAOEwK/BI=",
     base64.b64encode(bytes(range(256)) * 40).decode(),
     base64.b64encode(bytes(range(256)) * 40).decode() + "=",
     "A" * 4000 + "\t" + "A" * 4000],
)  # fmt: skip
def test_base64_elements_are_read_as_the_standard_library_reads_them(element: str | bytes) -> None:
    # api.tensors decodes with pybase64 (much cheaper on an image); it must accept and refuse
    # exactly what base64.b64decode(validate=True) does, and decode the same bytes.
    from api.errors import RequestRefused
    from api.tensors import _b64

    try:
        expected: bytes | None = base64.b64decode(element, validate=True)
    except ValueError:  # binascii.Error is one
        expected = None
    try:
        got: bytes | None = _b64(element, 0)
    except RequestRefused:
        got = None
    assert got == expected
