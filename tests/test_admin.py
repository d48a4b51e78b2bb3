"""Operator console: request log, read models, charts, admin API, auth, metrics, health."""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gradio_client import Client
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from admin.auth import AdminAuth, AuthOutcome, bearer_token, token_fingerprint
from admin.console.charts import all_figures
from admin.console.tab import make_callbacks as make_admin_callbacks
from engine.errors import InvalidInputError
from runtime import Runtime
from storage.log_writer import RequestLogWriter
from storage.redis.embedded import EmbeddedRedis
from storage.sql import RequestRow, make_engine, migrate
from tests.conftest import CountingTextModel, free_port
from ui.server import BackgroundServer, build_app

TOKEN = "operator-token-for-tests"
# For tests that do not read the request log: the SQLite run alone (the `database_url` fixture
# otherwise runs each test on SQLite and on PostgreSQL).
SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def log_rows(runtime: Runtime) -> list[Any]:
    runtime.log_writer.flush()
    with runtime.admin._db.connect() as conn:
        return conn.execute(
            select(RequestRow.task, RequestRow.tier, RequestRow.status, RequestRow.error_code,
                   RequestRow.key_digest, RequestRow.generation).order_by(RequestRow.id)
        ).all()  # fmt: skip


@pytest.fixture
def console(make_runtime, redis_server: EmbeddedRedis, database_url: str) -> Runtime:
    """A runtime whose request log is on SQLite, then on PostgreSQL (`database_url` is parametrized)."""
    return make_runtime(
        models={"text": CountingTextModel()}, redis__url=redis_server.url, server__admin_token=TOKEN,
        log__database_url=database_url,
    )  # fmt: skip


class TestRequestLog:
    def test_each_request_is_logged_with_its_tier(self, console: Runtime) -> None:
        engine = console.engine
        script = ["where is my order", "where is my order", "  WHERE is my order ", "refund", ""]
        for message in script[:-1]:
            engine.classify("text", message)
        with pytest.raises(InvalidInputError):  # the last one, and only it, is refused
            engine.classify("text", script[-1])
        engine.flush("l1")
        engine.classify("text", "refund")
        rows = log_rows(console)
        assert [(r.tier, r.status) for r in rows] == [
            ("miss", "ok"), ("l1", "ok"), ("miss", "ok"), ("miss", "ok"), (None, "invalid"), ("l2", "ok"),
        ]  # fmt: skip
        # "  WHERE is my order " differs only in case and spaces from the first, but the
        # stand-in model's canonical form keeps case: a different key, so a miss.
        assert rows[0].key_digest == rows[1].key_digest != rows[2].key_digest
        assert rows[4].error_code == "empty_text"
        assert all(r.key_digest is None or len(r.key_digest) == 16 for r in rows)

    def test_raw_inputs_are_never_stored(self, console: Runtime) -> None:
        console.engine.classify("text", "my secret order number is 99123")
        console.log_writer.flush()
        with console.admin._db.connect() as conn:
            dump = json.dumps([list(r) for r in conn.execute(select(RequestRow)).all()])
        assert "99123" not in dump and "secret" not in dump

    def test_stats_and_charts_come_from_the_rows(self, console: Runtime) -> None:
        for message in ["a", "a", "a", "b", "b", "c"]:
            console.engine.classify("text", f"question {message}")
        data = console.admin.stats("1h")
        summary = data["summary"]
        assert summary["total"] == 6 and summary["by_tier"]["miss"] == 3 and summary["by_tier"]["l1"] == 3
        assert summary["hit_rate"] == pytest.approx(0.5)
        assert summary["model_seconds_saved"] > 0
        hot = data["hot_keys"]
        assert [k["count"] for k in hot] == [3, 2, 1]
        assert hot[0]["share"] == pytest.approx(0.5) and hot[0]["last_label"] in ("alpha", "beta")

        figures = all_figures(data)
        assert sum(figures["tiers"].data[[t.name for t in figures["tiers"].data].index("L1 memory")].y) == 3
        assert list(figures["hit_rate"].data[0].y) == [50.0]
        assert list(figures["hot_keys"].data[0].x) == [1, 2, 3]  # reversed: biggest on top
        latency_counts = sum(sum(trace.y) for trace in figures["latency"].data)
        assert latency_counts == 6
        assert figures["latency"].layout.xaxis.type == "log"

    def test_window_is_validated(self, console: Runtime) -> None:
        with pytest.raises(InvalidInputError):
            console.admin.stats("forever")


