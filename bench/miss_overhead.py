"""What the cache itself costs on a miss: CPU, wall time and Redis commands per new input.

On a workload where every request is new (`bench.workload`'s `unique`), the cache can only
cost. This measures that cost on identical inputs, three configurations interleaved in
chunks (rotating their order) in one process, so the machine's noise falls on all alike:

- `model alone`: `canonicalize` + `predict_batch`, what a cacheless app does;
- `L1 only`: the engine with `REDIS_URL=off`;
- `L1 + L2`: the engine with its own `redis-server` on loopback TCP (as a replica sees a
  shared Redis); Redis commands per miss from `INFO commandstats`, redis-server CPU from
  `INFO cpu`.

Two input sets:

- default: a stand-in text model that answers at once, so what is timed is the engine
  alone (keys, single flight, L1, L2, codec, log and metrics listeners);
- `--real`: the real models on new images (crops of scikit-image's photos, PNG and JPEG
  bytes, from `bench.workload`) and new support messages, half each, shuffled.

    .venv/bin/python -m bench.miss_overhead [--inputs 15000] [--chunk 500]
    .venv/bin/python -m bench.miss_overhead --real [--inputs 600] [--chunk 10]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.models import format_table
from engine.inputs import CanonicalText, clean_text
from engine.models.base import Classifier, Prediction
from runtime import Runtime, build_runtime
from settings import Settings
from storage.redis.embedded import EmbeddedRedis, free_port

Job = tuple[str, Any]  # (task, raw input)


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


@dataclass
class Totals:
    cpu_s: float = 0.0
    wall_s: float = 0.0
    requests: int = 0


def stand_in_inputs(count: int) -> tuple[dict[str, Classifier], list[Job]]:
    jobs = [("text", f"message {i}: where is parcel {i * 7919}?") for i in range(count)]
    return {"text": InstantTextModel()}, jobs  # type: ignore[dict-item]


def real_inputs(count: int) -> tuple[dict[str, Classifier], list[Job]]:
    from bench.models import load_real_models, set_threads
    from bench.workload.inputs import make_images, make_messages

    set_threads(1)
    image, text = load_real_models("cpu")
    jobs: list[Job] = [("image", raw) for raw in make_images(count // 2, 11)]
    jobs += [("text", message) for message in make_messages(count - count // 2, 11)]
    random.Random(2).shuffle(jobs)
    return {"image": image, "text": text}, jobs


def redis_counts(client: redis.Redis) -> tuple[int, float]:
    """(commands processed, CPU seconds) of redis-server so far, INFO calls included."""
    commands = sum(int(v["calls"]) for v in client.info("commandstats").values())
    cpu = client.info("cpu")
    return commands, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


@contextlib.contextmanager
def engines(
    work: Path, redis_url: str, models: Mapping[str, Classifier]
) -> Iterator[tuple[Runtime, Runtime]]:
    base = Settings.from_env({}).changed(
        fairness__client_miss_rate=0.0, server__admin_token=secrets.token_urlsafe(24),
    )
    with contextlib.ExitStack() as stack:
        l1 = build_runtime(base.changed(server__data_dir=work / "l1", redis__url="off"), models=dict(models))
        stack.callback(l1.close)
        l2 = build_runtime(
            base.changed(server__data_dir=work / "l2", redis__url=redis_url), models=dict(models),
        )
        stack.callback(l2.close)
        yield l1, l2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="the real models on new images and messages")
    parser.add_argument("--inputs", type=int, help="new inputs (default 15,000; 600 with --real)")
    parser.add_argument("--chunk", type=int, help="inputs per turn (default 500; 10 with --real)")
    args = parser.parse_args()
    count = args.inputs or (600 if args.real else 15_000)
    chunk = args.chunk or (10 if args.real else 500)

    models, jobs = real_inputs(count) if args.real else stand_in_inputs(count)
    with tempfile.TemporaryDirectory(prefix="miss-overhead-") as tmp:
        work = Path(tmp)
        with (
            EmbeddedRedis(data_dir=work / "redis", maxmemory_mb=512, port=free_port(), save=False) as server,
            engines(work, server.url, models) as (l1_only, with_l2),
            contextlib.closing(redis.Redis.from_url(server.url)) as direct,
        ):

            def alone(task: str, raw: Any) -> object:
                model = models[task]
                return model.predict_batch([model.canonicalize(raw)])

            configurations: dict[str, Callable[[str, Any], object]] = {
                "model alone": alone,
                "L1 only": l1_only.engine.classify,
                "L1 + L2": with_l2.engine.classify,
            }
            for task, raw in jobs[:chunk]:  # warm-up, not counted
                alone(task, raw)
            totals = {name: Totals() for name in configurations}
            redis_commands, redis_cpu_s, info_calls = 0, 0.0, 0
            order = list(configurations)
            for start in range(chunk, len(jobs), chunk):
                batch = jobs[start : start + chunk]
                order = order[1:] + order[:1]
                for name in order:
                    call = configurations[name]
                    if name == "L1 + L2":
                        commands_before, cpu_before = redis_counts(direct)
                    cpu, wall = time.process_time(), time.perf_counter()
                    for task, raw in batch:
                        call(task, raw)
                    total = totals[name]
                    total.cpu_s += time.process_time() - cpu
                    total.wall_s += time.perf_counter() - wall
                    total.requests += len(batch)
                    if name == "L1 + L2":
                        commands_after, cpu_after = redis_counts(direct)
                        redis_commands += commands_after - commands_before
                        redis_cpu_s += cpu_after - cpu_before
                        info_calls += 2  # the two INFO calls of the "before" snapshot
            counters = with_l2.engine.counters()
    if counters.hits_l1 or counters.hits_l2 or counters.coalesced:
        raise SystemExit(f"expected misses only, got {counters}")
    base = totals["model alone"]
    rows = []
    for name, total in totals.items():
        cpu_ms = 1000 * total.cpu_s / total.requests
        wall_ms = 1000 * total.wall_s / total.requests
        base_cpu = 1000 * base.cpu_s / base.requests
        rows.append((name, f"{cpu_ms:.3f}", f"{wall_ms:.3f}", f"{cpu_ms - base_cpu:+.3f}",
                     f"{100 * (cpu_ms / base_cpu - 1):+.1f}%"))  # fmt: skip
    requests = totals["L1 + L2"].requests
    print(f"{'real models' if args.real else 'stand-in model'}: {requests:,} new inputs per configuration, "
          f"chunks of {chunk}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(
        format_table(("configuration", "CPU ms/miss", "wall ms/miss", "CPU vs alone", "CPU vs alone %"), rows)
    )
    print(f"L1 + L2: {(redis_commands - info_calls) / requests:.2f} Redis commands per miss, "
          f"{1000 * redis_cpu_s / requests:.3f} ms of redis-server CPU per miss")  # fmt: skip


if __name__ == "__main__":
    main()
