"""Old versions in L2: how many entries each (task, model version, generation) holds, and
their removal in the background.

Entries of a model version no longer served, or of a generation before the current one, are
never read again (the version and the generation are in every key) but stay in Redis until
their TTL. `census` estimates them from a sample (SCAN, a bounded number of keys per
primary, scaled by DBSIZE; exact when the scan covered everything). `CleanupJob` walks every
primary with SCAN + UNLINK in small batches at a bounded rate, so that live requests keep
their latency, and reports its progress; a dry run counts without deleting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from common.background import STOP, BackgroundThread
from engine.cache.keys import DIGEST_PATTERN, LEGACY_DIGEST_PATTERN
from engine.errors import CacheUnavailableError, InvalidInputError
from storage.redis.store import RedisStore

log = logging.getLogger(__name__)

SAMPLE_KEYS_PER_PRIMARY = 20_000
CLEANUP_BATCH = 100  # keys per SCAN step and per UNLINK pipeline
CLEANUP_RATE = 2_000  # keys examined per second at most (the live request path comes first)
# Entries keyed under an earlier key scheme (xxh3 digests) are never read again: they are
# grouped under their version with this mark, which no served version carries.
LEGACY_SCHEME_MARK = " (xxh3 keys)"

# What is served now: task -> model version, and the generation.
Current = Callable[[], tuple[dict[str, str], int]]


def parse_key(key: bytes | str, prefix: str) -> tuple[str, str, int] | None:
    """(task, model version, generation) of a result, alias or rejection key; None for any
    other key under the prefix (meta, leases, the fleet's). A key of an earlier key scheme
    gives its version with LEGACY_SCHEME_MARK, so that it counts as old."""
    text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    if not text.startswith(prefix + ":"):
        return None
    parts = text[len(prefix) + 1 :].split(":")
    if len(parts) != 4 or not (parts[2].isascii() and parts[2].isdigit()):
        return None
    namespace, version, generation, digest = parts
    if LEGACY_DIGEST_PATTERN.match(digest):
        version += LEGACY_SCHEME_MARK
    elif not DIGEST_PATTERN.match(digest):
        return None
    return namespace.removesuffix("-raw"), version, int(generation)


def is_old(task: str, version: str, generation: int, current: tuple[dict[str, str], int]) -> bool:
    versions, live_generation = current
    return versions.get(task) != version or generation != live_generation


def census(store: RedisStore, *, prefix: str, current: Current,
           max_scanned: int = SAMPLE_KEYS_PER_PRIMARY) -> dict[str, Any]:  # fmt: skip
    """Entries per (task, version, generation), estimated from a sample of each primary."""
    now = current()
    groups: dict[tuple[str, str, int], float] = {}
    exact = True
    scanned_total = 0
    unreachable = []
    for shard in store.primaries():
        try:
            keys, scanned, complete, dbsize = store.sample_keys(shard, max_scanned=max_scanned)
        except CacheUnavailableError:
            unreachable.append(shard)
            continue
        scanned_total += scanned
        exact = exact and complete
        scale = 1.0 if complete or scanned == 0 else dbsize / scanned
        for key in keys:
            parts = parse_key(key, prefix)
            if parts is not None:
                groups[parts] = groups.get(parts, 0.0) + scale
    rows = [
        {"task": task, "model_version": version, "generation": generation, "entries": round(count),
         "current": not is_old(task, version, generation, now)}
        for (task, version, generation), count in sorted(groups.items(), key=lambda kv: -kv[1])
    ]  # fmt: skip
    old = sum(r["entries"] for r in rows if not r["current"])
    return {"exact": exact, "scanned": scanned_total, "rows": rows, "old_estimate": old,
            "unreachable": unreachable}  # fmt: skip


@dataclass
class CleanupProgress:
    dry_run: bool
    state: str = "running"  # running | done | failed | cancelled
    scanned: int = 0  # keys under the prefix examined
    matched: int = 0  # of them, entries of an old version or generation
    deleted: int = 0
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    error: str | None = None
    primaries_done: int = 0
    primaries: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class CleanupJob:
    """One pass over every primary in a thread of its own. `current` is read at each batch, so a
    swap or a bump during the pass counts from then on."""

    def __init__(self, store: RedisStore, *, prefix: str, current: Current, dry_run: bool,
                 rate: float = CLEANUP_RATE, batch: int = CLEANUP_BATCH) -> None:  # fmt: skip
        self._store = store
        self._prefix = prefix
        self._current = current
        self._rate = rate
        self._batch = batch
        self.progress = CleanupProgress(dry_run=dry_run)
        self._lock = threading.Lock()
        # One pass (`_run` ends the loop); `final` reports a cancel that came before the first batch.
        self._worker = BackgroundThread("l2-cleanup", self._run, period_s=0, final=self._unfinished,
                                        logger=log, what="L2 clean-up")  # fmt: skip

    def start(self) -> CleanupJob:
        self._worker.start()
        return self

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self.progress.as_dict()

    @property
    def running(self) -> bool:
        return self._worker.running

    def cancel(self, timeout_s: float = 5.0) -> None:
        self._worker.stop(timeout_s)

    def _unfinished(self) -> None:
        if self.progress.finished_at is None:
            self._finish("cancelled")

    def _run(self) -> object:
        p = self.progress
        try:
            primaries = self._store.primaries()
            p.primaries = len(primaries)
            for shard in primaries:
                for keys in self._store.scan_prefix(shard, count=self._batch):
                    if self._worker.stopping:
                        self._finish("cancelled")
                        return STOP
                    started = time.monotonic()
                    now = self._current()
                    doomed = [
                        k for k in keys if (parts := parse_key(k, self._prefix)) and is_old(*parts, now)
                    ]
                    removed = self._store.unlink_keys(shard, doomed) if doomed and not p.dry_run else 0
                    with self._lock:
                        p.scanned += len(keys)
                        p.matched += len(doomed)
                        p.deleted += removed
                    # The rate limit: each batch takes at least its share of a second.
                    self._worker.wait(max(0.0, len(keys) / self._rate - (time.monotonic() - started)))
                with self._lock:
                    p.primaries_done += 1
            self._finish("done")
        except CacheUnavailableError as exc:
            self._finish("failed", f"Redis did not answer: {exc}")
        except Exception as exc:  # reported in the console, never raised into a request
            log.exception("L2 clean-up failed")
            self._finish("failed", type(exc).__name__)
        return STOP

    def _finish(self, state: str, error: str | None = None) -> None:
        with self._lock:
            self.progress.state = state
            self.progress.error = error
            self.progress.finished_at = time.time()
        log.info("L2 clean-up (%s) %s: %s", "dry run" if self.progress.dry_run else "delete", state,
                 self.progress.as_dict())  # fmt: skip


class Cleanup:
    """At most one clean-up job at a time on this replica; owned by the composition root."""

    def __init__(self, store: RedisStore | None, *, prefix: str, current: Current) -> None:
        self._store = store
        self._prefix = prefix
        self._current = current
        self._job: CleanupJob | None = None
        self._lock = threading.Lock()

    def census(self) -> dict[str, Any]:
        if self._store is None:
            raise InvalidInputError("no_l2", "L2 is disabled: there is nothing to count.")
        return census(self._store, prefix=self._prefix, current=self._current)

    def start(self, *, dry_run: bool) -> dict[str, Any]:
        if self._store is None:
            raise InvalidInputError("no_l2", "L2 is disabled: there is nothing to clean up.")
        with self._lock:
            if self._job is not None and self._job.running:
                raise InvalidInputError("cleanup_running", "A clean-up is already running; see its progress.")
            self._job = CleanupJob(self._store, prefix=self._prefix, current=self._current, dry_run=dry_run)
            self._job.start()
            return self._job.snapshot()

    def progress(self) -> dict[str, Any] | None:
        job = self._job
        return job.snapshot() if job is not None else None

    def close(self) -> None:
        job = self._job
        if job is not None:
            job.cancel()
