"""Shadow verification: a sample of cached entries is recomputed off the request path.

A cache that is fast and wrong is worse than none, and a checksum or a signature proves
only who wrote a value, not that it is right: a canonicalisation bug that maps two inputs
to one key, a replica with other numerics, or anyone holding the signing key can store a
well-formed wrong answer. So each hit is drawn with probability `SHADOW_SAMPLE_RATE`, and a
drawn hit whose entry (its key and answer) this verifier has not checked yet is handed to one
owned background thread, which waits until no request is inside the engine (the model is
idle), runs the model on the same input one at a time and compares the answers within
`SCORE_TOLERANCE`. A mismatch evicts the entry (`evict(key)`: L2 and this replica's L1),
is logged with the key, both answers and both model versions, and is kept for the
console. The request that was sampled has already been answered: it never waits.

Per entry, not per hit: a hot key is drawn after about 1/rate of its hits (as a per-hit sample
would first find it), and then never again while its answer is the one checked. A key names
its model version and generation, so a new version or generation is a new entry, checked
anew; so is another answer under the same key (a forged or recomputed value). The draw stays
random, not a hash of the key: nobody can tell which keys will be checked, so a planted answer
on a hot key is still found after about 1/rate of its hits. What was checked is remembered for
the last `CHECKED_ENTRIES` entries (a fingerprint each); one forgotten is drawn again.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.background import STOP, BackgroundThread
from engine.cache.codec import CachedResult
from engine.models.base import Classifier, Prediction

log = logging.getLogger(__name__)

# Two answers agree when every class both list has scores within this (absolute), a class
# only one lists is within it of the other's last listed score, and so the order may differ
# only between classes closer than it. Measured on the CPU (docs/RELIABILITY.md, python -m bench.trust):
# batch-of-1 vs batched passes and 1 vs 2 intra-op threads differ by at most 3.3e-7 (G21).
SCORE_TOLERANCE = 1e-5
QUEUE_SIZE = 16  # samples waiting for an idle model; more are dropped (and counted)
IDLE_POLL_S = 0.005
MAX_IDLE_WAIT_S = 30.0  # a sample that finds no idle moment this long is dropped
RECENT_MISMATCHES = 50
# Entries drawn (queued or checked) that are not drawn again while their answer is unchanged;
# the oldest are forgotten first. About 0.2 KB each.
CHECKED_ENTRIES = 16_384


@dataclass(frozen=True)
class _Sample:
    task: str
    key: str
    cached: CachedResult
    raw: Any
    canonical: Any  # None when the hit came through a raw-input alias (decoded later)


@dataclass(frozen=True)
class Mismatch:
    at: float
    task: str
    key: str
    cached: list[list[Any]]
    fresh: list[list[Any]]
    cached_version: str
    fresh_version: str
    evicted: bool


@dataclass
class ShadowStats:
    rate: float
    checks: dict[str, int] = field(default_factory=dict)
    mismatches: dict[str, int] = field(default_factory=dict)
    dropped: int = 0  # sampled but not checked: queue full, model never idle, input gone bad
    recent: list[Mismatch] = field(default_factory=list)  # newest first


def agree(a: Prediction, b: Prediction, tolerance: float = SCORE_TOLERANCE) -> bool:
    """Whether two top-k answers are the same within `tolerance` (see SCORE_TOLERANCE)."""
    sa, sb = dict(a.labels), dict(b.labels)
    floor_a, floor_b = a.labels[-1][1], b.labels[-1][1]
    for name in sa.keys() | sb.keys():
        x, y = sa.get(name), sb.get(name)
        if x is not None and y is not None:
            differs = abs(x - y) > tolerance
        elif x is not None:  # only a lists it: b must have ranked it below its last class
            differs = x > floor_b + tolerance
        else:
            differs = (y or 0.0) > floor_a + tolerance
        if differs:
            return False
    # Same scores within tolerance: the order may differ only between near-equal classes.
    return all(
        a.labels[i][0] == b.labels[i][0] or abs(a.labels[i][1] - b.labels[i][1]) <= tolerance
        for i in range(min(len(a.labels), len(b.labels)))
    )


class ShadowVerifier:
    """Owns one daemon thread (start/close). `offer` is called on every hit and costs a
    random draw unless the hit is sampled; then, unless its entry was drawn before, a put on
    a bounded queue."""

    def __init__(
        self,
        *,
        rate: float,
        model_for: Callable[[str], Classifier | None],
        evict: Callable[[str], Any],
        idle: Callable[[], bool],
        tolerance: float = SCORE_TOLERANCE,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._rate = rate
        self._model_for = model_for
        self._evict = evict
        self._idle = idle
        self._tolerance = tolerance
        self._random = (rng or random.Random()).random
        self._clock = clock
        self._queue: queue.Queue[_Sample | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._lock = threading.Lock()
        self._stats = ShadowStats(rate=rate)
        self._recent: deque[Mismatch] = deque(maxlen=RECENT_MISMATCHES)
        self._worker = BackgroundThread("shadow-verifier", self._work_one, period_s=0,
                                        interrupt=self._unblock, join_s=10, logger=log,
                                        what="shadow verifier")  # fmt: skip
        self._processed = 0  # samples taken off the queue and checked or dropped
        self._done = threading.Condition(self._lock)  # tests and the fault suite wait on it
        self._mismatch_listeners: list[Callable[..., Any]] = []  # add_mismatch_listener
        # key -> fingerprint of the answer drawn under it (queued or checked), oldest first.
        self._drawn: dict[str, int] = {}

    # ---- request path -------------------------------------------------------

    def offer(self, task: str, key: str, cached: Any, raw: Any, canonical: Any) -> None:
        if self._random() >= self._rate or not isinstance(cached, CachedResult):
            return
        fingerprint = _fingerprint(cached)
        with self._lock:
            if self._drawn.get(key) == fingerprint:
                return  # this answer under this key is checked, or waiting to be
            self._drawn.pop(key, None)  # re-inserted as the newest
            self._drawn[key] = fingerprint
            if len(self._drawn) > CHECKED_ENTRIES:
                del self._drawn[next(iter(self._drawn))]
        try:
            self._queue.put_nowait(_Sample(task, key, cached, raw, canonical))
        except queue.Full:
            self._forget(key, fingerprint)
            self._count_dropped()

    def add_mismatch_listener(self, listener: Callable[..., Any]) -> None:
        """`listener(task, key, raw, cached=Prediction, fresh=Prediction, version=str)` after each
        mismatch, in the verifier's thread (engine.quality.hard_examples keeps the input)."""
        self._mismatch_listeners.append(listener)

    # ---- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        self._worker.start()

    def close(self) -> None:
        self._worker.close()

    def _unblock(self) -> None:
        try:
            self._queue.put_nowait(None)  # wake the worker
        except queue.Full:
            pass

    def stats(self) -> ShadowStats:
        with self._lock:
            return ShadowStats(
                rate=self._rate, checks=dict(self._stats.checks), mismatches=dict(self._stats.mismatches),
                dropped=self._stats.dropped, recent=list(reversed(self._recent)),
            )  # fmt: skip

    def wait_processed(self, count: int, timeout_s: float) -> bool:
        """Block until `count` samples in all were checked or dropped (tests, fault suite)."""
        deadline = time.monotonic() + timeout_s
        with self._done:
            while self._processed < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._done.wait(left)
        return True

    # ---- the worker ---------------------------------------------------------

    def _work_one(self) -> object:
        sample = self._queue.get()
        if sample is None or self._worker.stopping:
            return STOP
        try:
            if not self._wait_idle():
                self._drop(sample)
            else:
                self._check(sample)
        except Exception:  # never kill the thread; a failed check is not a mismatch
            log.exception("shadow check of %s failed", sample.key)
            self._drop(sample)
        with self._done:
            self._processed += 1
            self._done.notify_all()
        return None

    def _wait_idle(self) -> bool:
        deadline = time.monotonic() + MAX_IDLE_WAIT_S
        while not self._idle():
            if self._worker.wait(IDLE_POLL_S) or time.monotonic() > deadline:
                return False
        return True

    def _check(self, sample: _Sample) -> None:
        model = self._model_for(sample.task)
        # The key names the version that computed it; after a live swap it can no longer be hit.
        if model is None or sample.key.split(":")[-3] != model.version:
            self._count_dropped()  # never hit again: no need to forget it
            return
        canonical = sample.canonical if sample.canonical is not None else model.canonicalize(sample.raw)
        fresh = model.predict_batch([canonical])[0]
        same = agree(sample.cached.prediction, fresh, self._tolerance) and (
            sample.cached.model_version == model.version
        )
        mismatch = None
        if not same:
            self._forget(sample.key, _fingerprint(sample.cached))  # planted again: drawn again
            evicted = True
            try:
                self._evict(sample.key)
            except Exception:
                log.exception("shadow verification could not evict %s", sample.key)
                evicted = False
            mismatch = Mismatch(
                at=self._clock(), task=sample.task, key=sample.key,
                cached=sample.cached.prediction.to_plain(), fresh=fresh.to_plain(),
                cached_version=sample.cached.model_version, fresh_version=model.version, evicted=evicted,
            )  # fmt: skip
            log.error(
                "shadow verification MISMATCH at %s: cached %s (model %s) != recomputed %s (model %s); "
                "evicted=%s", mismatch.key, mismatch.cached, mismatch.cached_version, mismatch.fresh,
                mismatch.fresh_version, evicted,
            )  # fmt: skip
            for listener in self._mismatch_listeners:
                try:
                    listener(sample.task, sample.key, sample.raw, cached=sample.cached.prediction,
                             fresh=fresh, version=model.version)  # fmt: skip
                except Exception:  # the check itself stands; a listener's failure is only logged
                    log.exception("shadow mismatch listener failed")
        with self._lock:
            self._stats.checks[sample.task] = self._stats.checks.get(sample.task, 0) + 1
            if mismatch is not None:
                self._stats.mismatches[sample.task] = self._stats.mismatches.get(sample.task, 0) + 1
                self._recent.append(mismatch)

    def _drop(self, sample: _Sample) -> None:
        """A drawn entry that was not checked: drawn again at a later hit."""
        self._forget(sample.key, _fingerprint(sample.cached))
        self._count_dropped()

    def _forget(self, key: str, fingerprint: int) -> None:
        with self._lock:
            if self._drawn.get(key) == fingerprint:
                del self._drawn[key]

    def _count_dropped(self) -> None:
        with self._lock:
            self._stats.dropped += 1


def _fingerprint(cached: CachedResult) -> int:
    """Which answer an entry holds. Python's hash is salted per process, so no one can make
    another answer with the fingerprint of a checked one."""
    return hash((cached.prediction.labels, cached.model_version))
