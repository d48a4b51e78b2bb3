"""The request and audit logs on SQLite and on a real PostgreSQL server: Alembic migrations
(fresh, from a log made before Alembic, several replicas at once), the writer, every query
the console runs, and replicas sharing one database."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, inspect, select, text
from sqlalchemy.engine import Engine

from admin.console import stats
from storage import sql
from storage.log_writer import RequestLogWriter
from storage.sql import (
    AuditRow,
    Base,
    RequestRow,
    SchemaError,
    current_revision,
    head_revision,
    make_engine,
    migrate,
    recent_audit,
    record_audit,
)
from tests.conftest import CountingTextModel

ROOT = Path(__file__).resolve().parent.parent
LEGACY = Path(__file__).parent / "data" / "legacy_db"  # dumps of logs made by the pre-Alembic code
NOW = 2_000_000_000.0


@pytest.fixture
def db(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    migrate(engine)
    yield engine
    engine.dispose()


def schema_drift(engine: Engine) -> list[Any]:
    """What differs between the migrated database and the models (nothing, when they agree)."""
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), Base.metadata)


def row(i: int, *, at: float = NOW - 30, tier: str | None = "l1", status: str = "ok", **extra: Any) -> dict:
    return {"at": at, "task": "text", "tier": tier, "latency_ms": 0.2 + i, "status": status,
            "error_code": None, "key_digest": f"{i % 3:016x}", "model_version": "v", "generation": 0,
            "top_label": f"label{i}", "model_ms": None, "route": "gradio"} | extra  # fmt: skip


class TestMigrations:
    def test_a_new_database_gets_the_models_schema(self, database_url: str) -> None:
        engine = make_engine(database_url)
        try:
            assert current_revision(engine) is None
            assert migrate(engine) == head_revision() == current_revision(engine)
            assert schema_drift(engine) == []
            assert migrate(engine) == head_revision()  # again: nothing to do
            assert "schema_version" not in inspect(engine).get_table_names()
        finally:
            engine.dispose()

    @pytest.mark.parametrize("version", [1, 2, 3])
    def test_a_log_from_before_alembic_upgrades_in_place(self, version: int, tmp_path: Path) -> None:
        path = tmp_path / "old.sqlite3"
        with sqlite3.connect(path) as old:
            old.executescript((LEGACY / f"requests-v{version}.sql").read_text())
        old.close()
        engine = make_engine(f"sqlite:///{path}")
        try:
            assert migrate(engine) == head_revision()
            assert "schema_version" not in inspect(engine).get_table_names()
            assert schema_drift(engine) == []
            with engine.connect() as conn:
                kept = conn.execute(text("SELECT id, at, tier, top_label, model_ms, route, replica "
                                         "FROM request_log ORDER BY id")).all()  # fmt: skip
                audit = conn.execute(text("SELECT action, actor, replica FROM admin_audit")).all()
                assert conn.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
            assert [(r.id, r.at, r.tier, r.top_label) for r in kept] == [
                (1, 1700000000.0, "miss", "tabby"), (2, 1700000030.0, "l1", "refund"),
                (3, 1700000060.0, "l2", None), (4, 1700000090.0, "coalesced", "espresso"),
                (5, 1700000120.0, "miss", "greeting"), (6, 1700000150.0, None, None),
            ]  # fmt: skip
            # Columns the old schema had keep their values; the new ones start empty.
            model_ms = [None] * 6 if version == 1 else [12.0, None, None, None, 12.0, None]
            routes = [None] * 6 if version < 3 else ["gradio", "rest", *["gradio"] * 4]
            assert [r.model_ms for r in kept] == model_ms and [r.route for r in kept] == routes
            assert {r.replica for r in kept} == {None}
            assert audit == [("flush", "token:abcd", None)]
            # The console reads the old rows beside new ones.
            writer = RequestLogWriter(engine, prune_every_s=3600, replica="new-replica")
            writer.submit(row(7, at=1700000160.0))
            writer.close()
            summary = stats.summary(engine, now=1700000200.0, window_s=3600)
            assert summary.total == 7 and summary.by_replica == {"": 6, "new-replica": 1}
            assert summary.by_tier == {"l1": 2, "l2": 1, "coalesced": 1, "miss": 2}
        finally:
            engine.dispose()

    def test_a_schema_from_a_newer_app_is_refused_untouched(self, db: Engine) -> None:
        with db.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
        with pytest.raises(SchemaError, match="9999_from_the_future"):
            migrate(db)
        assert current_revision(db) == "9999_from_the_future"

    def test_an_unknown_schema_version_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "odd.sqlite3"
        with sqlite3.connect(path) as old:
            old.executescript((LEGACY / "requests-v3.sql").read_text().replace("VALUES(1,3)", "VALUES(1,7)"))
        old.close()
        engine = make_engine(f"sqlite:///{path}")
        try:
            with pytest.raises(SchemaError, match="schema_version is 7"):
                migrate(engine)
            assert "schema_version" in inspect(engine).get_table_names()  # left as it was
        finally:
            engine.dispose()

    def test_a_second_migration_waits_for_the_first(
        self, database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Deterministic: the first migration is held inside its lock; the second must not
        start its own until the first has finished, then finds nothing to do."""
        entered, release, calls = threading.Event(), threading.Event(), []
        adopt = sql._adopt_legacy_schema

        def held_first(connection: Any) -> None:  # runs inside the lock
            calls.append(connection)
            if len(calls) == 1:
                entered.set()
                release.wait(30)
            adopt(connection)

        monkeypatch.setattr(sql, "_adopt_legacy_schema", held_first)
        caplog.set_level(logging.INFO, logger="storage.sql")
        engines = [make_engine(database_url) for _ in range(2)]
        results: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, migrate(engines[i])))
                   for i in range(2)]  # fmt: skip
        try:
            threads[0].start()
            assert entered.wait(30)
            threads[1].start()
            time.sleep(1.0)
            assert len(calls) == 1 and threads[1].is_alive(), "the second migration did not wait"
            release.set()
            for thread in threads:
                thread.join(60)
        finally:
            release.set()
            for engine in engines:
                engine.dispose()
        assert results == {0: head_revision(), 1: head_revision()}
        assert sum("migrated from nothing" in r.getMessage() for r in caplog.records) == 1

    def test_replicas_starting_together_migrate_once(self, database_url: str) -> None:
        """Four processes migrate one new database at the same instant: one does the work,
        the others wait for its lock and find the schema current; none fails."""
        start_at = time.time() + 4.0  # every process imported and connected by then
        script = (
            "import logging, sys, time\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s', stream=sys.stdout)\n"
            "from sqlalchemy import text\n"
            "from storage.sql import make_engine, migrate\n"
            "engine = make_engine(sys.argv[1])\n"
            "with engine.connect() as conn: conn.execute(text('SELECT 1'))\n"
            "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
            "print('HEAD', migrate(engine))\n"
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, database_url, str(start_at)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for _ in range(4)
        ]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, outputs
        assert all(f"HEAD {head_revision()}" in out for out in outputs), outputs
        assert sum("migrated from nothing" in out for out in outputs) == 1, outputs
        engine = make_engine(database_url)
        try:
            assert schema_drift(engine) == []
        finally:
            engine.dispose()


