"""CSV downloads of the request log (a window of it) and the audit log, streamed a batch of
rows at a time so a week of traffic never sits in memory at once."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine

from storage.sql import AuditRow, RequestRow

BATCH_ROWS = 1000
MAX_ROWS = 1_000_000  # a download's bound; the window picks which rows
REQUEST_COLUMNS = ("at", "task", "tier", "status", "error_code", "latency_ms", "model_ms", "key_digest",
                   "model_version", "generation", "top_label", "route", "replica")  # fmt: skip
AUDIT_COLUMNS = ("at", "action", "params", "result", "actor", "replica")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: Any) -> Any:
    """A spreadsheet runs a text cell that starts like a formula: labels come from users' models."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return "" if value is None else value


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).isoformat(timespec="milliseconds")


def _lines(header: Sequence[str], rows: Iterator[Sequence[Any]]) -> Iterator[str]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["time_utc", *header])
    for n, row in enumerate(rows, start=1):
        writer.writerow([_iso(row[0]), *(_cell(v) for v in row)])
        if n % BATCH_ROWS == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()


def _rows(db: Engine, query: Any) -> Iterator[Sequence[Any]]:
    with db.connect() as conn:
        result = conn.execution_options(yield_per=BATCH_ROWS).execute(query.limit(MAX_ROWS))
        yield from result


def requests_csv(db: Engine, *, now: float, window_s: float) -> Iterator[str]:
    columns = [getattr(RequestRow, name) for name in REQUEST_COLUMNS]
    query = select(*columns).where(RequestRow.at >= now - window_s).order_by(RequestRow.id)
    return _lines(REQUEST_COLUMNS, _rows(db, query))


def audit_csv(db: Engine) -> Iterator[str]:
    columns = [getattr(AuditRow, name) for name in AUDIT_COLUMNS]
    return _lines(AUDIT_COLUMNS, _rows(db, select(*columns).order_by(AuditRow.id)))