class TestWriter:
    def test_burst_with_database_locked_never_blocks_requests(self, make_runtime, tmp_path: Path) -> None:
        runtime = make_runtime(models={"text": CountingTextModel()}, server__admin_token=TOKEN,
                               log__database_url=f"sqlite:///{tmp_path / 'locked.sqlite3'}")  # fmt: skip
        runtime.engine.classify("text", "hot question")
        runtime.log_writer.flush()
        blocker = sqlite3.connect(tmp_path / "locked.sqlite3", timeout=0.1)
        blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the database
        lock_seconds = 3.0
        try:
            started = time.monotonic()
            for _ in range(5000):
                runtime.engine.classify("text", "hot question")
            burst = time.monotonic() - started
            assert burst < lock_seconds, "requests waited on the locked database"
            time.sleep(max(0.0, lock_seconds - burst))
            assert runtime.log_writer.stats().written == 1  # nothing could be written meanwhile
        finally:
            blocker.rollback()
            blocker.close()
        runtime.log_writer.close()  # clean shutdown: everything queued gets written
        stats = runtime.log_writer.stats()
        with runtime.admin._db.connect() as conn:
            written = conn.execute(select(func.count()).select_from(RequestRow)).scalar_one()
        assert written + stats.dropped == 5001
        assert stats.queued == 0

    def test_full_queue_drops_and_counts(self, tmp_path: Path) -> None:
        db = make_engine(f"sqlite:///{tmp_path / 'q.sqlite3'}")
        migrate(db)
        blocker = sqlite3.connect(tmp_path / "q.sqlite3", timeout=0.1)
        blocker.execute("BEGIN EXCLUSIVE")
        writer = RequestLogWriter(db, max_queue=10, batch_size=5, prune_every_s=3600)
        try:
            accepted = sum(writer.submit(_row(i)) for i in range(200))
            assert accepted < 200
            assert writer.stats().dropped == 200 - accepted
        finally:
            blocker.rollback()
            blocker.close()
            writer.close()
            db.dispose()


def _row(i: int, at: float = 1.0) -> dict[str, Any]:
    return {"at": at, "task": "text", "tier": "l1", "latency_ms": 0.1, "status": "ok", "error_code": None,
            "key_digest": f"{i:016x}", "model_version": "v", "generation": 0, "top_label": "x",
            "model_ms": None}  # fmt: skip


class TestAuth:
    def test_constant_time_check_and_lockout(self) -> None:
        now = [0.0]
        auth = AdminAuth(TOKEN, max_failures=3, window_s=60, lockout_s=30, clock=lambda: now[0])
        assert auth.check("a", TOKEN) is AuthOutcome.OK
        assert auth.check("a", None) is AuthOutcome.UNAUTHORIZED
        assert auth.check("a", TOKEN[:-1]) is AuthOutcome.UNAUTHORIZED
        assert auth.check("a", "x" * 1000) is AuthOutcome.RATE_LIMITED
        assert auth.check("a", TOKEN) is AuthOutcome.RATE_LIMITED  # even the right token, for a while
        assert auth.check("b", TOKEN) is AuthOutcome.OK  # other clients unaffected
        now[0] = 31.0
        assert auth.check("a", TOKEN) is AuthOutcome.OK

    def test_fingerprint_never_contains_the_token(self) -> None:
        assert TOKEN not in token_fingerprint(TOKEN) and token_fingerprint(TOKEN).startswith("token:")

    @pytest.mark.parametrize(
        ("header", "token"),
        [(None, None), ("", None), ("Basic abc", None), ("Bearer ", None), ("bearer  tok ", "tok")],
    )
    def test_bearer_parsing(self, header, token) -> None:
        assert bearer_token(header) == token


