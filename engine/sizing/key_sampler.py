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
A use's footprint (`sizer`) is all it holds in the tier: the result entry and the raw-input
alias each request also reads (and writes) there, and in L2 Redis's per-key overhead.

L1 and Redis are shared by every task, so a task's hit ratio at a size depends on the other
tasks' keys too: the profile of all tasks (`OVERALL`) also keeps, per task, the distances of
that task's uses in the shared stream (`_Counts.tasks`), and a task's curves come from those.

The hook on the request path (`observe`) counts the request, compares the key's hash with the
sampling threshold and queues only a sampled use; the profiles are updated off it (`KeySampler`),
about 5 µs a sampled use in each of two profiles (three Fenwick-tree steps over packed L1/L2 byte
sums). That background work has a CPU budget (`cpu_share` of one core, `CpuBudget`): when the
key rate × the cost of a sample would exceed it, the threshold is lowered exactly as when too
many keys are tracked (spatially, never by skipping uses in time, which would lengthen reuse
distances), so the cost per request stays bounded at any rate while a demo's traffic (a few
hundred requests a second) is sampled whole.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from common.background import BackgroundThread
from engine.sizing.budget import CpuBudget

HASH_SPACE = 1 << 32
BIN_RATIO = 1.03  # distance histogram bins: ±1.5 % of a size, finer than any curve step
_LOG_RATIO = math.log(BIN_RATIO)
# Fenwick values pack a use's L2 bytes (high) and L1 bytes (low) so one tree answers both sums.
_COUNT_UNIT = 1 << 40
# What a key costs Redis beyond its key and value bytes (dict entry, objects, expiry entry,
# allocator rounding): measured with MEMORY USAGE on small entries, about 80-100 bytes.
REDIS_ENTRY_OVERHEAD = 96  # for a sizer that gives one size (key + value) only
# jemalloc's small size classes (what an allocation of n bytes really takes, up to 14 KiB).
_JEMALLOC_CLASSES = (8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768,
                     896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192,
                     10240, 12288, 14336)  # fmt: skip