class TestQueries:
    """Every query the console runs gives the same answers on both backends."""

    def fill(self, db: Engine) -> None:
        rows = {
            "a": [row(0, tier="miss", model_ms=40.0, latency_ms=45.0), row(1), row(2), row(3, tier="l2"),
                  row(4, tier="coalesced"), row(5, tier=None, status="invalid", key_digest=None)],
            "b": [row(6, tier="miss", model_ms=20.0, latency_ms=3000.0, at=NOW - 200), row(7),
                  row(8, at=NOW - 7200)],  # the last one outside a 1 h window
        }  # fmt: skip
        for replica, batch in rows.items():
            writer = RequestLogWriter(db, prune_every_s=3600, replica=replica)
            for r in batch:
                writer.submit(r)
            writer.close()

    def test_summary(self, db: Engine) -> None:
        self.fill(db)
        summary = stats.summary(db, now=NOW, window_s=3600)
        assert (summary.total, summary.ok, summary.invalid, summary.errors) == (8, 7, 1, 0)
        assert summary.by_tier == {"l1": 3, "l2": 1, "coalesced": 1, "miss": 2}
        assert summary.by_task == {"text": 8} and summary.by_replica == {"a": 6, "b": 2}
        assert summary.hit_rate == pytest.approx(5 / 7)
        assert summary.avg_miss_model_ms == pytest.approx(30.0)
        assert summary.model_seconds_saved == pytest.approx(0.030 * 5)
        empty = stats.summary(db, now=NOW + 86400, window_s=60)
        assert empty.total == 0 and empty.hit_rate is None and empty.by_replica == {}

    def test_per_minute(self, db: Engine) -> None:
        self.fill(db)
        buckets = stats.per_minute(db, now=NOW, window_s=3600)
        minute = lambda at: at // 60 * 60  # noqa: E731
        assert [(b.minute, b.total, b.hits) for b in buckets] == [
            (minute(NOW - 200), 1, 0), (minute(NOW - 30), 6, 5),
        ]  # fmt: skip
        # Refused misses (a client over its budget) are drawn with the tiers, never counted as answers.
        assert buckets[1].by_tier == {"l1": 3, "l2": 1, "coalesced": 1, "miss": 1, "refused": 0}

    def test_latency_histogram(self, db: Engine) -> None:
        self.fill(db)
        got = {(b.tier, b.upper_ms): b.count for b in stats.latency_histogram(db, now=NOW, window_s=3600)}
        assert got == {("coalesced", 5.0): 1, ("l1", 2.5): 2, ("l1", 10.0): 1, ("l2", 5.0): 1,
                       ("miss", 50.0): 1, ("miss", 5000.0): 1}  # fmt: skip

    def test_hot_keys(self, db: Engine) -> None:
        self.fill(db)
        hot = stats.hot_keys(db, now=NOW, window_s=3600)
        assert [(k.key_digest, k.count, k.last_label) for k in hot] == [
            (f"{0:016x}", 3, "label6"), (f"{1:016x}", 3, "label7"), (f"{2:016x}", 1, "label2"),
        ]  # fmt: skip
        assert sum(k.share for k in hot) == pytest.approx(1.0)

    def test_a_steady_stream_is_written_a_batch_per_period(self, db: Engine) -> None:
        """Rows that keep arriving wait for the next period: a writer that chased them wrote a few
        rows a transaction and took the GIL from the request path at every request."""
        writer = RequestLogWriter(db, flush_interval_s=0.2, prune_every_s=3600)
        try:
            submitted, deadline = 0, time.monotonic() + 1.5
            while time.monotonic() < deadline:  # ~2,000 requests a second, as a busy replica's hits
                writer.submit(row(submitted))
                submitted += 1
                time.sleep(0.0005)
            writer.flush()
            stats = writer.stats()
            assert stats.written == submitted and stats.dropped == 0
            # 1.5 s at one batch per 0.2 s period (a full batch of 500 may add one), plus the flush.
            assert stats.batches <= 16, (stats.batches, submitted)
        finally:
            writer.close()
        with db.connect() as conn:
            assert conn.execute(select(func.count()).select_from(RequestRow)).scalar_one() == submitted

    def test_retention_prunes_by_age_and_count(self, db: Engine) -> None:
        writer = RequestLogWriter(db, retention_days=1, max_rows=100, prune_every_s=3600, clock=lambda: NOW)
        try:
            for i in range(50):
                writer.submit(row(i, at=NOW - 3 * 86400))
            for i in range(150):
                writer.submit(row(i, at=NOW - 60))
            writer.flush()
            writer.prune_now()
            with db.connect() as conn:
                oldest, count = conn.execute(select(func.min(RequestRow.at), func.count())).one()
            assert (oldest, count) == (NOW - 60, 100) and writer.stats().pruned == 100
        finally:
            writer.close()

    def test_audit_rows_name_their_replica(self, db: Engine) -> None:
        record_audit(db, at=NOW, action="flush", params={"tier": "l1"}, result={"ok": True}, actor="t:1",
                     replica="a")  # fmt: skip
        record_audit(db, at=NOW + 1, action="bump_version", params={}, result={"generation": 1}, actor="t:1",
                     replica="b")  # fmt: skip
        rows = recent_audit(db)
        assert [(r.action, r.replica) for r in rows] == [("bump_version", "b"), ("flush", "a")]
        assert isinstance(rows[0], AuditRow) and rows[0].params == "{}"