class TestTabCallbacks:
    class FakeRequest:
        class client:
            host = "10.0.0.9"

    def test_admin_actions_refuse_without_sign_in(self, console: Runtime) -> None:
        import gradio as gr

        cb = make_admin_callbacks(console.admin, console.auth)
        console.engine.classify("text", "keep me")
        for action, args in [("flush", (None, "all", True)), ("bump", (None, "", True)),
                             ("refresh", (None, "1h"))]:  # fmt: skip
            with pytest.raises(gr.Error, match="Sign in"):
                cb[action](*args)
        assert console.engine.classify("text", "keep me").tier == "l1"
        assert console.admin.audit_rows() == []

    def test_sign_in_then_flush_and_bump_are_audited(self, console: Runtime) -> None:
        cb = make_admin_callbacks(console.admin, console.auth)
        session, *_ = cb["sign_in"]("wrong", self.FakeRequest())
        assert session is None
        session, *_ = cb["sign_in"](TOKEN, self.FakeRequest())
        assert session and TOKEN not in session
        console.engine.classify("text", "cached")
        message = cb["flush"](session, "all", True)
        assert "L1: 2 removed" in message and "L2: 1 removed" in message  # result + alias; result
        assert console.engine.classify("text", "cached").tier == "miss"
        assert "from 0 to 1" in cb["bump"](session, "new intents", True)
        assert console.engine.classify("text", "cached").tier == "miss"
        audit = console.admin.audit_rows()
        assert [r["action"] for r in audit] == ["bump_version", "flush"]
        assert json.loads(audit[0]["params"]) == {"note": "new intents"}
        assert all(TOKEN not in json.dumps(r) for r in audit)
        assert "10.0.0.9" in audit[0]["actor"]
        cards, *_figures, state, table = cb["refresh"](session, "1h")
        assert "Requests" in cards and state["generation"] == 1 and len(table) == 2


@pytest.fixture
def served(console: Runtime) -> Iterator[tuple[str, Runtime]]:
    server = BackgroundServer(build_app(console), port=free_port()).start()
    yield server.url, console
    server.close()


def call(url: str, path: str, *, token: str | None = None, body: dict | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers=headers,
                                     method="POST" if body is not None else "GET")  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as error:
        raw, status = error.read(), error.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


class TestHttp:
    def test_api_refuses_without_the_token_and_changes_nothing(self, served) -> None:
        url, runtime = served
        runtime.engine.classify("text", "stay cached")
        statuses = []
        for token in (None, "wrong-token", TOKEN.upper()):
            statuses.append(call(url, "/admin/api/stats", token=token)[0])
            statuses.append(call(url, "/admin/api/flush", token=token, body={"tier": "all"})[0])
            statuses.append(call(url, "/admin/api/bump-version", token=token, body={})[0])
        # 401 until the client has failed too often, then 429 (rate limited): never 200.
        assert statuses[:4] == [401] * 4 and set(statuses) <= {401, 429}
        assert runtime.engine.classify("text", "stay cached").tier == "l1"
        assert runtime.engine.generation == 0 and runtime.admin.audit_rows() == []

    @SQLITE_ONLY
    def test_brute_force_gets_429(self, served) -> None:
        url, runtime = served
        statuses = [call(url, "/admin/api/stats", token=f"guess-{i}")[0] for i in range(12)]
        assert statuses[0] == 401 and statuses[-1] == 429
        assert call(url, "/admin/api/stats", token=TOKEN)[0] == 429  # locked out for a while
        assert runtime.engine.generation == 0

    def test_flush_bump_and_stats_with_the_token(self, served) -> None:
        url, runtime = served
        runtime.engine.classify("text", "question")
        status, flushed = call(url, "/admin/api/flush", token=TOKEN, body={"tier": "l1"})
        assert status == 200 and flushed["l1_removed"] == 2 and flushed["l2_removed"] is None
        assert call(url, "/admin/api/flush", token=TOKEN, body={"tier": "everything"})[0] == 400
        status, bumped = call(url, "/admin/api/bump-version", token=TOKEN, body={"note": "retrained"})
        assert status == 200 and bumped["generation"] == 1
        assert runtime.engine.classify("text", "question").tier == "miss"
        status, stats = call(url, "/admin/api/stats?window=5m", token=TOKEN)
        assert status == 200 and stats["summary"]["total"] == 2 and stats["cache"]["generation"] == 1
        assert [r["action"] for r in runtime.admin.audit_rows()] == ["bump_version", "flush"]

    @SQLITE_ONLY
    def test_admin_gradio_endpoints_refuse_without_sign_in(self, served) -> None:
        url, runtime = served
        runtime.engine.classify("text", "cached")
        client = Client(url + "/", verbose=False)
        assert not any(
            name.startswith("/admin") for name in client.view_api(print_info=False,
                                                                   return_format="dict")["named_endpoints"]
        )  # fmt: skip
        with pytest.raises(Exception, match="Sign in"):
            client.predict("all", True, api_name="/admin_flush")
        with pytest.raises(Exception, match="Sign in"):
            client.predict("", True, api_name="/admin_bump")
        assert runtime.engine.classify("text", "cached").tier == "l1" and runtime.engine.generation == 0

    @SQLITE_ONLY
    def test_metrics_parse_and_move_with_traffic(self, served) -> None:
        url, runtime = served

        def requests_total() -> float:
            _, body = call(url, "/metrics")
            families = {f.name: f for f in text_string_to_metric_families(body)}
            assert "infcache_l1_bytes" in families and "infcache_generation" in families
            return sum(s.value for s in families["infcache_requests"].samples if s.name.endswith("_total"))

        before = requests_total()
        for _ in range(3):
            runtime.engine.classify("text", "counted")
        assert requests_total() == before + 3
        _, body = call(url, "/metrics")
        assert "counted" not in body  # no input data

    @SQLITE_ONLY
    def test_readyz_reports_l2_down_when_redis_stops(self, served, redis_server: EmbeddedRedis) -> None:
        url, _ = served
        status, body = call(url, "/readyz")
        assert status == 200 and body["l2"] == "up"
        redis_server.kill()
        deadline = time.monotonic() + 5
        while call(url, "/readyz")[1]["l2"] != "down" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert call(url, "/readyz")[1]["l2"] == "down"
        assert call(url, "/healthz") == (200, {"status": "ok"})