def _allocated(n: int) -> int:
    for size in _JEMALLOC_CLASSES:
        if n <= size:
            return size
    return -(-n // 4096) * 4096  # large allocations: whole pages


def _sds(length: int) -> int:
    """An sds string of `length` bytes: its header by length, the terminating NUL, rounded."""
    header = 1 if length < 32 else 3 if length < 256 else 5 if length < 65536 else 9
    return _allocated(header + length + 1)


def redis_entry_bytes(key_len: int, value_len: int) -> int:
    """What a string key with a TTL costs Redis 7 (jemalloc) toward maxmemory: the key's sds,
    the value (an embedded string object up to 44 bytes, else an object and an sds), its entry
    in the keyspace and in the expires table (32 bytes each) and their buckets (8 bytes a table,
    at a load between 0.5 and 1: about 12 bytes a key each). MEMORY USAGE agrees within a few
    per cent (it leaves out the expires entry)."""
    value = _allocated(16 + 3 + value_len + 1) if value_len <= 44 else 16 + _sds(value_len)
    return _sds(key_len) + value + 2 * (32 + 12)
MIN_CAPACITY = 256  # the smallest Fenwick tree (stamps before a renumbering)
MINUTE_S = 60
HOUR_S = 3600
KEEP_MINUTES = 60  # minute buckets for the last hour, then merged into hour buckets
KEEP_HOURS = 7 * 24
log = logging.getLogger(__name__)

OVERALL = "*"  # the profile of every task's keys together (what one shared L1 sees)

# (key, value) -> a use's L1 bytes, or (L1 bytes, L2 bytes as Redis counts them toward
# maxmemory, the Redis keys those are); a bare int is taken to be one entry in both tiers (L2:
# plus REDIS_ENTRY_OVERHEAD).
Sizer = Callable[[str, Any], "int | tuple[int, int, int]"]


def footprint(size: int | tuple[int, ...]) -> tuple[int, int, int]:
    if isinstance(size, tuple):
        return int(size[0]), int(size[1]), int(size[2]) if len(size) > 2 else 1
    return int(size), int(size) + REDIS_ENTRY_OVERHEAD, 1


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
    size: int  # a use's bytes in L1 (key + encoded value, and its raw-input alias's)
    last_at: float
    hash: int
    l2_size: int  # and in L2 (with Redis's per-key overhead)
    l2_keys: int  # the Redis keys those are (the result, and its alias where aliases go to Redis)

    @property
    def packed(self) -> int:
        return self.l2_size * _COUNT_UNIT + self.size


@dataclass
class _Counts:
    """Requests and sampled reuse distances of one time bucket."""

    requests: int = 0
    weight: float = 0.0  # sampled references, each weighted 1/R
    lost: float = 0.0  # sampled references dropped on a full queue, weighted 1/R: not estimated
    served_l1: int = 0  # requests the tiers answered: from L1, from L2 (what the curves predict)
    served_l2: int = 0
    l1: dict[int, float] = field(default_factory=dict)  # distance bin -> weight of hits
    l2: dict[int, float] = field(default_factory=dict)
    # OVERALL only: each task's requests and distances in the shared stream (what the shared
    # L1 and Redis serve that task)
    tasks: dict[str, _Counts] = field(default_factory=dict)

    def merge(self, other: _Counts) -> None:
        self.requests += other.requests
        self.weight += other.weight
        self.lost += other.lost
        self.served_l1 += other.served_l1
        self.served_l2 += other.served_l2
        for mine, theirs in ((self.l1, other.l1), (self.l2, other.l2)):
            for index, w in theirs.items():
                mine[index] = mine.get(index, 0.0) + w
        for task, counts in other.tasks.items():
            self.task(task).merge(counts)

    def task(self, task: str) -> _Counts:
        counts = self.tasks.get(task)
        if counts is None:
            counts = self.tasks[task] = _Counts()
        return counts


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

    @property
    def threshold(self) -> int:
        return self._threshold

    def add_requests(
        self, count: int, now: float, lost: float = 0.0, task: str | None = None,
        served: tuple[int, int] = (0, 0),
    ) -> None:  # fmt: skip
        """`count` requests of this stream (sampled or not); `lost`: the weight of those queued
        for the sample but dropped on a full queue (it leaves the estimate, not skew it);
        `task`: whose (the profile of every task keeps each task's share too); `served`: how
        many of them L1 and L2 answered."""
        with self._lock:
            counts = self._bucket(now)
            for c in (counts,) if task is None else (counts, counts.task(task)):
                c.requests += count
                c.lost += lost
                c.served_l1 += served[0]
                c.served_l2 += served[1]

    def lower(self, threshold: int) -> None:
        """Sample under `threshold` from now on (never raised): keys above it are forgotten."""
        with self._lock:
            if threshold < self._threshold:
                self._threshold = max(1, threshold)
                self._forget_above(self._threshold)

    def observe(
        self, key: str, h: int, now: float, size_of: Callable[[], tuple[int, int]], task: str | None = None
    ) -> None:
        """`task`: whose use this is, recorded in the bucket's `tasks` too (the profile of all tasks)."""
        with self._lock:
            if h >= self._threshold:
                return
            bucket = self._bucket(now)
            weight = HASH_SPACE / self._threshold
            tracked = self._keys.get(key)
            if tracked is None:  # a first use: a miss at every size
                for counts in (bucket,) if task is None else (bucket, bucket.task(task)):
                    counts.weight += weight
                self._track(key, h, now, size_of())
                return
            tree, entry = self._tree, tracked.packed
            l2_sum, l1_sum = divmod(tree.total - tree.prefix(tracked.stamp), _COUNT_UNIT)
            gap = now - tracked.last_at
            l1 = _bin(l1_sum * weight + tracked.size) if gap <= self._ttl[0] else None
            l2 = _bin(l2_sum * weight + tracked.l2_size) if gap <= self._ttl[1] else None
            for counts in (bucket,) if task is None else (bucket, bucket.task(task)):
                counts.weight += weight
                if l1 is not None:
                    counts.l1[l1] = counts.l1.get(l1, 0.0) + weight
                if l2 is not None:
                    counts.l2[l2] = counts.l2.get(l2, 0.0) + weight
            stamp = self._stamp()  # first: a renumbering moves this key's old stamp too
            self._tree.add(tracked.stamp, -entry)
            self._tree.add(stamp, entry)
            tracked.stamp, tracked.last_at = stamp, now

    def _track(self, key: str, h: int, now: float, size: tuple[int, int, int]) -> None:
        tracked = _Tracked(self._stamp(), size[0], now, h, size[1], size[2])
        self._keys[key] = tracked
        self._tree.add(tracked.stamp, tracked.packed)
        heapq.heappush(self._heap, (-h, key))
        while len(self._keys) > self._max_keys:
            # Lower the threshold to the largest tracked hash: that key (and any equal) leaves.
            self._threshold = -self._heap[0][0]
            self._forget_above(self._threshold)

    def _forget_above(self, threshold: int) -> None:
        while self._heap and -self._heap[0][0] >= threshold:
            _, gone = heapq.heappop(self._heap)
            dropped = self._keys.pop(gone)
            self._tree.add(dropped.stamp, -dropped.packed)

    def _stamp(self) -> int:
        if self._next > self._capacity:  # renumber the live stamps 1..n, in order of last use
            ordered = sorted(self._keys.values(), key=lambda t: t.stamp)
            self._capacity = max(MIN_CAPACITY, 4 * len(ordered))
            self._tree = _Fenwick.build([t.packed for t in ordered], self._capacity)
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

    def l2_bytes_per_key(self) -> float | None:
        """The mean bytes a Redis key of the sample costs (None: none sampled): how much of a
        Redis's used memory its keys take, and so what is left to Redis itself."""
        with self._lock:
            keys = sum(t.l2_keys for t in self._keys.values())
            return sum(t.l2_size for t in self._keys.values()) / keys if keys else None


def hit_ratios(counts: _Counts, histogram: dict[int, float], sizes: Iterable[int]) -> list[float]:
    """The estimated hit ratio at each cache size (bytes), SHARDS_adj-corrected."""
    seen = counts.requests - counts.lost  # the requests the sample stands for
    if seen <= 0:
        return [0.0 for _ in sizes]
    # The requests the sample missed or over-counted are put at the smallest distance.
    shortfall = seen - counts.weight
    ordered = sorted(histogram.items())
    out = []
    for size in sizes:
        hits = sum(w for index, w in ordered if _bin_bytes(index) <= size)
        out.append(min(1.0, max(0.0, (hits + (shortfall if hits > 0 else 0.0)) / seen)))
    return out


class _TaskGate:
    """What the request path needs of a task: its request count (and of those L1 and L2
    answered) and its sampling threshold (one lookup; the threshold is replaced by the
    catch-up, read without a lock)."""

    __slots__ = ("count", "l1", "l2", "threshold")

    def __init__(self, threshold: int) -> None:
        self.count = itertools.count()  # next() is atomic under the GIL: exact, and no lock
        self.l1 = itertools.count()
        self.l2 = itertools.count()
        self.threshold = threshold


@dataclass(frozen=True)
class SamplerStats:
    """A snapshot of the sampler's own counters (the cost side of the sizing curves)."""

    rate_cap: float  # the CPU budget's sampling rate (1: every key it is offered)
    applied: int  # sampled uses applied to the profiles
    dropped: int  # sampled uses dropped on a full queue
    cpu_s: float  # CPU the profiles' updates took
    queued: int


class KeySampler:
    """The engine's key-stream hook (`observe`): a profile per task and one of all tasks.

    The request path counts the request (an atomic `itertools.count`, no lock to contend for),
    compares the key's hash with its task's threshold and queues (task, key, value, time) only
    under it: a fraction of a microsecond either way. The profiles are updated off it, by
    `start()`'s thread every `period_s` in small batches that yield between them (so a request
    never waits long for the GIL), or by whoever reads them (`profiles()` catches up first);
    each catch-up then lets `CpuBudget` lower the threshold if the updates took more than
    `cpu_share` of a core (`cpu_clock`: this thread's CPU time). A queue `max_queue` long drops
    further sampled uses, counts them and lowers the threshold. `sizer(key, value)` gives an
    entry's L1 bytes; it is called once per newly sampled key.
    """

    def __init__(
        self,
        *,
        sizer: Sizer,
        max_keys: int = 4096,
        l1_ttl_s: float = math.inf,
        l2_ttl_s: float = math.inf,
        cpu_share: float = 0.02,
        clock: Callable[[], float] = time.time,
        cpu_clock: Callable[[], float] = time.thread_time,
        max_queue: int = 16_384,
        period_s: float = 0.5,
        budget_window_s: float = 2.0,
    ) -> None:
        self._sizer = sizer
        self._options = {"max_keys": max_keys, "l1_ttl_s": l1_ttl_s, "l2_ttl_s": l2_ttl_s}
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._profiles: dict[str, ReuseProfile] = {OVERALL: ReuseProfile(**self._options)}
        self._queue: deque[tuple[str, str, Any, float]] = deque()
        self._max_queue = max_queue
        self._period_s = period_s
        self._budget = CpuBudget(cpu_share, window_s=budget_window_s, start=clock(), squeeze_gap_s=period_s,
                                 full=HASH_SPACE)  # fmt: skip
        self._tasks: dict[str, _TaskGate] = {}  # read by the request path without a lock
        self._gate = HASH_SPACE  # a task not seen yet
        # (task, counter): how often the drain read it (a read counts too), what it added to the profiles
        self._reads: dict[tuple[str, str], int] = {}
        self._counted: dict[tuple[str, str], int] = {}
        self._overflow: dict[str, float] = {}  # task -> weight of queued uses dropped, not counted
        self._overflow_lock = threading.Lock()  # taken only on a full queue
        self._drain_lock = threading.Lock()
        self._worker = BackgroundThread("key-sampler", self.drain, period_s=period_s, join_s=5, logger=log,
                                        what="key sampler drain")  # fmt: skip
        self._applied = 0
        self._cpu_s = 0.0
        self.dropped = 0

    def observe(self, task: str, key: str, value: Any, tier: str | None = None) -> None:
        """One use of cache key `key`, answered from `tier` ("l1", "l2", or another: a miss),
        on the request path: never raises."""
        entry = self._tasks.get(task)
        if entry is None:
            entry = self._tasks.setdefault(task, _TaskGate(self._gate))
        next(entry.count)
        if tier == "l1":
            next(entry.l1)
        elif tier == "l2":
            next(entry.l2)
        gate = entry.threshold
        try:
            h = int(key[-8:], 16)  # key_hash inlined: this runs on every hit
        except ValueError:
            h = key_hash(key)
        if h >= gate:
            return  # outside the sample: its only cost was the count and this compare
        if len(self._queue) >= self._max_queue:
            with self._overflow_lock:  # the thread fell far behind: rare, so a lock is fine
                # 1/R of the gate: in each profile, the expected weight of the lost use (a
                # profile sampling under a lower threshold would have kept it that much less
                # often, and weighted it that much more).
                self._overflow[task] = self._overflow.get(task, 0.0) + HASH_SPACE / gate
                self.dropped += 1
            return
        self._queue.append((task, key, value, self._clock()))

    def drain(self, batch: int = 64) -> None:
        """Apply every queued use to the profiles, `batch` at a time, yielding between batches;
        add the requests counted since, then let the CPU budget lower the rate."""
        with self._drain_lock:
            started = self._cpu_clock()
            while self._queue:
                applied = 0
                while applied < batch and self._queue:
                    use = self._queue.popleft()
                    # Queued under a threshold since lowered: skipped here, not counted in the
                    # batch, so a backlog left by an overflow clears between two yields.
                    if key_hash(use[1]) < self._gate_of(use[0]):
                        self._apply(*use)
                        applied += 1
                if self.dropped != self._budget.dropped:
                    # Overflowing: lower the rate now, not after the backlog (which the lower
                    # threshold then mostly skips at a hash compare each).
                    self._govern(self._clock())
                time.sleep(0)  # let a request thread take the GIL
            now = self._clock()
            self._count_requests(now)
            self._cpu_s += self._cpu_clock() - started
            self._govern(now)

    def _gate_of(self, task: str) -> int:
        entry = self._tasks.get(task)
        return self._gate if entry is None else entry.threshold

    def _profile(self, task: str) -> ReuseProfile:
        profile = self._profiles.get(task)
        if profile is None:
            profile = self._profiles[task] = ReuseProfile(**self._options)
            profile.lower(self._budget.threshold)
        return profile

    def _apply(self, task: str, key: str, value: Any, now: float) -> None:
        profile = self._profile(task)
        h = key_hash(key)
        size: list[tuple[int, int, int]] = []

        def size_of() -> tuple[int, int, int]:  # computed once, only for a key newly sampled
            if not size:
                size.append(footprint(self._sizer(key, value)))
            return size[0]

        self._applied += 1
        try:
            profile.observe(key, h, now, size_of)
            self._profiles[OVERALL].observe(key, h, now, size_of, task)
        except Exception:  # telemetry: a bad value is skipped, the sampler goes on
            log.exception("key sampler failed on a %s key", task)

    def _count_requests(self, now: float) -> None:
        """Requests are counted in the bucket of the catch-up that adds them (within
        `period_s` of their time): reading a count costs the request path nothing."""
        for task, entry in self._tasks.copy().items():
            counters = (("", entry.count), ("l1", entry.l1), ("l2", entry.l2))
            new, l1, l2 = (self._read((task, name), counter) for name, counter in counters)
            with self._overflow_lock:
                lost = self._overflow.pop(task, 0.0)
            if new or lost:
                self._profile(task).add_requests(new, now, lost, served=(l1, l2))
                self._profiles[OVERALL].add_requests(new, now, lost, task, served=(l1, l2))

    def _read(self, name: tuple[str, str], counter: itertools.count) -> int:
        """What `counter` counted since the last read."""
        reads = self._reads.get(name, 0)
        total = next(counter) - reads  # each earlier read of ours advanced it by one
        self._reads[name] = reads + 1
        new = total - self._counted.get(name, 0)
        self._counted[name] = total
        return new

    def _govern(self, now: float) -> None:
        before = self._budget.threshold
        current = max((e.threshold for e in self._tasks.values()), default=self._gate)
        cap = self._budget.record(now=now, cpu_s=self._cpu_s, dropped=self.dropped, current=current)
        if cap < before:
            log.info("key sampler: sampling rate lowered to %.4f to keep its CPU under %.1f %% of a core",
                     cap / HASH_SPACE, 100 * self._budget.share)  # fmt: skip
            for profile in self._profiles.values():
                profile.lower(cap)
        overall = self._profiles[OVERALL].threshold
        for task, entry in self._tasks.copy().items():
            entry.threshold = max(self._profile(task).threshold, overall)
        self._gate = cap

    def start(self) -> KeySampler:
        self._worker.start()
        return self

    def close(self) -> None:
        """Stop the thread (idempotent); what is still queued is dropped."""
        self._worker.close()
        self._queue.clear()

    def profiles(self) -> dict[str, ReuseProfile]:
        self.drain()
        return dict(self._profiles)

    def stats(self) -> SamplerStats:
        return SamplerStats(rate_cap=self._budget.threshold / HASH_SPACE, applied=self._applied,
                            dropped=self.dropped, cpu_s=self._cpu_s, queued=len(self._queue))  # fmt: skip

    def now(self) -> float:
        return self._clock()
