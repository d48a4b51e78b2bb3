"""The remote backend's parts that need no server: MODELS_CONFIG's `backend: remote` entries, the
model config as the server's HTTP and gRPC JSON give it, the checks that refuse garbage answers,
and how a remote that is unavailable reaches a user (503 + Retry-After, a Gradio error)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
import pytest

from engine.errors import ModelError, RemoteUnavailableError
from engine.models.config import ModelConfigError, load_config
from engine.models.remote import _checked, _Garbage
from engine.models.remote_client import RemoteClient, ServedConfig, TensorSpec
from settings import Settings
from storage.redis.embedded import free_port
from testing.tiny_models import write_config
from ui.app_ui import user_errors

TEXT = {"task": "text", "kind": "text-classification", "source": "builtin:minilm-intents"}


def _load(tmp_path: Path, **fields: Any) -> Any:
    return load_config(write_config(tmp_path / "models.yaml", [{**TEXT, **fields}]))[0]


def test_a_remote_entry_keeps_its_source_and_defaults_the_model_name(tmp_path: Path) -> None:
    spec = _load(tmp_path, backend="remote", remote_url="grpc://triton:8001")
    assert (spec.remote, spec.remote_url, spec.remote_model, spec.source) == (
        True, "grpc://triton:8001", "text", "builtin:minilm-intents")  # fmt: skip
    spec = _load(tmp_path, backend="remote", remote_url="http://10.0.0.5:8000/", remote_model="intents-v2")
    assert (spec.remote_url, spec.remote_model) == ("http://10.0.0.5:8000", "intents-v2")
    assert not _load(tmp_path, backend="onnxruntime").remote


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "remote"}, "backend remote needs 'remote_url'"),
        ({"backend": "remote", "remote_url": "https://triton:8000"}, "must start with http:// or grpc://"),
        ({"backend": "remote", "remote_url": "grpc://triton"}, "needs a host and a port"),
        ({"backend": "remote", "remote_url": "http://triton:80/v2/models"}, "no path, query or user"),
        ({"backend": "remote", "remote_url": "http://triton:99999"}, "is not a URL"),
        ({"backend": "remote", "remote_url": "http://t:1", "remote_model": "a b"}, "the server's model name"),
        ({"remote_url": "http://triton:8000"}, "remote_url only go with 'backend: remote'"),
        ({"backend": "torch", "remote_model": "text"}, "remote_model only go with 'backend: remote'"),
    ],
)
def test_a_bad_remote_entry_is_refused_naming_it(tmp_path: Path, fields: dict[str, Any],
                                                 message: str) -> None:  # fmt: skip
    with pytest.raises(ModelConfigError) as refused:
        _load(tmp_path, **fields)
    assert "MODELS_CONFIG entry 1 (task 'text')" in str(refused.value)
    assert message in str(refused.value)


def test_remote_settings_serve_without_tuning() -> None:
    remote = Settings.from_env({}).remote
    assert 0 < remote.connect_timeout_s <= remote.timeout_s <= 10
    assert remote.breaker_reset_s < remote.breaker_max_s
    tuned = Settings.from_env({"REMOTE_TIMEOUT_S": "0.5", "REMOTE_BREAKER_MAX_S": "4"}).remote
    assert (tuned.timeout_s, tuned.breaker_max_s) == (0.5, 4.0)


HTTP_CONFIG = {
    "name": "text", "max_batch_size": 32,
    "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]}],
    "output": [{"name": "output", "data_type": "TYPE_FP32", "dims": [-1, 384]}],
    "parameters": {"cache_model_version": {"string_value": "abc"},
                   "cache_export_state": {"string_value": '{"centroids": "{}"}'}},
}  # fmt: skip


def test_the_served_config_reads_http_and_grpc_json() -> None:
    http = ServedConfig.parse(HTTP_CONFIG)
    # gRPC's JSON writes int64 values as strings
    inputs = [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": ["-1"]}]
    outputs = [{"name": "output", "data_type": "TYPE_FP32", "dims": ["-1", "384"]}]
    grpc = ServedConfig.parse({**HTTP_CONFIG, "input": inputs, "output": outputs})
    assert http == grpc
    assert (http.version, http.max_batch, http.output.dims, http.probe) == ("abc", 32, (-1, 384), None)
    assert http.export_state == {"centroids": "{}"}
    with pytest.raises(ValueError, match="outputs"):
        ServedConfig.parse({**HTTP_CONFIG, "output": []})


TOKENS = {"input_ids": np.zeros((2, 7), dtype=np.int64)}
HIDDEN = TensorSpec("output", "TYPE_FP32", (-1, 384))


@pytest.mark.parametrize(
    "answer",
    [
        np.zeros((1, 7, 384), dtype=np.float32),  # a row short
        np.zeros((2, 6, 384), dtype=np.float32),  # tokens that are not the input's
        np.zeros((2, 7, 383), dtype=np.float32),  # the config's width
        np.zeros((2, 7), dtype=np.float32),  # rank
        np.zeros((2, 7, 384), dtype=np.int64),  # not floats
        np.full((2, 7, 384), np.nan, dtype=np.float32),
        np.concatenate([np.zeros((2, 7, 383)), np.full((2, 7, 1), np.inf)], axis=2).astype(np.float32),
    ],
)
def test_garbage_answers_are_refused(answer: np.ndarray) -> None:
    with pytest.raises(_Garbage):
        _checked(answer, TOKENS, HIDDEN)


def test_a_good_answer_passes_writable() -> None:
    answer = np.ones((2, 7, 384), dtype=np.float32)
    answer.flags.writeable = False
    checked = _checked(answer, TOKENS, HIDDEN)
    assert checked.flags.writeable and np.array_equal(checked, answer)


def test_a_server_that_is_not_there_fails_fast_and_bounded() -> None:
    for scheme in ("http", "grpc"):
        url = f"{scheme}://127.0.0.1:{free_port()}"
        client = RemoteClient(url, "text", connect_timeout_s=0.5, timeout_s=0.5)
        try:
            started = time.monotonic()
            with pytest.raises(Exception) as failed:
                client.config()
            assert type(failed.value).__name__ == "RemoteCallError"
            assert time.monotonic() - started < client.deadline_s + 1.0
        finally:
            client.close()
        with pytest.raises(Exception, match="closed"):
            client.config()


def test_an_unavailable_remote_is_a_clear_gradio_error_and_a_model_error() -> None:
    refusal = RemoteUnavailableError("text", "not answering", 1.2)
    assert isinstance(refusal, ModelError) and refusal.wait_s == 2
    assert "answers already cached still work" in refusal.message
    with pytest.raises(gr.Error) as shown, user_errors(False):
        raise refusal
    assert shown.value.message == refusal.message and shown.value.title == "Model server unavailable"
