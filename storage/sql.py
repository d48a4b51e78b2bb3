"""SQL storage: the request log and the admin audit log (SQLAlchemy 2.0; SQLite by default,
PostgreSQL through psycopg 3 for a fleet sharing one database).

The schema is migrated with Alembic (`storage/migrations/`). `migrate()` runs at start-up
under a lock, so replicas starting together on one database migrate once: on PostgreSQL a
transaction-scoped advisory lock, on SQLite an exclusive transaction; the others wait, then
find the schema current. A database made before Alembic (a `schema_version` table, versions
1-3) is adopted in place: stamped with the matching revision, then upgraded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Float,
    Index,
    Integer,
    String,
    Text,
    create_engine,
    event,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import NullPool

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)


class Base(DeclarativeBase):
    pass


class RequestRow(Base):
    """One classified request. Never the raw input: only a prefix of its key digest."""

    __tablename__ = "request_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float, nullable=False)  # unix seconds
    task: Mapped[str] = mapped_column(String(16), nullable=False)
    tier: Mapped[str | None] = mapped_column(String(16))  # None when the request failed
    latency_ms: Mapped[float] = mapped_column(Float, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)  # ok | invalid | error
    error_code: Mapped[str | None] = mapped_column(String(64))
    key_digest: Mapped[str | None] = mapped_column(String(32))
    model_version: Mapped[str] = mapped_column(String(64), nullable=False)
    generation: Mapped[int] = mapped_column(Integer, nullable=False)
    top_label: Mapped[str | None] = mapped_column(String(128))
    model_ms: Mapped[float | None] = mapped_column(Float)
    route: Mapped[str | None] = mapped_column(String(16))  # gradio | rest (None: rows before v3)
    replica: Mapped[str | None] = mapped_column(String(64))  # REPLICA_ID (None: rows before 0004)

    __table_args__ = (Index("ix_request_log_at", "at"), Index("ix_request_log_key", "key_digest"))


class AuditRow(Base):
    """One operator action: what, with which parameters, what came of it, and who."""

    __tablename__ = "admin_audit"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float, nullable=False)
    action: Mapped[str] = mapped_column(String(32), nullable=False)
    params: Mapped[str] = mapped_column(Text, nullable=False)  # JSON
    result: Mapped[str] = mapped_column(Text, nullable=False)  # JSON
    actor: Mapped[str] = mapped_column(String(64), nullable=False)  # token hash or client address
    replica: Mapped[str | None] = mapped_column(String(64))  # the replica that acted


def make_engine(url: str, *, busy_timeout_ms: int = 2000) -> Engine:
    """An SQLAlchemy engine; SQLite gets WAL (readers never block the writer) and a busy timeout."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, pool_pre_ping=True)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            cursor.close()

    return engine


MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# The pre-Alembic `schema_version` numbers and the revisions that reproduce them.
LEGACY_REVISIONS = {1: "0001", 2: "0002", 3: "0003"}
# pg_advisory_xact_lock key: any constant shared by every replica ("infcache").
PG_MIGRATION_LOCK = 0x696E_6663_6163_6865


class SchemaError(RuntimeError):
    """The database holds a schema this app cannot use (newer than its migrations)."""


# Alembic is imported where it is used: it costs ~0.4 s, and only start-up migrates.


def _alembic_config(connection: Connection) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


@contextmanager
def _locked_connection(engine: Engine, lock_timeout_s: float) -> Iterator[Connection]:
    """A connection inside a transaction that no other migrating replica can enter."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as connection, connection.begin():
            # lock_timeout also bounds the wait for an advisory lock.
            connection.execute(text(f"SET LOCAL lock_timeout = '{int(lock_timeout_s * 1000)}ms'"))
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK})
            yield connection
        return
    if engine.dialect.name == "sqlite":
        # pysqlite issues no BEGIN before DDL; take the transaction into our hands (SQLAlchemy's
        # "pysqlite serializable" recipe) so BEGIN EXCLUSIVE covers every step of the upgrade.
        own = create_engine(engine.url, poolclass=NullPool,
                            connect_args={"timeout": lock_timeout_s})  # fmt: skip

        @event.listens_for(own, "connect")
        def _manual_transactions(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None

        @event.listens_for(own, "begin")
        def _begin_exclusive(connection: Connection) -> None:
            connection.exec_driver_sql("BEGIN EXCLUSIVE")

        try:
            with own.connect() as connection, connection.begin():
                yield connection
        finally:
            own.dispose()
        return
    with engine.connect() as connection, connection.begin():  # other databases: no lock
        yield connection


def _adopt_legacy_schema(connection: Connection) -> None:
    """Stamp a pre-Alembic database with the revision its `schema_version` names."""
    from alembic import command

    tables = set(inspect(connection).get_table_names())
    if "schema_version" not in tables or "alembic_version" in tables:
        return
    version = connection.execute(text("SELECT version FROM schema_version WHERE id = 1")).scalar()
    if version not in LEGACY_REVISIONS:
        raise SchemaError(f"the database's schema_version is {version!r}, which this app does not know")
    command.stamp(_alembic_config(connection), LEGACY_REVISIONS[version])
    connection.execute(text("DROP TABLE schema_version"))
    log.info("database schema: schema_version %s adopted as Alembic revision %s",
             version, LEGACY_REVISIONS[version])  # fmt: skip


def migrate(engine: Engine, *, lock_timeout_s: float = 120.0) -> str:
    """Create or upgrade the schema to the newest revision; returns it.

    Safe when several replicas start together: one migrates under the lock, the others wait
    for it (at most `lock_timeout_s`) and then find nothing to do."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.util.exc import CommandError

    head = head_revision()
    with _locked_connection(engine, lock_timeout_s) as connection:
        _adopt_legacy_schema(connection)
        current = MigrationContext.configure(connection).get_current_revision()
        if current == head:
            return head
        try:
            command.upgrade(_alembic_config(connection), "head")
        except CommandError as exc:  # a revision we do not have: written by a newer app
            raise SchemaError(
                f"the database schema is at revision {current!r}, unknown to this app (newest {head}): "
                f"{exc}"
            ) from None
        log.info("database schema migrated from %s to %s", current or "nothing", head)
    return head


def record_audit(
    engine: Engine,
    *,
    at: float,
    action: str,
    params: dict[str, Any],
    result: dict[str, Any],
    actor: str,
    replica: str | None = None,
) -> None:
    with Session(engine) as session, session.begin():
        session.add(
            AuditRow(
                at=at,
                action=action,
                params=json.dumps(params, sort_keys=True),
                result=json.dumps(result, sort_keys=True, default=str),
                actor=actor,
                replica=replica,
            )
        )


def recent_audit(engine: Engine, *, limit: int = 50) -> list[AuditRow]:
    with Session(engine) as session:
        rows = session.scalars(select(AuditRow).order_by(AuditRow.id.desc()).limit(limit)).all()
        session.expunge_all()
        return list(rows)
