"""Fairness under a flood (issue 26): ordinary clients' latencies with and without one client
that sends new inputs as fast as it can, side by side in one run.

    python -m bench.fairness [--seconds 20] [--rounds 2]

Over real HTTP (the REST door) with the real text model: 4 ordinary clients (each its own
X-Forwarded-For address through the trusted loopback proxy) send a Zipf stream over 300
messages, one request every 0.25 s; the flooding client sends unique messages from 8
connections with no pause and ignores 429s. Three phases, each on a fresh app, in turn
`--rounds` times (their samples pooled):

- alone: the ordinary clients only (the reference);
- flood: the flood, with the default miss budget (CLIENT_MISS_RATE/BURST) and fair queueing;
- flood, no budget: CLIENT_MISS_RATE=0, fair queueing alone.

Reported per phase: ordinary miss p50/p99, hit p99, failed ordinary requests, the flooding
client's share of model inputs (misses answered), its 429s; then the ratios against
"alone" (targets: miss p99 <= 2x, hit p99 <= 1.5x, 0 failed, flood share <= fair share
+ 10 %). Last, a client that honours Retry-After: how many of its retries were accepted.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import numpy as np

from bench.workload.inputs import make_messages
from runtime import build_runtime, load_models
from settings import Settings
from storage.embedded_redis import free_port
from ui.server import serve_runtime

ORDINARY = 4
FLOOD_CONNECTIONS = 8
ORDINARY_PAUSE_S = 0.25
VOCABULARY = 300
ZIPF_S = 1.1
FLOODER = "198.51.100.66"


@dataclass
class Tally:
    miss_ms: list[float] = field(default_factory=list)
    hit_ms: list[float] = field(default_factory=list)
    failed: int = 0
    refused: int = 0
    misses: int = 0

    def add(self, other: Tally) -> None:
        self.miss_ms += other.miss_ms
        self.hit_ms += other.hit_ms
        self.failed += other.failed
        self.refused += other.refused
        self.misses += other.misses


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
        while time.monotonic() < stop:
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
        while time.monotonic() < stop:
            try:
                response = _infer(http, f"new input {uuid.uuid4().hex} where is my parcel")
            except httpx.HTTPError:
                continue
            with lock:
                if response.status_code == 429:
                    tally.refused += 1
                elif response.status_code == 200 and response.json()["parameters"]["tier"] == "miss":
                    tally.misses += 1


def _phase(settings: Settings, models: dict[str, Any], messages: list[str], seconds: float, *,
           flood: bool) -> tuple[Tally, Tally]:  # fmt: skip
    runtime = build_runtime(settings, models=models)
    server = serve_runtime(runtime, port=free_port())
    ordinary, flooder, lock = Tally(), Tally(), threading.Lock()
    stop = time.monotonic() + seconds
    threads = [threading.Thread(target=_ordinary, args=(server.url, i, messages, stop, ordinary, lock))
               for i in range(ORDINARY)]  # fmt: skip
    if flood:
        threads += [threading.Thread(target=_flood, args=(server.url, stop, flooder, lock))
                    for _ in range(FLOOD_CONNECTIONS)]  # fmt: skip
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.close()
        runtime.close()
    return ordinary, flooder


def _backing_off(settings: Settings, models: dict[str, Any], seconds: float) -> tuple[int, int, int]:
    """(refusals met, retries after waiting Retry-After, retries accepted)."""
    runtime = build_runtime(settings, models=models)
    server = serve_runtime(runtime, port=free_port())
    refusals = retries = accepted = 0
    stop = time.monotonic() + seconds
    try:
        with _client(server.url, "203.0.113.99") as http:
            waited = False
            while time.monotonic() < stop:
                response = _infer(http, f"patient {uuid.uuid4().hex} refund please")
                if waited:
                    retries += 1
                    accepted += response.status_code == 200
                waited = response.status_code == 429
                if waited:
                    refusals += 1
                    time.sleep(float(response.headers["retry-after"]))
    finally:
        server.close()
        runtime.close()
    return refusals, retries, accepted


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=2, help="the phases in turn, this many times (pooled)")
    args = parser.parse_args()
    base = replace(Settings.from_env({}), redis_url="off", shadow_sample_rate=0.0, host="127.0.0.1")
    models = {"text": load_models(base)["text"]}
    messages = make_messages(VOCABULARY)
    phases = {
        "alone": (base, False),
        "flood": (base, True),
        "flood, no budget": (replace(base, client_miss_rate=0.0), True),
    }
    # In turn, each phase on a fresh app: the machine's drift falls on every phase alike, and
    # each round replays the same streams (seeded), so its misses are the same inputs.
    results = {name: (Tally(), Tally()) for name in phases}
    for _ in range(args.rounds):
        for name, (settings, flood) in phases.items():
            settings = replace(settings, data_dir=base.data_dir / f"bench-fairness-{name.replace(', ', '-')}")
            parts = _phase(settings, models, messages, args.seconds, flood=flood)
            for total, part in zip(results[name], parts, strict=True):
                total.add(part)
    print(f"{'phase':<18} {'miss p50':>9} {'miss p99':>9} {'hit p99':>8} {'misses':>7} {'failed':>6} "
          f"{'flood share':>11} {'flood 429s':>10}")  # fmt: skip
    alone = results["alone"][0]
    for name, (ordinary, flooder) in results.items():
        total = ordinary.misses + flooder.misses
        share = flooder.misses / total if total else 0.0
        print(f"{name:<18} {_p(ordinary.miss_ms, 50):>7.1f}ms {_p(ordinary.miss_ms, 99):>7.1f}ms "
              f"{_p(ordinary.hit_ms, 99):>6.2f}ms {ordinary.misses:>7} {ordinary.failed:>6} "
              f"{share:>10.1%} {flooder.refused:>10}")  # fmt: skip
    fair = 1 / (ORDINARY + 1)
    for name in ("flood", "flood, no budget"):
        ordinary, flooder = results[name]
        total = ordinary.misses + flooder.misses
        print(f"{name}: miss p99 x{_p(ordinary.miss_ms, 99) / _p(alone.miss_ms, 99):.2f} (target <= 2), "
              f"hit p99 x{_p(ordinary.hit_ms, 99) / _p(alone.hit_ms, 99):.2f} (target <= 1.5), "
              f"failed {ordinary.failed} (target 0), flood share {flooder.misses / max(1, total):.1%} "
              f"(target <= {fair + 0.10:.0%})")  # fmt: skip
    backoff_dir = base.data_dir / "bench-fairness-backoff"
    refusals, retries, accepted = _backing_off(replace(base, data_dir=backoff_dir), models, args.seconds)
    print(f"a client honouring Retry-After: {refusals} refusals, {accepted}/{retries} retries accepted")


if __name__ == "__main__":
    main()
