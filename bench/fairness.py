"""Fairness, work-conserving (issues 26, 33): a client alone on an idle server is served as fast
as the model goes, and under a flood the ordinary clients keep their latencies, side by side
in one run.

    python -m bench.fairness [--seconds 20] [--idle-seconds 10] [--rounds 2]

Over real HTTP (the REST door) with the real text model, each phase on a fresh app with the
default settings unless named, in turn `--rounds` times (samples pooled):

- idle, one client: one client alone sends new messages as fast as it can, from 1 and from 8
  connections, with the default miss budget and with none: answered/s and refusals (target:
  0 refused, throughput with the budget within noise of without);
- alone: 4 ordinary clients (each its own X-Forwarded-For address through the trusted loopback
  proxy) send a Zipf stream over 300 messages, one request every 0.25 s (the reference);
- flood: the same, plus one client sending unique messages from 8 connections with no pause,
  ignoring 429s;
- flood, no budget: CLIENT_MISS_RATE=0, round-robin queueing alone;
- flood + polite script: the flood, plus a script sending new messages from 2 connections that
  honours Retry-After (waits it, then sends the same message again): its retries accepted.

Reported per flood phase: ordinary miss p50/p99, hit p99, failed ordinary requests, the flood's
429s, and the flood's share of the inputs of contended passes (those that ran while another
client wanted the model too) against its fair share of them (each pass's inputs divided among
the clients wanting the model then; engine.capacity.admission). Targets: miss p99 <= 2x alone, hit p99
<= 1.5x, 0 failed, flood share <= fair share + 10 %.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from bench.workload.inputs import make_messages
from engine.capacity.fairness import client_id
from runtime import Runtime, build_runtime, load_models
from settings import Settings
from storage.redis.embedded import free_port
from ui.server import serve_runtime

ORDINARY = 4
FLOOD_CONNECTIONS = 8
ORDINARY_PAUSE_S = 0.25
VOCABULARY = 300
ZIPF_S = 1.1
FLOODER = "198.51.100.66"
POLITE = "198.51.100.77"
POLITE_CONNECTIONS = 2
IDLE_CONNECTIONS = (1, 8)
FLOOD_LEAD_S = 3.0  # the flood starts this long before the others (every phase waits it alike)


@dataclass
class Tally:
    miss_ms: list[float] = field(default_factory=list)
    hit_ms: list[float] = field(default_factory=list)
    failed: int = 0
    refused: int = 0
    misses: int = 0
    retries: int = 0
    retries_accepted: int = 0

    def add(self, other: Tally) -> None:
        self.miss_ms += other.miss_ms
        self.hit_ms += other.hit_ms
        self.failed += other.failed
        self.refused += other.refused
        self.misses += other.misses
        self.retries += other.retries
        self.retries_accepted += other.retries_accepted


def _infer(http: httpx.Client, text: str) -> httpx.Response:
    body = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": [text]}]}
    return http.post("/v2/models/text/infer", json=body)


def _client(url: str, address: str) -> httpx.Client:
    # Through the trusted loopback proxy (FORWARDED_ALLOW_IPS' default): the app sees `address`.
    return httpx.Client(base_url=url, timeout=60, headers={"x-forwarded-for": address})


def _ordinary(
    url: str, index: int, messages: list[str], stop: float, tally: Tally, lock: threading.Lock
) -> None:
    rng = np.random.default_rng(index)
    weights = 1.0 / np.arange(1, len(messages) + 1) ** ZIPF_S
    weights /= weights.sum()
    with _client(url, f"203.0.113.{10 + index}") as http:
        while time.time() < stop:
            text = messages[int(rng.choice(len(messages), p=weights))]
            started = time.perf_counter()
            try:
                response = _infer(http, text)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            ms = (time.perf_counter() - started) * 1000
            with lock:
                if not ok:
                    tally.failed += 1
                elif response.json()["parameters"]["tier"] == "miss":
                    tally.miss_ms.append(ms)
                    tally.misses += 1
                else:
                    tally.hit_ms.append(ms)
            time.sleep(ORDINARY_PAUSE_S)


def _flood(url: str, stop: float, tally: Tally, lock: threading.Lock) -> None:
    with _client(url, FLOODER) as http:
        while time.time() < stop:
            try:
                response = _infer(http, f"new input {uuid.uuid4().hex} where is my parcel")
            except httpx.HTTPError:
                continue
            with lock:
                if response.status_code == 429:
                    tally.refused += 1
                elif response.status_code == 200 and response.json()["parameters"]["tier"] == "miss":
                    tally.misses += 1


def _lowest_priority() -> None:
    """The flood's own client work yields the CPUs to the server's (on another machine it
    would not compete at all); the server's work for the flood is not lowered."""
    os.nice(19)