def test_replicas_sharing_a_database_are_all_counted(make_runtime, database_url: str) -> None:
    """Two replicas, one database: the console of either counts both, each row names its replica,
    and each audit row names the replica that acted."""
    a = make_runtime(
        models={"text": CountingTextModel()}, log__database_url=database_url, server__replica_id="replica-a",
    )
    b = make_runtime(
        models={"text": CountingTextModel()}, log__database_url=database_url, server__replica_id="replica-b",
    )
    for message in ["one", "two", "one"]:
        a.engine.classify("text", message)
    for message in ["three", "three"]:
        b.engine.classify("text", message)
    b.log_writer.flush()
    for runtime in (a, b):
        summary = runtime.admin.stats("1h")["summary"]
        assert summary["total"] == 5 and summary["by_replica"] == {"replica-a": 3, "replica-b": 2}
        assert summary["by_tier"]["l1"] == 2 and summary["by_tier"]["miss"] == 3
    b.admin.flush("l1", actor="token:test")
    assert [(r["action"], r["replica"]) for r in a.admin.audit_rows()] == [("flush", "replica-b")]


def test_console_says_the_log_is_unavailable_while_postgresql_is_down(make_runtime) -> None:
    """Its own server, stopped mid-test: requests go on, the console gets a clear 503-style
    error (no traceback), and once the server is back the queued rows are written and read."""
    from admin.console.service import LogUnavailableError
    from testing.postgres_server import PostgresServer

    with PostgresServer() as server:
        runtime = make_runtime(models={"text": CountingTextModel()}, log__database_url=server.url())
        runtime.engine.classify("text", "before")
        assert runtime.admin.stats("1h")["summary"]["total"] == 1
        server.stop("immediate")
        for message in ["during", "during", "another"]:
            assert runtime.engine.classify("text", message).tier in ("miss", "l1")
        with pytest.raises(LogUnavailableError, match="request log database is unavailable"):
            runtime.admin.stats("1h")
        server.start()
        runtime.log_writer.flush(timeout_s=30)
        assert runtime.admin.stats("1h")["summary"]["total"] == 4
        assert runtime.log_writer.stats().dropped == 0
        runtime.close()
