"""SQL storage: the request log and the admin audit log (SQLAlchemy 2.0, SQLite by default).

Schema changes are ordered steps in `MIGRATIONS`, recorded in `schema_version`:
start-up applies the missing ones, so an upgrade keeps old rows. Small enough not
to need Alembic; switch to it if migrations ever need branching or downgrades.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Float,
    Index,
    Integer,
    String,
    Text,
    create_engine,
    event,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

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


class SchemaVersion(Base):
    __tablename__ = "schema_version"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, nullable=False)


def _v1_initial(connection: Connection) -> None:
    Base.metadata.create_all(connection)


def _v2_request_model_ms(connection: Connection) -> None:
    # v1 databases predate model_ms (needed for "model time saved").
    columns = {c["name"] for c in inspect(connection).get_columns("request_log")}
    if "model_ms" not in columns:
        connection.execute(text("ALTER TABLE request_log ADD COLUMN model_ms FLOAT"))


def _v3_request_route(connection: Connection) -> None:
    # Which front door a request came through (Gradio or the REST API).
    columns = {c["name"] for c in inspect(connection).get_columns("request_log")}
    if "route" not in columns:
        connection.execute(text("ALTER TABLE request_log ADD COLUMN route VARCHAR(16)"))


MIGRATIONS: list[Callable[[Connection], None]] = [_v1_initial, _v2_request_model_ms, _v3_request_route]
SCHEMA_VERSION = len(MIGRATIONS)


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


def migrate(engine: Engine) -> int:
    """Create or upgrade the schema; returns the version now in force."""
    with engine.begin() as connection:
        SchemaVersion.__table__.create(connection, checkfirst=True)
        row = connection.execute(select(SchemaVersion.version).where(SchemaVersion.id == 1)).first()
        current = row[0] if row else 0
        if current > SCHEMA_VERSION:
            raise RuntimeError(
                f"the database schema is version {current}, newer than this app ({SCHEMA_VERSION})"
            )
        for version in range(current + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[version - 1](connection)
            log.info("database schema migrated to version %s", version)
        if row is None:
            connection.execute(insert(SchemaVersion).values(id=1, version=SCHEMA_VERSION))
        elif current != SCHEMA_VERSION:
            connection.execute(
                SchemaVersion.__table__.update().where(SchemaVersion.id == 1).values(version=SCHEMA_VERSION)
            )
    return SCHEMA_VERSION


def record_audit(
    engine: Engine, *, at: float, action: str, params: dict[str, Any], result: dict[str, Any], actor: str
) -> None:
    with Session(engine) as session, session.begin():
        session.add(
            AuditRow(
                at=at,
                action=action,
                params=json.dumps(params, sort_keys=True),
                result=json.dumps(result, sort_keys=True, default=str),
                actor=actor,
            )
        )


def recent_audit(engine: Engine, *, limit: int = 50) -> list[AuditRow]:
    with Session(engine) as session:
        rows = session.scalars(select(AuditRow).order_by(AuditRow.id.desc()).limit(limit)).all()
        session.expunge_all()
        return list(rows)
