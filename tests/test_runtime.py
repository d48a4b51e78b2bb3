"""Settings from the environment and the composition root's L2 choices."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError

from runtime import build_runtime
from settings import Settings, SettingsError
from storage.redis.embedded import answers_ping
from tests.conftest import CountingTextModel


class TestSettings:
    def test_defaults(self) -> None:
        settings = Settings.from_env({})
        assert settings.server.port == 7860 and settings.models.device == "auto"
        assert settings.redis.url is None and settings.server.data_dir == Path("data")
        assert settings.effective_database_url == "sqlite:///data/requests.sqlite3"
        assert settings.cache.l1_max_bytes == 256 * 1024 * 1024

    def test_reads_each_variable(self) -> None:
        settings = Settings.from_env(
            {"PORT": "8000", "DEVICE": "CPU", "REDIS_URL": "OFF", "DATA_DIR": "/tmp/x",
             "CACHE_L1_MAX_BYTES": "1024", "CACHE_TTL_S": "5", "ADMIN_TOKEN": " secret-token "}
        )  # fmt: skip
        assert (settings.server.port, settings.models.device, settings.redis.url) == (8000, "cpu", "off")
        assert settings.redis.l2_disabled and settings.server.data_dir == Path("/tmp/x")
        assert (settings.cache.l1_max_bytes, settings.cache.ttl_s) == (1024, 5)
        assert settings.server.admin_token == "secret-token"

    def test_replica_id_defaults_to_host_and_process(self) -> None:
        default = Settings.from_env({}).server.replica_id
        assert default.endswith(f"-{os.getpid()}") and len(default) <= 64
        assert Settings.from_env({"REPLICA_ID": " app-2 "}).server.replica_id == "app-2"

    @pytest.mark.parametrize(
        ("env", "message"),
        [
            ({"PORT": "http"}, "PORT"),
            ({"DEVICE": "tpu"}, "DEVICE"),
            ({"REDIS_URL": "localhost:6379"}, "REDIS_URL"),
            ({"CACHE_TTL_S": "0"}, "CACHE_TTL_S"),
            ({"MAX_IMAGE_PIXELS": "999999999"}, "MAX_IMAGE_PIXELS"),
            ({"REPLICA_ID": "two words"}, "REPLICA_ID"),
            ({"REPLICA_ID": "x" * 65}, "REPLICA_ID"),
        ],
    )
    def test_refuses_unusable_values_with_the_variable_name(self, env, message) -> None:
        with pytest.raises(SettingsError, match=message):
            Settings.from_env(env)

    @pytest.mark.parametrize(
        ("env", "message"),
        [
            ({"CACHE_TTL_S": "abc"}, "CACHE_TTL_S='abc' is not an integer (>= 1)"),
            ({"CACHE_L1_TTL_S": "soon"}, "CACHE_L1_TTL_S='soon' is not a number (>= 0.001)"),
            ({"PORT": "0"}, "PORT=0 must be >= 1"),
            ({"DEVICE": "TPU"}, "DEVICE='tpu' must be one of auto, cpu, cuda"),
            ({"HALF_PRECISION": "yes"}, "HALF_PRECISION='yes' must be one of 0, 1, false, true"),
            ({"SIZING_CPU_SHARE": "2"}, "SIZING_CPU_SHARE=2.0 must be between 0 and 1"),
            ({"GENERATION_REFRESH_S": "3", "GENERATION_CONFIRM_S": "4"},
             "GENERATION_CONFIRM_S=4.0 must be at least 2 x GENERATION_REFRESH_S (3.0)"),
        ],
    )  # fmt: skip
    def test_a_refusal_is_one_line_naming_the_value_and_what_is_accepted(self, env, message) -> None:
        with pytest.raises(SettingsError) as refused:
            Settings.from_env(env)
        assert str(refused.value) == message

    def test_every_refused_value_is_named_at_once(self) -> None:
        with pytest.raises(SettingsError) as refused:
            Settings.from_env({"PORT": "http", "REDIS_URL": "localhost:6379", "LOG_MAX_ROWS": "5"})
        message = str(refused.value)
        assert "\n" not in message and "validation error" not in message  # no pydantic dump
        assert "PORT='http'" in message and "REDIS_URL=" in message
        assert "LOG_MAX_ROWS=5 must be >= 100" in message

    def test_derived_defaults(self) -> None:
        settings = Settings.from_env({"GENERATION_REFRESH_S": "3"})
        assert settings.fleet.generation_confirm_s == 6.0  # max(2, 2 x GENERATION_REFRESH_S)
        assert 1 <= settings.models.miss_concurrency_cpu <= 4
        assert settings.models.miss_concurrency_for("cuda:0") == 4
        blank = Settings.from_env({"HOST": "  ", "CACHE_PREFIX": ""})  # blank: the default
        assert (blank.server.host, blank.cache.prefix) == ("0.0.0.0", "infcache")
        assert Settings.from_env({"ONNX_EXPORT_DIR": "/e"}).export_dir == Path("/e")

    def test_a_changed_copy_is_validated_and_leaves_the_original_alone(self, tmp_path) -> None:
        settings = Settings.from_env({})
        copy = settings.changed(redis__url="off", server__data_dir=tmp_path, cache__ttl_s=5)
        assert (copy.redis.url, copy.server.data_dir, copy.cache.ttl_s) == ("off", tmp_path, 5)
        assert copy.redis.l2_disabled and copy.sqlite_path == tmp_path / "requests.sqlite3"
        assert settings.redis.url is None and settings.cache.ttl_s == 86400 and copy.models is settings.models
        with pytest.raises(SettingsError, match="CACHE_TTL_S=0 must be >= 1"):
            settings.changed(cache__ttl_s=0)
        with pytest.raises(TypeError):
            settings.changed(redis_url="off")  # not group__field
        with pytest.raises(TypeError):
            settings.changed(redis__host="x")
        with pytest.raises(ValidationError):
            settings.redis.url = "off"  # type: ignore[misc]  # frozen


def test_private_redis_when_redis_url_is_unset(base_settings, redis_binary, tmp_path) -> None:
    settings = base_settings.changed(redis__url=None, server__data_dir=tmp_path / "d")
    runtime = build_runtime(settings, models={"text": CountingTextModel()})
    try:
        assert runtime.l2_url is not None and runtime.l2_url.startswith("unix://")
        socket_path = runtime.l2_url.removeprefix("unix://")
        assert os.stat(socket_path).st_mode & 0o077 == 0  # only this user may connect
        assert runtime.engine.cache_state()["l2"]["state"] == "up"
        runtime.engine.classify("text", "persist me")
        client = redis.Redis(unix_socket_path=socket_path)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        assert int(client.config_get("maxmemory")["maxmemory"]) > 0
        assert client.config_get("port")["port"] == "0"  # no TCP listener
        client.close()
    finally:
        runtime.close()
    assert not Path(socket_path).exists() or not answers_ping(unix_socket_path=socket_path)
    assert (tmp_path / "d" / "redis" / "cache.rdb").is_file()  # snapshot written on shutdown

    again = build_runtime(settings, models={"text": CountingTextModel()})
    try:  # the snapshot brings the L2 entries back after a restart
        assert again.engine.classify("text", "persist me").tier == "l2"
    finally:
        again.close()


def test_l1_only_with_a_notice_when_redis_server_is_missing(base_settings, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("runtime.find_redis_server", lambda: None)
    settings = base_settings.changed(redis__url=None, server__data_dir=tmp_path / "d")
    with build_runtime(settings, models={"text": CountingTextModel()}) as runtime:
        state = runtime.engine.cache_state()["l2"]
        assert state["state"] == "disabled" and "redis-server is not installed" in state["notice"]
        assert runtime.engine.classify("text", "x").tier == "miss"
        assert runtime.engine.classify("text", "x").tier == "l1"
