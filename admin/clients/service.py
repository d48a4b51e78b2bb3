"""Who uses the app: per-client activity for the console's "Busiest clients" table, and the
fairness figures of /metrics (engine.capacity.fairness).

A client is known here only by its label (engine.capacity.fairness.ClientLabels: a network prefix and
a salted hash), never by its address. Activity is this replica's, counted per minute for the
last `keep_s` seconds, for at most `max_clients` clients (the least recent go first).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.capacity.forwarding import Forwarding
from engine.pipeline.service import InferenceEngine, RequestRecord

KEEP_S = 7 * 86400.0  # the console's longest window
MAX_CLIENTS = 10_000
_MISS, _HIT, _REFUSED = 0, 1, 2


@dataclass(frozen=True)
class ClientRow:
    client: str  # the label, never the address
    misses: int
    hits: int
    refused: int


class ClientActivity:
    """The engine listener (`observe`) behind the Busiest clients table and the refusal
    counters. Thread-safe."""

    def __init__(
        self,
        forwarding: Forwarding | None = None,
        *,
        clock: Callable[[], float] = time.time,
        keep_s: float = KEEP_S,
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        self.forwarding = forwarding  # its untrusted proxies are shown above the table
        self._clock = clock
        self._keep_s = keep_s
        self._lock = threading.Lock()
        # label -> minute -> [misses, hits, refused]
        # Least recently seen first (an OrderedDict: cachetools' LRUCache costs a hit ~2 us more).
        self._clients: OrderedDict[str, dict[int, list[int]]] = OrderedDict()
        self._max_clients = max_clients
        self._refused: dict[tuple[str, str], int] = {}  # (task, route) -> refused misses

    def observe(self, record: RequestRecord) -> None:
        if record.status == "refused":
            kind = _REFUSED
        elif record.status != "ok":
            return
        else:
            kind = _MISS if record.tier == "miss" else _HIT
        minute = int(record.at // 60)
        with self._lock:
            if kind == _REFUSED:
                key = (record.task, record.route)
                self._refused[key] = self._refused.get(key, 0) + 1
            if record.client is None:
                return
            clients = self._clients
            minutes = clients.get(record.client)
            if minutes is None:
                minutes = clients[record.client] = {}
                if len(clients) > self._max_clients:
                    clients.popitem(last=False)
            else:
                clients.move_to_end(record.client)
            counts = minutes.get(minute)
            if counts is None:
                oldest = minute - int(self._keep_s // 60)
                for old in [m for m in minutes if m < oldest]:
                    del minutes[old]
                counts = minutes[minute] = [0, 0, 0]
            counts[kind] += 1

    def busiest(self, window_s: float, *, limit: int = 10) -> list[ClientRow]:
        """The clients with the most misses and refusals in the last `window_s` seconds."""
        since = int((self._clock() - window_s) // 60)
        rows = []
        with self._lock:
            for client, minutes in self._clients.items():
                totals = [0, 0, 0]
                for minute, counts in minutes.items():
                    if minute >= since:
                        for i in range(3):
                            totals[i] += counts[i]
                if any(totals):
                    rows.append(ClientRow(client, *totals))
        rows.sort(key=lambda r: (r.misses + r.refused, r.hits), reverse=True)
        return rows[:limit]

    def refused(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._refused)


class FairnessCollector(Collector):
    """/metrics: refused misses by task and route, clients limited now, and how long misses
    waited for a forward pass by how many were waiting when they arrived."""

    def __init__(self, engine: InferenceEngine, activity: ClientActivity) -> None:
        self._engine = engine
        self._activity = activity

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        refused = CounterMetricFamily("infcache_refused_misses", "Misses refused: the client's miss budget "
                                      "was spent (429 / Gradio error)", labels=["task", "route"])  # fmt: skip
        for (task, route), count in sorted(self._activity.refused().items()):
            refused.add_metric([task, route], count)
        yield refused
        state = self._engine.fairness_state()
        yield GaugeMetricFamily("infcache_clients_limited", "Clients refused a miss in the last 10 s",
                                value=state["limited_clients"])  # fmt: skip
        budget = state["miss_budget"]
        yield CounterMetricFamily("infcache_miss_budget_local_fallbacks", "Miss-budget checks answered by "
                                  "this replica's own buckets (Redis away)",
                                  value=budget["local_fallbacks"] if budget else 0)  # fmt: skip
        waits = CounterMetricFamily("infcache_miss_queue_waits", "Misses that waited for a forward pass, by "
                                    "misses already waiting on arrival (at least)",
                                    labels=["task", "waiting"])  # fmt: skip
        seconds = CounterMetricFamily("infcache_miss_queue_wait_seconds", "Seconds misses waited for a "
                                      "forward pass, by misses already waiting on arrival (at least)",
                                      labels=["task", "waiting"])  # fmt: skip
        snapshot = state["queue_waits"]
        for (task, depth), (count, total_s) in sorted(snapshot.items()):
            waits.add_metric([task, str(depth)], count)
            seconds.add_metric([task, str(depth)], total_s)
        yield waits
        yield seconds
        admissions = CounterMetricFamily("infcache_miss_admissions", "Misses by admission decision "
                                         "(engine.capacity.admission): budget (within it), idle (past it, "
                                         "nobody else waiting), one_per_turn (past it, its only waiting miss)"
                                         ", refused", labels=["task", "decision"])  # fmt: skip
        for (task, decision), count in sorted(state["admissions"].items()):
            admissions.add_metric([task, decision], count)
        yield admissions