def _flood_all(url: str, stop: float) -> tuple[int, int]:
    """FLOOD_CONNECTIONS flooding threads until `stop` (wall clock): (refused, answered misses)."""
    tally, lock = Tally(), threading.Lock()
    run_threads([threading.Thread(target=_flood, args=(url, stop, tally, lock))
                 for _ in range(FLOOD_CONNECTIONS)])  # fmt: skip
    return tally.refused, tally.misses


def _polite(url: str, stop: float, tally: Tally, lock: threading.Lock) -> None:
    """A script that honours Retry-After: on a 429 it waits, then sends the same message again."""
    with _client(url, POLITE) as http:
        text = f"polite {uuid.uuid4().hex} refund please"
        retrying = False
        while time.time() < stop:
            try:
                response = _infer(http, text)
            except httpx.HTTPError:
                continue
            with lock:
                tally.retries += retrying
                tally.retries_accepted += retrying and response.status_code == 200
                tally.refused += response.status_code == 429
                tally.misses += response.status_code == 200
            retrying = response.status_code == 429
            if retrying:
                time.sleep(float(response.headers["retry-after"]))
            else:
                text = f"polite {uuid.uuid4().hex} refund please"


@dataclass
class FloodPhase:
    ordinary: Tally = field(default_factory=Tally)
    flooder: Tally = field(default_factory=Tally)
    polite: Tally = field(default_factory=Tally)
    share: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # flood inputs, fair, total

    def add(self, other: FloodPhase) -> None:
        self.ordinary.add(other.ordinary)
        self.flooder.add(other.flooder)
        self.polite.add(other.polite)
        self.share = [a + b for a, b in zip(self.share, other.share, strict=True)]


def _phase(settings: Settings, models: dict[str, Any], messages: list[str], seconds: float, *,
           flood_pool: Executor, flood: bool, polite: bool = False) -> FloodPhase:  # fmt: skip
    result, lock = FloodPhase(), threading.Lock()
    with _served(settings, models) as (url, runtime):
        stop = time.time() + FLOOD_LEAD_S + seconds
        threads = [threading.Thread(target=_ordinary, args=(url, i, messages, stop, result.ordinary, lock))
                   for i in range(ORDINARY)]  # fmt: skip
        # The flood runs in a process of its own, as it would on another machine: its client work
        # must not hold this process's GIL (the server's and the ordinary clients'). It is already
        # going when the others come, as a flood is (its burst spent, the steady state measured).
        flooding = flood_pool.submit(_flood_all, url, stop) if flood else None
        time.sleep(FLOOD_LEAD_S)
        if polite:
            threads += [threading.Thread(target=_polite, args=(url, stop, result.polite, lock))
                        for _ in range(POLITE_CONNECTIONS)]  # fmt: skip
        run_threads(threads)
        if flooding is not None:
            result.flooder.refused, result.flooder.misses = flooding.result()
        share = runtime.engine.contended_share(client_id(FLOODER))
        result.share = [float(share.inputs), share.fair, float(share.total)]
    return result


@contextmanager
def _served(settings: Settings, models: dict[str, Any]) -> Iterator[tuple[str, Runtime]]:
    runtime = build_runtime(settings, models=models)
    try:
        server = serve_runtime(runtime, port=free_port())
        try:
            yield server.url, runtime
        finally:
            server.close()
    finally:
        runtime.close()