GARBAGE_BODIES = [b"\x00", b"not json", b"[]", b'"all"', b"1", b"null", b"{", b'{"tier": "all"} trailing']


@SQLITE_ONLY
def test_admin_posts_refuse_any_body_but_their_documented_object_and_change_nothing(served) -> None:
    url, runtime = served
    runtime.engine.classify("text", "stay cached")
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    wrong_fields = {
        "/admin/api/flush": [{}, {"tier": 1}, {"tier": "all", "force": True}, {"tier": None}],
        "/admin/api/bump-version": [{"note": 5}, {"nte": "typo"}, {"note": ["x"]}],
        "/admin/api/models/text/reload": [{"note": {}}, {"unknown": 1}],
        "/admin/api/l2/cleanup": [{"dry_run": "false"}, {"dry_run": 0}, {"dryrun": False}],
        "/admin/api/evict": [{}, {"task": 1, "input": "stay cached"},
                             {"task": "text", "input": "x", "more": 1}],
        "/admin/api/inspect": [{"task": "text", "input": 3}],
        "/admin/api/hard-examples/abc/label": [{"label": 1}, {"task": "text", "labl": "x"}],
    }
    for path, bodies in wrong_fields.items():
        for content in [*GARBAGE_BODIES, *(json.dumps(b).encode() for b in bodies)]:
            response = httpx.post(url + path, content=content, headers=headers, timeout=10)
            assert response.status_code == 400, (path, content, response.text)
            assert response.json()["error"], (path, content)
    needing_a_body = ("/admin/api/flush", "/admin/api/evict", "/admin/api/inspect",
                      "/admin/api/hard-examples/abc/label")  # fmt: skip
    for path in needing_a_body:
        assert httpx.post(url + path, content=b" ", headers=headers, timeout=10).status_code == 400  # no body
    # Nothing changed: the entry still cached, the generation, the audit log, no cleanup started.
    assert runtime.engine.classify("text", "stay cached").tier == "l1"
    assert runtime.engine.generation == 0 and runtime.admin.audit_rows() == []
    assert runtime.admin.cleanup_progress() is None
    # An empty body is taken where every field is optional, as documented.
    bumped = httpx.post(url + "/admin/api/bump-version", headers=headers, timeout=10)
    assert bumped.status_code == 200 and runtime.engine.generation == 1
    noted = httpx.post(url + "/admin/api/bump-version", json={"note": None}, headers=headers, timeout=10)
    assert noted.status_code == 200 and runtime.engine.generation == 2
