"""Fairness for a public demo: who a client is, a miss budget per client, fair queueing.

- **Who.** The doors (ui/, api/) name each request's client by `client_id(host)`: the
  address the request is from (engine.capacity.forwarding: the connection's, or what a proxy the
  settings trust wrote in `X-Forwarded-For`). An IPv6 client is its /64 (one host holds a
  whole /64). Requests made by the app itself (warm-up, shadow verification) have no client
  and no budget.
- **Budget.** `MissBudget.spend(client)` is asked only when a request is about to run the
  model: hits, coalesced answers and remembered rejections never reach it. One token per
  miss, `rate` a second up to `burst` (storage.redis.buckets), shared by the fleet through
  Redis; while Redis cannot answer, each replica keeps its own buckets. A miss past its
  budget is refused only when it would take the model from another client
  (engine.capacity.admission: the budget is work-conserving).
- **Queueing.** Misses that wait for a forward pass wait in a `FairQueue`: one deque per
  client, served round-robin, so one client's hundred waiting misses stand behind another
  client's one only once each turn.

Nothing here stores or logs an address: the console and the request log see `label(client)`,
the address's network prefix and a salted hash (a different salt in every process).
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from blake3 import blake3
from cachetools import LRUCache

from engine.errors import CacheUnavailableError, OverBudgetError
from storage.redis.buckets import LocalBuckets, RedisBuckets

log = logging.getLogger(__name__)

T = TypeVar("T")

# A client counts as limited for this long after its last refused miss (the metrics' gauge).
LIMITED_WINDOW_S = 10.0
# Waits by how many misses were already waiting on arrival (/metrics): 0, 1, 2-3, 4-7, ...
DEPTH_BUCKETS = (0, 1, 2, 4, 8, 16, 32)


def client_id(host: str | None) -> str:
    """The client a connection's address stands for: the address itself (IPv4, or an
    IPv4-mapped IPv6 address as IPv4), an IPv6 address's /64, or what was given when it is
    not an address at all (a unix socket, a test client)."""
    if not host:
        return "unknown"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host[:64]
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped
        if mapped is not None:
            return str(mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class ClientLabels:
    """`label(client)`: what the console and the request log show of a client, never the
    address: its network prefix (IPv4 /24, IPv6 /48) and 6 hex digits of a salted hash."""

    def __init__(self) -> None:
        self._salt = secrets.token_bytes(16)
        self._labels: LRUCache[str, str] = LRUCache(maxsize=10_000)
        self._lock = threading.Lock()

    def label(self, client: str) -> str:
        with self._lock:
            known = self._labels.get(client)
        if known is not None:
            return known
        digest = blake3(client.encode(), key=self._salt.ljust(32, b"\0")).hexdigest()[:6]
        label = f"{_prefix(client)}#{digest}"
        with self._lock:
            self._labels[client] = label
        return label


def _prefix(client: str) -> str:
    try:
        network = ipaddress.ip_network(client, strict=False)
    except ValueError:
        return "other"
    if network.version == 4:
        return ".".join(str(network.network_address).split(".")[:3]) + ".x"
    return str(ipaddress.IPv6Network((network.network_address, 48), strict=False))


class MissBudget:
    """Per-client token buckets on misses: `spend(client)` takes one or says how long until one
    is there (engine.capacity.admission decides what a miss past its budget gets)."""

    def __init__(
        self,
        *,
        rate: float,
        burst: int,
        shared: RedisBuckets | None,
        local: LocalBuckets | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a miss budget needs rate > 0 and burst >= 1 (0 turns it off: pass none)")
        self.rate = rate
        self.burst = burst
        self._shared = shared
        self._local = local or LocalBuckets(clock=clock)
        self._clock = clock
        self._limited: LRUCache[str, float] = LRUCache(maxsize=10_000)  # client -> last refusal
        self._lock = threading.Lock()
        self.local_fallbacks = 0  # takes answered by this process's buckets while Redis was away

    def spend(self, client: str) -> float:
        """Spends one token of `client`'s bucket: 0.0, or (spending nothing) the seconds until
        one is there. Whether a miss past its budget is refused is engine.capacity.admission's call."""
        key = blake3(client.encode()).hexdigest()[:32]  # the address never goes to Redis
        wait = None
        if self._shared is not None:
            try:
                wait = self._shared.take(key, self.rate, self.burst)
            except CacheUnavailableError:
                with self._lock:
                    self.local_fallbacks += 1
        if wait is None:
            wait = self._local.take(key, self.rate, self.burst)
        return wait

    def refusal(self, client: str, retry_after_s: float) -> OverBudgetError:
        """The error refusing one of `client`'s misses (noted for limited_clients)."""
        now = self._clock()
        with self._lock:
            last = self._limited.get(client)
            self._limited[client] = now
        refusal = OverBudgetError(client, retry_after_s)
        refusal.first = last is None or now - last > LIMITED_WINDOW_S  # worth a log line
        return refusal

    def limited_clients(self) -> int:
        """Clients refused a miss within the last LIMITED_WINDOW_S seconds."""
        since = self._clock() - LIMITED_WINDOW_S
        with self._lock:
            return sum(1 for at in self._limited.values() if at >= since)


