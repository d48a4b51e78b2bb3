"""The request-log writer: a bounded queue drained by one background thread in batches.

The request path only calls `submit()`, which never blocks: a full queue drops the
row and counts it. A locked or slow database delays batches (retried with backoff)
instead of requests. `close()` writes whatever is queued before returning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from storage.sql import RequestRow

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class WriterStats:
    queued: int
    written: int
    dropped: int
    failed_batches: int
    pruned: int


class RequestLogWriter:
    """Owns one thread. Rows are plain dicts of RequestRow column values."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int = 20_000,
        batch_size: int = 500,
        flush_interval_s: float = 0.25,
        max_attempts: int = 20,
        retention_days: float | None = 30.0,
        max_rows: int | None = 1_000_000,
        prune_every_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine = engine
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._max_attempts = max_attempts
        self._retention_days = retention_days
        self._max_rows = max_rows
        self._prune_every_s = prune_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._written = 0
        self._dropped = 0
        self._failed_batches = 0
        self._pruned = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="request-log-writer", daemon=True)
        self._thread.start()

    def submit(self, row: dict[str, Any]) -> bool:
        """Queue one row; never blocks. False (and counted) when the queue is full or closed."""
        if self._closed:
            self._count_dropped(1)
            return False
        try:
            self._queue.put_nowait(row)
            return True
        except queue.Full:
            self._count_dropped(1)
            return False

    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(self._queue.qsize(), self._written, self._dropped, self._failed_batches,
                               self._pruned)  # fmt: skip

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every row queued so far is written (or dropped). For tests and shutdown."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self, timeout_s: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)  # blocks only if full, and the thread is draining it
        self._thread.join(timeout=timeout_s)

    # ---- the writer thread -------------------------------------------------

    def _count_dropped(self, n: int) -> None:
        with self._lock:
            self._dropped += n

    def _run(self) -> None:
        last_prune = 0.0
        stopping = False
        while not stopping:
            batch: list[dict[str, Any]] = []
            try:
                item = self._queue.get(timeout=self._flush_interval_s)
            except queue.Empty:
                item = None
            if item is _STOP:
                stopping = True
                self._queue.task_done()
            elif item is not None:
                batch.append(item)
            # Take what is already queued, up to a batch.
            while len(batch) < self._batch_size:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    self._queue.task_done()
                    continue
                batch.append(item)
            if batch:
                self._write(batch)
                for _ in batch:
                    self._queue.task_done()
            if stopping:
                self._drain_rest()
            now = time.monotonic()
            if now - last_prune >= self._prune_every_s:
                last_prune = now
                self._prune()

    def _drain_rest(self) -> None:
        while True:
            batch = []
            while len(batch) < self._batch_size:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._queue.task_done()
                if item is not _STOP:
                    batch.append(item)
            if not batch:
                return
            self._write(batch)

    def _write(self, batch: list[dict[str, Any]]) -> None:
        delay = 0.05
        for attempt in range(1, self._max_attempts + 1):
            try:
                with self._engine.begin() as connection:
                    connection.execute(insert(RequestRow), batch)
                with self._lock:
                    self._written += len(batch)
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
