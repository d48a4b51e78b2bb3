"""What the cache itself costs on a miss: engine time and Redis round trips, model excluded.

On a workload where every request is new (`bench.workload`'s `unique`), the cache can only
cost. This isolates that cost: a stand-in model that answers instantly, so everything
measured is the engine (keys, single flight, L1, L2, codec, log and metrics listeners).
Three configurations run interleaved in rounds, side by side in one process:

- `model alone`: `canonicalize` + `predict_batch`, what a cacheless app does;
- `L1 only`: the engine with `REDIS_URL=off`;
- `L1 + L2`: the engine with its own `redis-server` on loopback TCP (as a replica sees a
  shared Redis), with the number of Redis commands per miss read from `INFO commandstats`.

    .venv/bin/python -m bench.miss_overhead [--misses 3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import redis

from bench.models import format_table
from engine.inputs import CanonicalText, clean_text
from engine.models.base import Prediction
from engine.runtime import Runtime, build_runtime
from settings import Settings
from storage.embedded_redis import EmbeddedRedis, free_port


class InstantTextModel:
    """Answers at once, deterministically, so only the engine's own work is timed."""

    task = "text"
    name = "instant"
    version = "instant-v1"
    device = "cpu"
    cheap_canonicalize = True

    def canonicalize(self, raw: object) -> CanonicalText:
        return clean_text(raw, max_chars=2000)

    def predict_batch(self, inputs: Sequence[CanonicalText]) -> list[Prediction]:
        out = []
        for item in inputs:
            share = (zlib.crc32(item.text.encode()) % 1000) / 2000.0
            out.append(Prediction((("alpha", 1.0 - share), ("beta", share))))
        return out


def redis_commands(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    # INFO itself is counted too; the caller subtracts its own calls.
    return sum(int(v["calls"]) for v in stats.values())


@contextlib.contextmanager
def runtimes(work: Path, redis_url: str) -> Iterator[tuple[Runtime, Runtime]]:
    base = replace(Settings.from_env({}), admin_token=secrets.token_urlsafe(24))
    with contextlib.ExitStack() as stack:
        l1 = build_runtime(
            replace(base, data_dir=work / "l1", redis_url="off"), models={"text": InstantTextModel()}
        )
        stack.callback(l1.close)
        l2 = build_runtime(
            replace(base, data_dir=work / "l2", redis_url=redis_url), models={"text": InstantTextModel()}
        )
        stack.callback(l2.close)
        yield l1, l2


def time_per_call(call: Callable[[str], object], messages: Sequence[str]) -> float:
    started = time.perf_counter()
    for message in messages:
        call(message)
    return (time.perf_counter() - started) * 1000 / len(messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--misses", type=int, default=3000, help="new messages per configuration per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    model = InstantTextModel()
    with tempfile.TemporaryDirectory(prefix="miss-overhead-") as tmp:
        work = Path(tmp)
        embedded = EmbeddedRedis(data_dir=work / "redis", maxmemory_mb=256, port=free_port(), save=False)
        with embedded:
            direct = redis.Redis.from_url(embedded.url)
            with runtimes(work, embedded.url) as (l1_only, with_l2):
                times: dict[str, list[float]] = {"model alone": [], "L1 only": [], "L1 + L2": []}
                commands_per_miss: list[float] = []
                for round_no in range(args.rounds):
                    fresh = [
                        f"round {round_no} message {i}: where is parcel {i * 7919}?"
                        for i in range(args.misses)
                    ]
                    times["model alone"].append(
                        time_per_call(lambda m: model.predict_batch([model.canonicalize(m)]), fresh)
                    )
                    times["L1 only"].append(
                        time_per_call(lambda m: l1_only.engine.classify("text", m), fresh)
                    )
                    before = redis_commands(direct)
                    times["L1 + L2"].append(
                        time_per_call(lambda m: with_l2.engine.classify("text", m), fresh)
                    )
                    commands_per_miss.append((redis_commands(direct) - before - 1) / args.misses)
                counters = with_l2.engine.counters()
            direct.close()
    if counters.hits_l1 or counters.hits_l2:
        raise SystemExit(f"expected misses only, got {counters}")
    base = statistics.median(times["model alone"])
    rows = [
        (name, f"{statistics.median(v):.4f}", f"{min(v):.4f}", f"{statistics.median(v) - base:+.4f}")
        for name, v in times.items()
    ]
    print(f"{args.rounds} rounds x {args.misses} new messages, stand-in model, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(format_table(("configuration", "median ms/miss", "best ms/miss", "vs model alone"), rows))
    print(f"Redis commands per miss (L1 + L2): {statistics.median(commands_per_miss):.2f}")


if __name__ == "__main__":
    main()
