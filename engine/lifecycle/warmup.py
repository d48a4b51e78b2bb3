"""Warm-up: the inputs of the hottest keys are kept, so that after a live model swap or a
generation bump they are computed again in the background before users ask.

Opt-in (`WARM_SET_SIZE` > 0): these are users' inputs. They live in Redis only, under the
meta prefix (an operator's flush leaves them; the L2 clean-up never matches them), with a
TTL refreshed while they stay hot, and are never written to the SQL request log (the
warm-up's own requests reach no request listener).

- `WarmSet.note(task, key, raw)` runs on every answered request: a dict increment under a
  lock. The raw input is held (by reference) only for a key not kept in Redis yet that is
  known to be hot, or while fewer than N inputs are held: memory stays bounded at 2N inputs,
  and an input already kept is not encoded again at every flush.
- Every `FLUSH_S` the owned thread adds the counts to the window's sorted set, reads the
  top N over this window and the previous one, stores the held inputs of the top N in one
  hash per task and removes from it every input no longer in the top N (so it holds at most
  N), and refreshes the TTLs. Text is stored as typed (what the user's next request
  canonicalises); an image as a PNG of its canonical pixels (EXIF and metadata gone; any
  model canonicalises it to the same pixels).
- `WarmSet.trigger(tasks)` (a swap, a bump) queues a warm-up: the same thread replays each
  stored input through `engine.warm(task, input)`, one at a time, only while no request is
  inside the engine, and at most `rate` per second, so live requests keep their latency.

Every key of one task shares the hash tag `{task}`: each flush is one pipeline to the one
primary that owns them, also on a Redis Cluster.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
from PIL import Image

from common.background import BackgroundThread
from engine.errors import CacheUnavailableError, InvalidInputError, ModelError
from engine.models.base import Classifier, takes_image
from storage.redis.store import RedisStore

log = logging.getLogger(__name__)

FLUSH_S = 5.0  # counts and inputs reach Redis this often
WINDOW_S = 3600  # hits are counted per window; the top N looks at this one and the last
WARM_RATE = 20.0  # inputs recomputed per second at most
IDLE_POLL_S = 0.01
MAX_IDLE_WAIT_S = 60.0  # an input that finds no idle moment this long is skipped (failed)
MAX_COUNTED_KEYS = 10_000  # distinct keys counted between two flushes; more are not counted


class WarmEngine(Protocol):
    @property
    def models(self) -> Mapping[str, Classifier]: ...
    def warm(self, task: str, raw: Any) -> str: ...
    def idle(self) -> bool: ...


@dataclass
class WarmProgress:
    """One warm-up run: inputs found, recomputed (or already cached), failed."""

    tasks: list[str] = field(default_factory=list)
    running: bool = False
    total: int = 0
    done: int = 0
    computed: int = 0  # of done: the model ran (the rest were cached already)
    failed: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    runs: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _digest(key: str) -> str:
    return key.rsplit(":", 1)[-1]


def stored_form(model: Classifier, raw: Any) -> bytes | None:
    """What is kept of a user's input (here and by engine.quality.hard_examples): text as typed, b"t" +
    UTF-8; an image as b"i" + a PNG of its canonical pixels (EXIF and metadata gone)."""
    if takes_image(model):
        try:
            pixels = model.canonicalize(raw).pixels
        except (InvalidInputError, AttributeError):
            return None
        out = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(out, format="PNG", compress_level=1)
        return b"i" + out.getvalue()
    if isinstance(raw, str):
        return b"t" + raw.encode("utf-8", "surrogatepass")
    return None


class WarmSet:
    """Owns one daemon thread (start/close): flushes counts and runs warm-ups."""

    def __init__(
        self,
        store: RedisStore,
        *,
        prefix: str,
        size: int,
        ttl_s: int,
        engine: WarmEngine,
        window_s: int = WINDOW_S,
        flush_s: float = FLUSH_S,
        rate: float = WARM_RATE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if size < 1:
            raise ValueError("WarmSet needs size >= 1 (WARM_SET_SIZE=0 means no WarmSet at all)")
        self._store = store
        self._prefix = prefix
        self.size = size
        self._ttl_s = int(ttl_s)
        self._engine = engine
        self._window_s = window_s
        self._flush_s = flush_s
        self._rate = rate
        self._clock = clock
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time (the thread's, or a caller's)
        self._counts: dict[tuple[str, str], int] = {}
        self._held: dict[tuple[str, str], Any] = {}  # raw inputs waiting for the next flush
        self._hot: set[tuple[str, str]] = set()  # the top N at the last flush
        self._kept: set[tuple[str, str]] = set()  # inputs in Redis at the last flush: not held again
        self._pending: set[str] = set()  # tasks to warm
        self._progress = WarmProgress()
        self._next_flush = 0.0  # monotonic
        self._worker = BackgroundThread(
            "warm-set", self._tick, period_s=lambda: max(0.0, self._next_flush - time.monotonic()),
            final=lambda: self._safely(self.flush, "flush"),  # the counts of the last seconds
            join_s=10, logger=log, what="warm set",
        )  # fmt: skip

    # ---- keys (hash tag {task}: one slot per task) ---------------------------

    def _base(self, task: str) -> str:
        return f"{self._prefix}:meta:warm:{{{task}}}"

    def hits_key(self, task: str, window: int) -> str:
        return f"{self._base(task)}:hits:{window}"

    def inputs_key(self, task: str) -> str:
        return f"{self._base(task)}:inputs"

    # ---- the request path ----------------------------------------------------

    def note(self, task: str, key: str, raw: Any) -> None:
        """One answered request for `key` (called by the engine; cheap, never raises)."""
        ident = (task, _digest(key))
        with self._lock:
            count = self._counts.get(ident)
            if count is None:
                if len(self._counts) >= MAX_COUNTED_KEYS:
                    return
                count = 0
            self._counts[ident] = count + 1
            if (
                ident not in self._held
                and ident not in self._kept
                and (ident in self._hot or len(self._held) < self.size)
            ):
                self._held[ident] = raw

    # ---- life cycle ----------------------------------------------------------

    def start(self) -> WarmSet:
        if not self._worker.started:
            self._next_flush = time.monotonic() + self._flush_s
            self._worker.start()
        return self

    def close(self) -> None:
        """Stop the thread (a warm-up in progress stops between two inputs); idempotent."""
        self._worker.close()

    def trigger(self, tasks: Iterable[str]) -> None:
        """Warm these tasks soon (a swap, a bump); returns at once."""
        with self._lock:
            self._pending.update(tasks)
            self._progress.running = True  # reported at once: the operator sees it coming
        self._worker.wake()

    def progress(self) -> dict[str, Any]:
        with self._lock:
            snap = self._progress.as_dict()
        snap["size"] = self.size
        snap["ttl_s"] = self._ttl_s
        return snap

    def stored(self, task: str) -> dict[str, bytes]:
        """The inputs kept for `task` now (digest -> stored form): for the console and tests."""
        key = self.inputs_key(task)
        raw = self._store.call(lambda: self._store.client.hgetall(key), key=key)
        return {k.decode(): v for k, v in raw.items()}

    def _tick(self) -> None:
        if time.monotonic() >= self._next_flush:
            self._next_flush = time.monotonic() + self._flush_s
            self._safely(self.flush, "flush")
        with self._lock:
            tasks, self._pending = sorted(self._pending), set()
        if tasks:
            self._safely(lambda t=tasks: self.warm_now(t), "warm-up")  # type: ignore[misc]

    def _safely(self, work: Callable[[], Any], what: str) -> None:
        try:
            work()
        except CacheUnavailableError as exc:
            log.warning("warm set %s skipped: Redis did not answer (%s)", what, exc)
        except Exception:  # never kill the thread
            log.exception("warm set %s failed", what)

    # ---- flush ---------------------------------------------------------------

    def flush(self) -> None:
        """Counts to Redis, the top N's inputs stored, every other input removed."""
        with self._flush_lock:
            with self._lock:
                counts, self._counts = self._counts, {}
                held, self._held = self._held, {}
            window = int(self._clock() // self._window_s)
            for task in sorted({task for task, _ in counts} | {task for task, _ in held}):
                self._flush_task(task, window, counts, held)

    def _flush_task(self, task: str, window: int, counts: dict[tuple[str, str], int],
                    held: dict[tuple[str, str], Any]) -> None:  # fmt: skip
        current, previous = self.hits_key(task, window), self.hits_key(task, window - 1)
        inputs = self.inputs_key(task)
        keep = max(10 * self.size, 100)  # the long tail of the window's counts is dropped
        client = self._store.client

        def count_and_rank() -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for (t, digest), n in counts.items():
                if t == task:
                    pipe.zincrby(current, n, digest)
            pipe.expire(current, 2 * self._window_s)
            pipe.zremrangebyrank(current, 0, -(keep + 1))
            pipe.zrevrange(current, 0, keep - 1, withscores=True)
            pipe.zrevrange(previous, 0, keep - 1, withscores=True)
            pipe.hkeys(inputs)
            return pipe.execute()[-3:]

        now_rank, last_rank, stored = self._store.call(count_and_rank, key=current)
        scores: dict[str, float] = {}
        for member, score in list(now_rank) + list(last_rank):
            name = member.decode()
            scores[name] = scores.get(name, 0.0) + float(score)
        top = sorted(scores, key=lambda d: (-scores[d], d))[: self.size]
        top_set = set(top)
        writes = {}
        model = self._engine.models.get(task)
        for (t, digest), raw in held.items():
            if t == task and digest in top_set and model is not None:
                value = self._stored_form(model, raw)
                if value is not None:
                    writes[digest] = value
        stale = [d for d in (s.decode() for s in stored) if d not in top_set]

        def store_inputs() -> None:
            pipe = client.pipeline(transaction=False)
            if writes:
                pipe.hset(inputs, mapping=writes)
            if stale:
                pipe.hdel(inputs, *stale)
            pipe.expire(inputs, self._ttl_s)
            pipe.execute()

        if writes or stale or stored:
            self._store.call(store_inputs, key=inputs)
        kept = ({s.decode() for s in stored} - set(stale)) | set(writes)
        with self._lock:
            self._hot = {ident for ident in self._hot if ident[0] != task} | {(task, d) for d in top}
            self._kept = {ident for ident in self._kept if ident[0] != task} | {(task, d) for d in kept}

    _stored_form = staticmethod(stored_form)

    @staticmethod
    def _replayed(value: bytes) -> Any:
        return value[1:].decode("utf-8", "surrogatepass") if value[:1] == b"t" else value[1:]

    # ---- warm-up -------------------------------------------------------------

    def warm_now(self, tasks: list[str]) -> dict[str, Any]:
        """Recompute every stored input of `tasks` through the engine (in this thread)."""
        work: list[tuple[str, bytes]] = []
        with self._lock:
            self._progress = WarmProgress(tasks=list(tasks), running=True, started_at=time.time(),
                                          runs=self._progress.runs + 1)  # fmt: skip
        try:
            for task in tasks:
                work.extend((task, value) for value in self.stored(task).values())
        except CacheUnavailableError as exc:
            self._finish(f"Redis did not answer: {exc}")
            raise
        with self._lock:
            self._progress.total = len(work)
        interval = 1.0 / self._rate if self._rate > 0 else 0.0
        for task, value in work:
            if self._worker.stopping:
                self._finish("stopped")
                return self.progress()
            started = time.monotonic()
            outcome = self._warm_one(task, value)
            with self._lock:
                self._progress.done += outcome != "failed"
                self._progress.failed += outcome == "failed"
                self._progress.computed += outcome == "miss"
            self._worker.wait(max(0.0, interval - (time.monotonic() - started)))
        self._finish(None)
        log.info("warm-up of %s: %s", ",".join(tasks), self.progress())
        return self.progress()

    def _warm_one(self, task: str, value: bytes) -> str:
        deadline = time.monotonic() + MAX_IDLE_WAIT_S
        while not self._engine.idle():  # live requests first: wait for a quiet moment
            if time.monotonic() >= deadline or self._worker.wait(IDLE_POLL_S):
                return "failed"
        try:
            return self._engine.warm(task, self._replayed(value))
        except (InvalidInputError, ModelError) as exc:
            log.warning("warm-up of a %s input failed: %s", task, exc)
            return "failed"

    def _finish(self, error: str | None) -> None:
        with self._lock:
            self._progress.running = bool(self._pending)
            self._progress.finished_at = time.time()
            self._progress.error = error
