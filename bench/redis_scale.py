"""L2 on one Redis node against a 3-primary Redis Cluster (and a Sentinel-managed primary),
in one run, side by side.

Each system is this app's engine built by `build_runtime` with REDIS_URL pointing at it:
- single node: `redis://` to a redis-server on a loopback TCP port;
- cluster: `redis+cluster://` to 3 primaries (`redis-server --cluster-enabled yes`);
- sentinel: `redis+sentinel://` to a Sentinel naming a primary that has one replica.
They share one loaded text model, and L1 is off (CACHE_L1_MAX_BYTES=0), so every repeat
is an L2 hit. Measured:

- L2 hit latency, p50/p99, one caller (the engine's `classify`, samples interleaved
  round-robin across the systems so a neighbour's burst spreads over all of them);
- L2 hit throughput with N threads, each system in turn for the same time;
- the store alone: GET, and a write of two keys (a result and its alias) that land on
  two different primaries of the cluster (one pipeline per primary).

    .venv/bin/python -m bench.redis_scale [--quick] [--threads N]

Needs `redis-server` and `redis-cli` (the script starts and stops its own servers on
free loopback ports; it touches no other Redis).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.live_load import run_for
from bench.models import MESSAGES, fmt_ms, format_table, host_load, interleaved_samples, positive_int
from runtime import Runtime, build_runtime
from settings import Settings
from storage.redis.embedded import EmbeddedRedis, free_port
from testing.redis_servers import LocalCluster, LocalSentinel


@dataclass(frozen=True)
class Profile:
    inputs: int = 256  # distinct messages, all cached before measuring
    repeats: int = 1500  # latency samples per system
    throughput_s: float = 5.0  # per system
    store_repeats: int = 1500


FULL = Profile()
QUICK = Profile(inputs=96, repeats=300, throughput_s=2.0, store_repeats=300)


def messages(count: int) -> list[str]:
    rng = random.Random(7)
    return [f"{rng.choice(MESSAGES)} (order {i})" for i in range(count)]


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def throughput(
    runtime: Runtime, texts: Sequence[str], threads: int, seconds: float
) -> tuple[float, Counter[str]]:
    """L2 hits per second with `threads` callers, and the tiers they got."""
    stop = threading.Event()
    counts: list[Counter[str]] = [Counter() for _ in range(threads)]

    def caller(index: int) -> None:
        rng = random.Random(index)
        while not stop.is_set():
            counts[index][runtime.engine.classify("text", rng.choice(texts)).tier] += 1

    workers = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(threads)]
    started = time.perf_counter()
    run_for(workers, seconds, stop)
    elapsed = time.perf_counter() - started
    total: Counter[str] = sum(counts, Counter())
    return sum(total.values()) / elapsed, total


def cross_node_keys(runtime: Runtime) -> tuple[str, str]:
    """Two keys owned by different primaries (on one node: any two)."""
    store = runtime.engine.l2_store()
    assert store is not None
    first = "infcache:bench:w0"
    for i in range(1, 1000):
        other = f"infcache:bench:w{i}"
        if not store.is_cluster or store._shard(other) != store._shard(first):
            return first, other
    raise RuntimeError("no two keys on different primaries")


def run(profile: Profile, threads: int) -> None:
    from engine.models.text import TextClassifier

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="infcache-redis-scale-")))
        single = EmbeddedRedis(data_dir=work / "single", maxmemory_mb=256, port=free_port(), save=False)
        single.start()
        stack.callback(single.close)
        cluster = stack.enter_context(LocalCluster(maxmemory_mb=256))
        sentinel = stack.enter_context(LocalSentinel(maxmemory_mb=256))
        model = TextClassifier(device="cpu", max_text_chars=2000)
        base = Settings.from_env({}).changed(cache__l1_max_bytes=0, server__admin_token="bench-redis-scale")
        urls = {
            "single node": single.url,
            "cluster (3 primaries)": cluster.url,
            "sentinel primary": sentinel.url,
        }
        systems: dict[str, Runtime] = {}
        for i, (name, url) in enumerate(urls.items()):
            runtime = build_runtime(
                base.changed(redis__url=url, server__data_dir=work / f"app{i}"), models={"text": model}
            )
            stack.callback(runtime.close)
            systems[name] = runtime
        texts = messages(profile.inputs)
        for runtime in systems.values():
            runtime.engine.flush("all")
            for text in texts:
                runtime.engine.classify("text", text)  # the model once per input and system
        print(f"{profile} | {threads} threads | {host_load()}")
        print(f"single node {single.url} | cluster {cluster.url} | sentinel {sentinel.url}\n")

        rng = random.Random(1)
        tiers: dict[str, Counter[str]] = {name: Counter() for name in systems}

        def hit(name: str) -> Callable[[], object]:
            def call() -> None:
                tiers[name][systems[name].engine.classify("text", rng.choice(texts)).tier] += 1

            return call

        samples = interleaved_samples({n: hit(n) for n in systems}, repeats=profile.repeats, warmup=20)
        rates = {
            name: throughput(runtime, texts, threads, profile.throughput_s)
            for name, runtime in systems.items()
        }
        store_rows = store_latency(systems, profile.store_repeats)

        base_name = "single node"
        rows = []
        for name in systems:
            p50, p99 = statistics.median(samples[name]), percentile(samples[name], 0.99)
            rate, seen = rates[name]
            rows.append([
                name, fmt_ms(p50), fmt_ms(p99), f"{rate:,.0f}",
                f"{p50 / statistics.median(samples[base_name]):.2f}x", f"{rate / rates[base_name][0]:.2f}x",
                ", ".join(f"{t} {n}" for t, n in (tiers[name] + seen).most_common()),
            ])  # fmt: skip
        print(format_table(
            ["L2 hit (engine, text)", "p50 ms", "p99 ms", f"hits/s ({threads} thr)", "p50 vs single",
             "hits/s vs single", "tiers"],
            rows,
        ))  # fmt: skip
        print()
        print(format_table(["store alone, p50 ms", *systems], store_rows))
        print(f"\nat end: {host_load()}")


def store_latency(systems: dict[str, Runtime], repeats: int) -> list[list[str]]:
    fns: dict[tuple[str, str], Callable[[], object]] = {}
    for name, runtime in systems.items():
        store = runtime.engine.l2_store()
        assert store is not None
        a, b = cross_node_keys(runtime)
        store.set(a, b"x" * 600, ttl_s=600)

        def get(store: Any = store, a: str = a) -> None:
            store.get(a)

        def write_two(store: Any = store, a: str = a, b: str = b) -> None:
            store.set_many([(a, b"x" * 600, 600), (b, b"y" * 64, 600)])

        def read_after_writes(store: Any = store, a: str = a, b: str = b) -> None:
            store.get_after_writes([(b, b"y" * 64, 600)], a)

        fns[(name, "GET")] = get
        fns[(name, "SET result + alias (2 primaries on the cluster)")] = write_two
        fns[(name, "GET riding with a write to another primary")] = read_after_writes
    samples = interleaved_samples(fns, repeats=repeats, warmup=20)
    operations = list(dict.fromkeys(op for _, op in fns))
    return [[op, *(fmt_ms(statistics.median(samples[(name, op)])) for name in systems)] for op in operations]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"fewer iterations: {QUICK}")
    parser.add_argument("--threads", type=positive_int, default=8, help="callers for the throughput figure")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    run(QUICK if args.quick else FULL, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
