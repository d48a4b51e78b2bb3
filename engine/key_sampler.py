"""What hit ratio each cache size would give: miss-ratio curves from the live key stream.

SHARDS (Waldspurger et al., "Efficient MRC Construction with SHARDS", FAST '15), fixed-size
variant: a key is sampled when a hash of it falls under a threshold T (rate R = T / 2^32), so
every reference to a sampled key is seen and reuse distances among sampled keys, scaled by
1/R, estimate the true ones. At most `max_keys` keys are tracked: past that, T is lowered to
the largest tracked hash and the keys above it are forgotten, so memory and CPU stay bounded
whatever the traffic. Each sampled reference is counted with weight 1/R (the rate it was
sampled at), and the shortfall between the requests seen and the weights recorded goes to
the smallest distance (SHARDS_adj), which corrects most of the error hot keys cause.

Distances are in bytes, from each entry's real encoded size: a reference hits an LRU cache
of C bytes exactly when the bytes of the distinct entries used since its previous use, its
own included, fit in C. A reuse later than the tier's TTL counts as a miss at every size.
The L2 distance adds Redis's per-entry overhead to each entry.

The hook on the request path (`observe`) only queues the use; the profiles are updated off it
(`KeySampler`): a hash compare for an unsampled key, a few microseconds for a sampled one (three
Fenwick-tree steps over packed size/count sums), in each of two profiles.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

HASH_SPACE = 1 << 32
BIN_RATIO = 1.03  # distance histogram bins: ±1.5 % of a size, finer than any curve step
_LOG_RATIO = math.log(BIN_RATIO)
# Fenwick values pack an entry's bytes and a count of 1 so one tree answers both sums.
_COUNT_UNIT = 1 << 40
# What a key costs Redis beyond its key and value bytes (dict entry, objects, expiry entry,
# allocator rounding): measured with MEMORY USAGE on small entries, about 80-100 bytes.
REDIS_ENTRY_OVERHEAD = 96
MIN_CAPACITY = 256  # the smallest Fenwick tree (stamps before a renumbering)
MINUTE_S = 60
HOUR_S = 3600
KEEP_MINUTES = 60  # minute buckets for the last hour, then merged into hour buckets
KEEP_HOURS = 7 * 24
log = logging.getLogger(__name__)

OVERALL = "*"  # the profile of every task's keys together (what one shared L1 sees)

Sizer = Callable[[str, Any], int]


def key_hash(key: str) -> int:
    """32 uniform bits of the key: its digest's last 8 hex digits (BLAKE3, already computed).
    Sampling by input, not by version or generation: the same inputs stay sampled."""
    try:
        return int(key[-8:], 16)
    except ValueError:
        return hash(key) & (HASH_SPACE - 1)


def _bin(distance: float) -> int:
    return int(math.log(max(distance, 1.0)) / _LOG_RATIO)


def _bin_bytes(index: int) -> float:
    return BIN_RATIO ** (index + 0.5)  # the geometric middle of the bin


class _Fenwick:
    """Prefix sums over positions 1..n (a binary indexed tree)."""

    __slots__ = ("total", "tree")

    def __init__(self, size: int) -> None:
        self.tree = [0] * (size + 1)
        self.total = 0

    @classmethod
    def build(cls, values: list[int], size: int) -> _Fenwick:
        """A tree holding `values` at positions 1..len(values), in O(size)."""
        tree = cls(size)
        tree.tree[1 : len(values) + 1] = values
        for index in range(1, size + 1):
            parent = index + (index & -index)
            if parent <= size:
                tree.tree[parent] += tree.tree[index]
        tree.total = sum(values)
        return tree

    def add(self, index: int, value: int) -> None:
        tree, n = self.tree, len(self.tree)
        self.total += value
        while index < n:
            tree[index] += value
            index += index & -index

    def prefix(self, index: int) -> int:
        tree, s = self.tree, 0
        while index > 0:
            s += tree[index]
            index -= index & -index
        return s


@dataclass
class _Tracked:
    stamp: int  # position of its last use in the Fenwick tree
    size: int  # its entry's bytes in L1 (key + encoded value)
    last_at: float
    hash: int


@dataclass
class _Counts:
    """Requests and sampled reuse distances of one time bucket."""

    requests: int = 0
    weight: float = 0.0  # sampled references, each weighted 1/R
    l1: dict[int, float] = field(default_factory=dict)  # distance bin -> weight of hits
    l2: dict[int, float] = field(default_factory=dict)

    def merge(self, other: _Counts) -> None:
        self.requests += other.requests
        self.weight += other.weight
        for mine, theirs in ((self.l1, other.l1), (self.l2, other.l2)):
            for index, w in theirs.items():
                mine[index] = mine.get(index, 0.0) + w


class ReuseProfile:
    """The sampled reuse distances of one key stream (a task, or every task). Thread-safe."""

    def __init__(self, *, max_keys: int, l1_ttl_s: float, l2_ttl_s: float) -> None:
        self._max_keys = max(16, max_keys)
        self._ttl = (l1_ttl_s, l2_ttl_s)
        self._threshold = HASH_SPACE  # sampled when key_hash < threshold: all keys at first
        self._keys: dict[str, _Tracked] = {}
        self._heap: list[tuple[int, str]] = []  # (-hash, key): the largest tracked hash first
        # Stamps run up to `capacity`, then are renumbered; the tree grows with the keys
        # tracked (a smaller tree is fewer steps per use).
        self._capacity = MIN_CAPACITY
        self._tree = _Fenwick(self._capacity)
        self._next = 1
        self._minutes: dict[int, _Counts] = {}
        self._hours: dict[int, _Counts] = {}
        self._current: tuple[int, _Counts] | None = None
        self._lock = threading.Lock()

    @property
    def rate(self) -> float:
        return self._threshold / HASH_SPACE

    def observe(self, key: str, h: int, now: float, size_of: Callable[[], int]) -> None:
        with self._lock:
            counts = self._bucket(now)
            counts.requests += 1
            if h >= self._threshold:
                return
            weight = HASH_SPACE / self._threshold
            counts.weight += weight
            tracked = self._keys.get(key)
            if tracked is None:  # a first use: a miss at every size
                self._track(key, h, now, size_of())
                return
            tree, entry = self._tree, tracked.size + _COUNT_UNIT
            count, size_sum = divmod(tree.total - tree.prefix(tracked.stamp), _COUNT_UNIT)
            gap = now - tracked.last_at
            l1 = size_sum * weight + tracked.size
            if gap <= self._ttl[0]:
                index = _bin(l1)
                counts.l1[index] = counts.l1.get(index, 0.0) + weight
            if gap <= self._ttl[1]:
                index = _bin(l1 + (count * weight + 1) * REDIS_ENTRY_OVERHEAD)
                counts.l2[index] = counts.l2.get(index, 0.0) + weight
            stamp = self._stamp()  # first: a renumbering moves this key's old stamp too
            self._tree.add(tracked.stamp, -entry)
            self._tree.add(stamp, entry)
            tracked.stamp, tracked.last_at = stamp, now

    def _track(self, key: str, h: int, now: float, size: int) -> None:
        tracked = _Tracked(self._stamp(), size, now, h)
        self._keys[key] = tracked
        self._tree.add(tracked.stamp, size + _COUNT_UNIT)
        heapq.heappush(self._heap, (-h, key))
        while len(self._keys) > self._max_keys:
            # Lower the threshold to the largest tracked hash: that key (and any equal) leaves.
            top = -self._heap[0][0]
            self._threshold = top
            while self._heap and -self._heap[0][0] >= top:
                _, gone = heapq.heappop(self._heap)
                dropped = self._keys.pop(gone)
                self._tree.add(dropped.stamp, -(dropped.size + _COUNT_UNIT))

    def _stamp(self) -> int:
        if self._next > self._capacity:  # renumber the live stamps 1..n, in order of last use
            ordered = sorted(self._keys.values(), key=lambda t: t.stamp)
            self._capacity = max(MIN_CAPACITY, 4 * len(ordered))
            self._tree = _Fenwick.build([t.size + _COUNT_UNIT for t in ordered], self._capacity)
            for position, tracked in enumerate(ordered, start=1):
                tracked.stamp = position
            self._next = len(ordered) + 1
        stamp = self._next
        self._next += 1
        return stamp

    def _bucket(self, now: float) -> _Counts:
        minute = int(now // MINUTE_S)
        if self._current is not None and self._current[0] == minute:
            return self._current[1]
        counts = self._minutes.setdefault(minute, _Counts())
        self._current = (minute, counts)
        for old in [m for m in self._minutes if m <= minute - KEEP_MINUTES]:
            self._hours.setdefault(old * MINUTE_S // HOUR_S, _Counts()).merge(self._minutes.pop(old))
        for old in [h for h in self._hours if h <= now // HOUR_S - KEEP_HOURS]:
            del self._hours[old]
        return counts

    def window(self, now: float, window_s: float) -> tuple[_Counts, int]:
        """The counts of the buckets that start within `window_s` of `now` (minutes for the
        last hour, whole hours before that), and the distinct keys used in it (estimated)."""
        start = now - window_s
        total = _Counts()
        with self._lock:
            for minute, counts in self._minutes.items():
                if minute * MINUTE_S + MINUTE_S > start:
                    total.merge(counts)
            for hour, counts in self._hours.items():
                if hour * HOUR_S + HOUR_S > start:
                    total.merge(counts)
            sampled = sum(1 for t in self._keys.values() if t.last_at >= start)
            rate = self.rate
        return total, round(sampled / rate)

    def tracked(self) -> int:
        return len(self._keys)


def hit_ratios(counts: _Counts, histogram: dict[int, float], sizes: Iterable[int]) -> list[float]:
    """The estimated hit ratio at each cache size (bytes), SHARDS_adj-corrected."""
    if counts.requests == 0:
        return [0.0 for _ in sizes]
    # The requests the sample missed or over-counted are put at the smallest distance.
    shortfall = counts.requests - counts.weight
    ordered = sorted(histogram.items())
    out = []
    for size in sizes:
        hits = sum(w for index, w in ordered if _bin_bytes(index) <= size)
        out.append(min(1.0, max(0.0, (hits + (shortfall if hits > 0 else 0.0)) / counts.requests)))
    return out


class KeySampler:
    """The engine's key-stream hook (`observe`): a profile per task and one of all tasks.

    The request path only queues (task, key, value, time): about a microsecond. The profiles
    are updated off it, by `start()`'s thread in small batches that yield between them (so a
    request never waits long for the GIL), or by whoever reads them (`profiles()` catches up
    first). A queue that falls `max_queue` behind drops references and counts them.
    `sizer(key, value)` gives an entry's L1 bytes; it is called once per newly sampled key.
    """

    def __init__(
        self,
        *,
        sizer: Sizer,
        max_keys: int = 4096,
        l1_ttl_s: float = math.inf,
        l2_ttl_s: float = math.inf,
        clock: Callable[[], float] = time.time,
        max_queue: int = 100_000,
        period_s: float = 0.5,
    ) -> None:
        self._sizer = sizer
        self._options = {"max_keys": max_keys, "l1_ttl_s": l1_ttl_s, "l2_ttl_s": l2_ttl_s}
        self._clock = clock
        self._profiles: dict[str, ReuseProfile] = {OVERALL: ReuseProfile(**self._options)}
        self._queue: deque[tuple[str, str, Any, float]] = deque()
        self._max_queue = max_queue
        self._period_s = period_s
        self._drain_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def observe(self, task: str, key: str, value: Any) -> None:
        """One use of cache key `key` (any tier), on the request path: queued, never raises."""
        if len(self._queue) >= self._max_queue:
            self.dropped += 1  # the background thread fell behind: this use is not sampled
            return
        self._queue.append((task, key, value, self._clock()))

    def drain(self, batch: int = 64) -> None:
        """Apply every queued use to the profiles, `batch` at a time, yielding between batches."""
        with self._drain_lock:
            while self._queue:
                for _ in range(min(batch, len(self._queue))):
                    self._apply(*self._queue.popleft())
                time.sleep(0)  # let a request thread take the GIL

    def _apply(self, task: str, key: str, value: Any, now: float) -> None:
        profile = self._profiles.get(task)
        if profile is None:
            profile = self._profiles[task] = ReuseProfile(**self._options)
        h = key_hash(key)
        size: list[int] = []

        def size_of() -> int:  # computed once, only for a key newly sampled
            if not size:
                size.append(int(self._sizer(key, value)))
            return size[0]

        try:
            profile.observe(key, h, now, size_of)
            self._profiles[OVERALL].observe(key, h, now, size_of)
        except Exception:  # telemetry: a bad value is skipped, the sampler goes on
            log.exception("key sampler failed on a %s key", task)

    def start(self) -> KeySampler:
        self._thread = threading.Thread(target=self._run, name="key-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.drain()

    def close(self) -> None:
        """Stop the thread (idempotent); what is still queued is dropped."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
        self._queue.clear()

    def profiles(self) -> dict[str, ReuseProfile]:
        self.drain()
        return dict(self._profiles)

    def now(self) -> float:
        return self._clock()