def run_threads(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _idle(settings: Settings, models: dict[str, Any], seconds: float, connections: int) -> tuple[int, int]:
    """One client alone, new messages as fast as it can from `connections`: (answered, refused)."""
    counts, lock = Counter[str](), threading.Lock()
    with _served(settings, models) as (url, _runtime):
        stop = time.time() + seconds

        def send() -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                while time.time() < stop:
                    response = _infer(http, f"script {uuid.uuid4().hex} where is my order")
                    with lock:
                        counts[str(response.status_code)] += 1

        run_threads([threading.Thread(target=send) for _ in range(connections)])
    return counts["200"], counts["429"]


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _measure(args: argparse.Namespace, base: Settings, no_budget: Settings, models: dict[str, Any],
             messages: list[str], idle: dict[tuple[str, int], list[int]], results: dict[str, FloodPhase],
             phases: dict[str, tuple[Settings, bool, bool]], flood_pool: Executor) -> None:  # fmt: skip
    flood_pool.submit(time.time).result()  # started before any phase's clock runs
    # In turn, each phase on a fresh app: the machine's drift falls on every phase alike, and
    # each round replays the same streams (seeded), so its misses are the same inputs.
    for _ in range(args.rounds):
        for (budget, connections), total in idle.items():
            settings = base if budget == "default budget" else no_budget
            settings = settings.changed(server__data_dir=base.server.data_dir / "bench-fairness-idle")
            answered, refused = _idle(settings, models, args.idle_seconds, connections)
            total[0] += answered
            total[1] += refused
        for name, (settings, flood, polite) in phases.items():
            folder = "bench-fairness-" + "".join(c if c.isalnum() else "-" for c in name)
            settings = settings.changed(server__data_dir=base.server.data_dir / folder)
            results[name].add(_phase(settings, models, messages, args.seconds, flood_pool=flood_pool,
                                     flood=flood, polite=polite))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per flood phase")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="per idle-server phase")
    parser.add_argument("--rounds", type=int, default=2, help="the phases in turn, this many times (pooled)")
    args = parser.parse_args()
    base = Settings.from_env({}).changed(
        redis__url="off", quality__shadow_sample_rate=0.0, server__host="127.0.0.1",
    )
    models = {"text": load_models(base)["text"]}
    messages = make_messages(VOCABULARY)
    no_budget = base.changed(fairness__client_miss_rate=0.0)
    idle = {(budget, n): [0, 0] for budget in ("default budget", "no budget") for n in IDLE_CONNECTIONS}
    phases = {"alone": (base, False, False), "flood": (base, True, False),
              "flood, no budget": (no_budget, True, False), "flood + polite script": (base, True, True)}
    results = {name: FloodPhase() for name in phases}
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn, initializer=_lowest_priority) as flood_pool:
        _measure(args, base, no_budget, models, messages, idle, results, phases, flood_pool)
    seconds = args.idle_seconds * args.rounds
    print("idle server, one client sending new messages as fast as it can:")
    for connections in IDLE_CONNECTIONS:
        with_budget, without = idle[("default budget", connections)], idle[("no budget", connections)]
        print(f"  {connections} connection(s): {with_budget[0] / seconds:.1f}/s answered with the default "
              f"budget ({with_budget[1]} refused, target 0), {without[0] / seconds:.1f}/s without "
              f"(x{with_budget[0] / max(1, without[0]):.2f})")  # fmt: skip
    print(f"{'phase':<18} {'miss p50':>9} {'miss p99':>9} {'hit p99':>8} {'misses':>7} {'failed':>6} "
          f"{'flood 429s':>10} {'flood share':>11} {'fair share':>10}")  # fmt: skip
    alone = results["alone"].ordinary
    for name, phase in results.items():
        ordinary, (inputs, fair, total) = phase.ordinary, phase.share
        print(f"{name:<18} {_p(ordinary.miss_ms, 50):>7.1f}ms {_p(ordinary.miss_ms, 99):>7.1f}ms "
              f"{_p(ordinary.hit_ms, 99):>6.2f}ms {ordinary.misses:>7} {ordinary.failed:>6} "
              f"{phase.flooder.refused:>10} {inputs / max(1.0, total):>10.1%} "
              f"{fair / max(1.0, total):>9.1%}")  # fmt: skip
    for name in ("flood", "flood, no budget"):
        phase = results[name]
        ordinary, (inputs, fair, total) = phase.ordinary, phase.share
        print(f"{name}: miss p99 x{_p(ordinary.miss_ms, 99) / _p(alone.miss_ms, 99):.2f} (target <= 2), "
              f"hit p99 x{_p(ordinary.hit_ms, 99) / _p(alone.hit_ms, 99):.2f} (target <= 1.5), "
              f"failed {ordinary.failed} (target 0), flood share of contended passes "
              f"{inputs / max(1.0, total):.1%} (target <= {fair / max(1.0, total) + 0.10:.1%}), "
              f"flood answered {phase.flooder.misses}")  # fmt: skip
    polite = results["flood + polite script"].polite
    print(f"flood + polite script: a script honouring Retry-After beside the flood: {polite.misses} "
          f"answered, {polite.refused} refusals, {polite.retries_accepted}/{polite.retries} retries "
          "accepted")  # fmt: skip


if __name__ == "__main__":
    main()