class FairQueue(Generic[T]):
    """Items waiting per client, taken round-robin across clients (not thread-safe: its
    owner holds a lock)."""

    def __init__(self) -> None:
        self._by_client: OrderedDict[str, deque[T]] = OrderedDict()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, client: str, item: T) -> None:
        self._by_client.setdefault(client, deque()).append(item)
        self._count += 1

    def clients(self) -> list[str]:
        """The clients with items waiting, in the order they will be served."""
        return list(self._by_client)

    def peek(self) -> T:
        return next(iter(self._by_client.values()))[0]

    def pop(self) -> T:
        """The next item: the first waiting client's oldest; that client goes to the back."""
        client, items = next(iter(self._by_client.items()))
        item = items.popleft()
        self._count -= 1
        if items:
            self._by_client.move_to_end(client)
        else:
            del self._by_client[client]
        return item


class QueueWaits:
    """How long misses waited for a forward pass, by task and by how many were waiting when
    they arrived (DEPTH_BUCKETS): counts and seconds, for /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[tuple[str, int], list[float]] = {}

    def record(self, task: str, depth: int, seconds: float) -> None:
        bucket = max(b for b in DEPTH_BUCKETS if b <= depth)
        with self._lock:
            entry = self._waits.setdefault((task, bucket), [0, 0.0])
            entry[0] += 1
            entry[1] += seconds

    def snapshot(self) -> dict[tuple[str, int], tuple[int, float]]:
        with self._lock:
            return {k: (int(v[0]), v[1]) for k, v in self._waits.items()}


class _Waiter:
    __slots__ = ("competing", "event")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.competing: list[str] = []  # the clients waiting when it was handed the slot


class FairSlots:
    """A semaphore of `slots` forward passes whose waiters are served round-robin across
    clients: a freed slot is handed to the next waiter of the fair order."""

    def __init__(self, slots: int, *, task: str, waits: QueueWaits | None = None) -> None:
        self._free = slots
        self._task = task
        self._waits = waits
        self._lock = threading.Lock()
        self._queue: FairQueue[_Waiter] = FairQueue()

    @contextmanager
    def slot(self, client: str | None) -> Iterator[list[str]]:
        """Holds a pass slot; yields the clients that were waiting for it when this one got it
        (itself alone when none waited)."""
        waiter = None
        with self._lock:
            depth = len(self._queue)
            if self._free > 0 and depth == 0:
                self._free -= 1
            else:
                waiter = _Waiter()
                self._queue.push(client or "", waiter)
        if waiter is not None:
            started = time.perf_counter()
            waiter.event.wait()  # the slot is handed over by release()
            if self._waits is not None:
                self._waits.record(self._task, depth, time.perf_counter() - started)
        elif self._waits is not None:
            self._waits.record(self._task, 0, 0.0)
        try:
            yield waiter.competing if waiter is not None else [client or ""]
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            if len(self._queue):
                competing = self._queue.clients()
                waiter = self._queue.pop()
                waiter.competing = competing
                waiter.event.set()
            else:
                self._free += 1
