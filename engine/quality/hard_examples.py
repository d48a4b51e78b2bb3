"""Hard examples: inputs the cache cannot help with and the model was unsure of, kept for an
operator to label and export as a data set for the next model (`HARD_EXAMPLES_SIZE` > 0).

What is kept, per task, at most `size` (storage.redis.hard_examples, shared by the fleet):
- answers the model computed (tier "miss", never a hit) whose top score is below
  `max_score`, or whose first two classes are closer than `min_margin`;
- inputs that shadow verification found disagreeing (engine.quality.shadow), with both answers.

The request path (`note`, called by the engine after every answer) costs a comparison of two
floats, and for a kept or held input a dict update under a lock; the raw input is held by
reference until the next flush, within `MAX_HELD` inputs and `MAX_HELD_BYTES` bytes. Later asks
of a kept input (hits included) are counted, so the operator sees how often each was asked, and
when a model computes it again (after a reload) its answer replaces the one shown.

Storing an image costs real CPU (a PNG of a 480x320 picture: ~12 ms here, half an image miss),
so collection has a CPU budget: every miss adds `cpu_share` (HARD_EXAMPLES_CPU_SHARE, 1 %) of
its forward pass's time to a credit (starting at `initial_credit_s`, 1 s of CPU, and capped at
that), each held input reserves its task's last measured cost, each flush settles what it
spent, and while the credit is spent new hard answers are only counted (`over_budget`). So
collection never costs more than that share of the model's time, plus the initial second: a
quiet demo keeps its first few dozen images at once, a busy one samples them.

The owned thread flushes every `FLUSH_S`: it stores new inputs as the warm set does (text as
typed, an image as a PNG of its decoded pixels; engine.lifecycle.warmup.stored_form), counts asks, and
refreshes which ids are kept. These are users' inputs: they never reach the request log, the
audit log or the metrics (only their digests and the operator's labels are audited).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from common.background import BackgroundThread
from engine.errors import CacheUnavailableError
from engine.lifecycle.warmup import stored_form
from engine.models.base import Classifier, Prediction, takes_image
from storage.redis.hard_examples import HardExampleStore, NewEntry

log = logging.getLogger(__name__)

FLUSH_S = 5.0
MAX_HELD = 1_000  # new inputs held between two flushes, all tasks together
MAX_HELD_BYTES = 64 * 1024 * 1024  # and their raw size: a burst of large uploads stays bounded
MAX_EXAMPLE_BYTES = 8 * 1024 * 1024  # a stored input larger than this (a huge image) is not kept
CPU_SHARE = 0.01  # of the model's forward time on misses, the most the flushes spend (credit)
BURST_S = 1.0  # CPU seconds of credit at start and at most (the first few dozen images at once)
# A task's CPU per stored example until a flush has measured it: a PNG of a photo, a message.
FIRST_UNIT_COST_S = {"image": 0.02, "text": 0.0005}
NONE_OF_THESE = "none of these"
STATES = ("pending", "labelled", "none", "skipped")


def hard_reason(prediction: Prediction, *, max_score: float, min_margin: float) -> str | None:
    """Why an answer counts as hard ("low_score", "small_margin"), or None."""
    labels = prediction.labels
    top = labels[0][1]
    if top < max_score:
        return "low_score"
    if len(labels) > 1 and top - labels[1][1] < min_margin:
        return "small_margin"
    return None


def model_classes(model: Classifier) -> list[str]:
    """Every class a model can answer (a user's model: its id2label; the built-ins: intents,
    ImageNet categories); empty when the model does not say."""
    for name in ("labels", "intent_names", "categories"):
        value = getattr(model, name, None)
        if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
            return list(value)
    return []


@dataclass
class _Held:
    raw: Any
    info: dict[str, Any]
    asked: int
    size: int
    reserved_s: float  # CPU credit taken for storing it (its task's last cost per example)


@dataclass
class HardExampleCounters:
    candidates: int = 0  # hard answers noted on this replica
    kept: int = 0  # stored by this replica's flushes
    evicted: int = 0  # made room for them
    refused: int = 0  # the set was full of higher-ranked or labelled examples
    overflow: int = 0  # not held: MAX_HELD or MAX_HELD_BYTES reached before a flush
    over_budget: int = 0  # not held: the CPU credit was spent (see the module docstring)
    too_large: int = 0  # over MAX_EXAMPLE_BYTES once stored
    flushes: int = 0
    flush_cpu_s: float = 0.0  # the flush thread's CPU time (the bench weighs it per miss)
    redis_errors: int = 0


def _digest(key: str) -> str:
    return key.rsplit(":", 1)[-1]


def _size(raw: Any) -> int:
    return len(raw) if isinstance(raw, str | bytes | bytearray) else 1024


class HardExamples:
    """Owns one daemon thread (start/close)."""

    def __init__(
        self,
        store: HardExampleStore,
        *,
        size: int,
        ttl_s: int,
        max_score: float,
        min_margin: float,
        models: Callable[[], Mapping[str, Classifier]],
        cpu_share: float = CPU_SHARE,
        initial_credit_s: float = BURST_S,
        flush_s: float = FLUSH_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if size < 1:
            raise ValueError("HardExamples needs size >= 1 (HARD_EXAMPLES_SIZE=0 means none at all)")
        self.store = store
        self.size = size
        self.ttl_s = int(ttl_s)
        self.max_score = max_score
        self.min_margin = min_margin
        self._models = models
        self._flush_s = flush_s
        self._clock = clock
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._held: dict[tuple[str, str], _Held] = {}
        self._held_bytes = 0
        self._asks: dict[tuple[str, str], int] = {}  # later asks of kept inputs
        self._answers: dict[tuple[str, str], dict[str, Any]] = {}  # their latest computed answers
        self._kept: set[tuple[str, str]] = set()
        self._counters = HardExampleCounters()
        self._cpu_share = cpu_share
        self._credit_cap_s = max(BURST_S, initial_credit_s)  # what a quiet period can save up
        self._credit_s = initial_credit_s  # CPU seconds the flushes may still spend
        self._unit_cost_s: dict[str, float] = {}  # per task: the last flush's CPU per new example
        self._worker = BackgroundThread("hard-examples", self.flush, period_s=flush_s, final=self.flush,
                                        join_s=10, expected=(CacheUnavailableError,),
                                        on_expected=self._flush_skipped, logger=log,
                                        what="hard examples flush")  # fmt: skip

    # ---- the request path ----------------------------------------------------

    def note(self, task: str, result: Any, raw: Any) -> None:
        """One answered request (engine.pipeline.service.ClassifyResult); cheap, never raises."""
        reason = None
        if result.tier == "miss":
            # Unlocked: a lost update of the credit only shifts the budget by one miss's share.
            earned = (result.model_ms or 0.0) * self._cpu_share / 1000
            self._credit_s = min(self._credit_cap_s, self._credit_s + earned)
            reason = hard_reason(result.prediction, max_score=self.max_score, min_margin=self.min_margin)
        ident = (task, _digest(result.key))
        # Lock-free first look (a hit of an input not kept is the common case): membership
        # reads of a dict or set are atomic, and a stale answer only misses one count.
        if reason is None and ident not in self._kept and ident not in self._held:
            return
        with self._lock:
            held = self._held.get(ident)
            if held is not None:
                held.asked += 1
            elif ident in self._kept:
                self._asks[ident] = self._asks.get(ident, 0) + 1
                if result.tier == "miss":  # computed again: after a reload, the new model's answer
                    self._answers[ident] = {"labels": result.prediction.to_plain(),
                                            "model_version": result.model_version,
                                            "answered_at": self._clock()}  # fmt: skip
            elif reason is not None:
                info = {"reason": reason, "labels": result.prediction.to_plain(),
                        "model_version": result.model_version, "answered_at": self._clock()}  # fmt: skip
                self._hold(ident, raw, info)

    def note_disagreement(self, task: str, key: str, raw: Any, *, cached: Prediction, fresh: Prediction,
                          version: str) -> None:  # fmt: skip
        """Shadow verification found the cached answer for `key` wrong (its thread calls this)."""
        info = {"reason": "shadow_mismatch", "labels": fresh.to_plain(), "model_version": version,
                "answered_at": self._clock(), "cached_labels": cached.to_plain()}  # fmt: skip
        with self._lock:
            ident = (task, _digest(key))
            if ident not in self._held and ident not in self._kept:  # else kept already
                self._hold(ident, raw, info, budgeted=False)  # rare, and worth its CPU

    def _hold(self, ident: tuple[str, str], raw: Any, info: dict[str, Any], *, budgeted: bool = True) -> None:
        size = _size(raw)
        self._counters.candidates += 1
        if budgeted and self._credit_s <= 0:
            self._counters.over_budget += 1
            return
        if len(self._held) >= MAX_HELD or self._held_bytes + size > MAX_HELD_BYTES:
            self._counters.overflow += 1
            return
        # Reserved now, so a burst between two flushes cannot overspend; the flush settles it.
        reserved = self._unit_cost(ident[0]) if budgeted else 0.0
        self._credit_s -= reserved
        self._held[ident] = _Held(raw, info, 1, size, reserved)
        self._held_bytes += size

    def _unit_cost(self, task: str) -> float:
        cost = self._unit_cost_s.get(task)
        if cost is None:
            model = self._models().get(task)
            cost = FIRST_UNIT_COST_S["image" if model is not None and takes_image(model) else "text"]
        return cost

    # ---- life cycle ----------------------------------------------------------

    def start(self) -> HardExamples:
        if not self._worker.started:
            try:  # ids kept by the fleet before this replica started: their asks count too
                self.refresh_kept()
            except CacheUnavailableError as exc:
                log.warning("hard examples: Redis did not answer at start-up (%s)", exc)
            self._worker.start()
        return self

    def close(self) -> None:
        """Stop the thread after a last flush; idempotent."""
        self._worker.close()

    def _flush_skipped(self, exc: Exception) -> None:
        self._counters.redis_errors += 1
        log.warning("hard examples flush skipped: Redis did not answer (%s)", exc)

    def counters(self) -> dict[str, Any]:
        with self._lock:
            snap = asdict(self._counters)
            snap["held"], snap["held_bytes"] = len(self._held), self._held_bytes
            snap["credit_s"] = round(self._credit_s, 6)
        return snap

    # ---- flush ---------------------------------------------------------------

    def flush(self) -> None:
        """Held inputs and counted asks to Redis; then which ids the fleet keeps now."""
        with self._flush_lock:
            started = time.thread_time()
            with self._lock:
                held, self._held, self._held_bytes = self._held, {}, 0
                asks, self._asks = self._asks, {}
                answers, self._answers = self._answers, {}
            models = self._models()
            now = self._clock()
            tasks = {task for task, _ in held} | {task for task, _ in asks}
            try:
                for task in sorted(tasks):
                    task_started = time.thread_time()
                    entries = self._entries(task, models.get(task), held, asks, answers, now)
                    outcome = self.store.add(task, entries, size=self.size, ttl_s=self.ttl_s)
                    new = sum(1 for t, _ in held if t == task)
                    with self._lock:
                        self._counters.kept += outcome.added
                        self._counters.evicted += outcome.evicted
                        self._counters.refused += outcome.refused
                        if new:
                            self._unit_cost_s[task] = (time.thread_time() - task_started) / new
                self.refresh_kept(tasks or None)
            finally:
                spent = time.thread_time() - started
                reserved = sum(item.reserved_s for item in held.values())
                with self._lock:
                    self._counters.flushes += 1
                    self._counters.flush_cpu_s += spent
                    self._credit_s -= spent - reserved

    def _entries(self, task: str, model: Classifier | None, held: dict[tuple[str, str], _Held],
                 asks: dict[tuple[str, str], int], answers: dict[tuple[str, str], dict[str, Any]],
                 now: float) -> list[NewEntry]:  # fmt: skip
        entries = [NewEntry(d, b"", answers.get((t, d), {}), n, now)
                   for (t, d), n in asks.items() if t == task and n > 0]  # fmt: skip
        if model is None:  # the task went away meanwhile
            return entries
        kind = "image" if takes_image(model) else "text"
        for (t, digest), item in held.items():
            if t != task:
                continue
            value = stored_form(model, item.raw)
            if value is None:
                continue
            if len(value) > MAX_EXAMPLE_BYTES:
                with self._lock:
                    self._counters.too_large += 1
                continue
            info = {**item.info, "kind": kind, "first_seen": item.info["answered_at"]}
            entries.append(NewEntry(digest, value, info, item.asked, item.info["answered_at"]))
        return entries

    def refresh_kept(self, tasks: set[str] | None = None) -> None:
        """Read which ids are kept (every replica's additions, the operator's deletions)."""
        names = sorted(tasks) if tasks is not None else list(self._models())
        fresh = {(task, ident) for task in names for ident in self.store.ids(task)}
        with self._lock:
            self._kept = {k for k in self._kept if k[0] not in names} | fresh

    def forget(self, task: str, ident: str) -> None:
        """An operator deleted it: later asks no longer count (until it is hard again)."""
        with self._lock:
            self._kept.discard((task, ident))
