"""The request-log writer: a bounded queue drained by one background thread in batches.

The request path only calls `submit()`, which never blocks: a full queue drops the
record and counts it. A locked or slow database delays batches (retried with backoff)
instead of requests. `close()` writes whatever is queued before returning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from common.background import BackgroundThread
from storage.sql import RequestRow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriterStats:
    queued: int
    written: int
    dropped: int
    failed_batches: int
    pruned: int
    batches: int = 0  # transactions that wrote rows


class RequestLogWriter:
    """Owns one thread. `submit` takes any record; `to_row` (run on the writer thread,
    off the request path) turns it into a dict of RequestRow column values."""

    def __init__(
        self,
        engine: Engine,
        *,
        to_row: Callable[[Any], dict[str, Any]] = lambda row: row,
        max_queue: int = 20_000,
        batch_size: int = 500,
        flush_interval_s: float = 0.2,
        max_attempts: int = 20,
        retention_days: float | None = 30.0,
        max_rows: int | None = 1_000_000,
        prune_every_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        replica: str | None = None,
    ) -> None:
        self._engine = engine
        self._replica = replica  # written into every row: replicas may share one database
        self._to_row = to_row
        # A deque, not queue.Queue: append is one atomic step with no lock or wake-up
        # on the request path; the writer polls. The bound is checked before append.
        self._pending: deque[Any] = deque()
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._max_attempts = max_attempts
        self._retention_days = retention_days
        self._max_rows = max_rows
        self._prune_every_s = prune_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._in_batch = 0
        self._written = 0
        self._dropped = 0
        self._failed_batches = 0
        self._batches = 0
        self._pruned = 0
        self._closed = False
        self._last_prune = 0.0  # monotonic
        # SQLite's driver takes rows as tuples for one prepared INSERT: about 3 us a row less than
        # SQLAlchemy's insert() turning each dict into its parameters (on every cached hit).
        self._columns = [column.name for column in RequestRow.__table__.columns if column.name != "id"]
        self._plain_insert = (
            f"INSERT INTO {RequestRow.__tablename__} ({', '.join(self._columns)}) "
            f"VALUES ({', '.join('?' * len(self._columns))})"
        ) if engine.dialect.paramstyle == "qmark" else None  # fmt: skip
        self._worker = BackgroundThread("request-log-writer", self._write_due, period_s=flush_interval_s,
                                        final=self._drain, logger=log, what="request log writer")  # fmt: skip
        self._worker.start()

    def submit(self, record: Any) -> bool:
        """Queue one record; never blocks. False (and counted) when the queue is full or closed."""
        if self._closed or len(self._pending) >= self._max_queue:
            self._count_dropped(1)
            return False
        self._pending.append(record)
        return True

    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(len(self._pending) + self._in_batch, self._written, self._dropped,
                               self._failed_batches, self._pruned, self._batches)  # fmt: skip

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every record submitted so far is written (or dropped). For tests and reads."""
        deadline = time.monotonic() + timeout_s
        self._worker.wake()
        while (self._pending or self._in_batch) and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting records, write everything queued, stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._worker.close(timeout_s)  # its last step writes everything queued

    # ---- the writer thread -------------------------------------------------

    def _count_dropped(self, n: int) -> None:
        with self._lock:
            self._dropped += n

    def _take_batch(self) -> list[Any]:
        batch: list[Any] = []
        with self._lock:
            while self._pending and len(batch) < self._batch_size:
                batch.append(self._pending.popleft())
            self._in_batch = len(batch)
        return batch

    def _write_due(self) -> None:
        # What is queued now, in full batches, then sleep: records that arrive meanwhile wait
        # for the next period. A writer that chased a steady stream of requests wrote them a
        # few rows a transaction, and held and took back the GIL from the event loop at every
        # request (two futex calls a hit on each side, ~10 us of a cached hit's CPU).
        while self._write_batch() == self._batch_size:
            pass
        now = time.monotonic()
        if now - self._last_prune >= self._prune_every_s:
            self._last_prune = now
            self._prune()

    def _drain(self) -> None:
        while self._write_batch():
            pass

    def _write_batch(self) -> int:
        """Write one batch of what is queued; its size (0: nothing was queued)."""
        batch = self._take_batch()
        if batch:
            self._write(batch)
            with self._lock:
                self._in_batch = 0
        return len(batch)

    def _write(self, records: list[Any]) -> None:
        try:
            batch = [self._to_row(record) for record in records]
            if self._replica is not None:
                for row in batch:
                    row["replica"] = self._replica
        except Exception:
            log.exception("request log: could not convert %s records; dropped", len(records))
            self._count_dropped(len(records))
            return
        delay = 0.05
        for attempt in range(1, self._max_attempts + 1):
            try:
                with self._engine.begin() as connection:
                    if self._plain_insert is None:
                        connection.execute(insert(RequestRow), batch)
                    else:
                        rows = [tuple(map(row.get, self._columns)) for row in batch]
                        connection.exec_driver_sql(self._plain_insert, rows)
                with self._lock:
                    self._written += len(batch)
                    self._batches += 1
                return
            except SQLAlchemyError as exc:
                with self._lock:
                    self._failed_batches += 1
                if attempt == self._max_attempts:
                    log.error("request log: dropping %s rows after %s attempts: %s", len(batch),
                              attempt, exc.__class__.__name__)  # fmt: skip
                    self._count_dropped(len(batch))
                    return
                time.sleep(delay)  # a locked database: wait and retry, never block requests
                delay = min(delay * 2, 1.0)

    def _prune(self) -> None:
        try:
            with self._engine.begin() as connection:
                removed = 0
                if self._retention_days is not None:
                    cutoff = self._clock() - self._retention_days * 86400
                    removed += connection.execute(delete(RequestRow).where(RequestRow.at < cutoff)).rowcount
                if self._max_rows is not None:
                    count = connection.execute(select(func.count()).select_from(RequestRow)).scalar_one()
                    if count > self._max_rows:
                        newest_dropped = connection.execute(
                            select(RequestRow.id)
                            .order_by(RequestRow.id.desc())
                            .offset(self._max_rows)
                            .limit(1)
                        ).scalar_one()
                        removed += connection.execute(
                            delete(RequestRow).where(RequestRow.id <= newest_dropped)
                        ).rowcount
            if removed:
                with self._lock:
                    self._pruned += removed
        except SQLAlchemyError as exc:
            log.warning("request log pruning failed: %s", exc.__class__.__name__)

    def prune_now(self) -> None:
        """Run retention immediately (tests, admin)."""
        self._prune()
