"""What the sizing sampler costs a cache hit: CPU per in-process L1 hit with it off and on.

Two runtimes built as `app.py` builds them (`REDIS_URL=off`, the stand-in text model of
`bench.miss_overhead` that answers at once, so a hit is the engine's work alone): one with
`SIZING_MAX_KEYS=0` (no sampler), one with the default sampler and its CPU budget
(`SIZING_CPU_SHARE`). Client threads hammer inputs already cached, in turns of `--turn`
seconds that alternate off and on (the order reversed each round), each runtime alone in the
process as a replica is. CPU per hit: the client threads' own CPU time (`thread_time`: the
whole hit path runs in them) over their requests, plus, for `on`, the sampler's CPU over its
turns (its `stats().cpu_s`, its queue caught up before a turn ends); the figures are medians
of the turns and of each round's on/off ratio, so another process's burst spoils a turn, not
the figure. The request log's writer thread is left out (the same rows in both, flushed
between turns). Scenarios, each on fresh runtimes, after a warm-up of each alone that
lets the budget settle at full load: (a) few distinct keys, (b) many (more than
`SIZING_MAX_KEYS`); then (c) a paced few hundred requests a second: the sampling rate stays 1;
(d) the hook's own cost on the request path, in a tight loop.

    .venv/bin/python -m bench.sizing_cost [--threads 4] [--rounds 16] [--turn 0.5] [--warmup 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bench.live_load import run_for
from bench.miss_overhead import InstantTextModel
from bench.models import format_table
from engine.sizing.key_sampler import KeySampler
from runtime import Runtime, build_runtime
from settings import Settings


@contextlib.contextmanager
def runtimes(work: Path, *, cpu_share: float) -> Iterator[tuple[Runtime, Runtime]]:
    base = Settings.from_env({}).changed(
        server__admin_token=secrets.token_urlsafe(24), redis__url="off", quality__shadow_sample_rate=0.0,
        console__sizing_cpu_share=cpu_share,
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        off = build_runtime(base.changed(server__data_dir=work / "off", console__sizing_max_keys=0),
                            models={"text": InstantTextModel()})  # type: ignore[dict-item]  # fmt: skip
        stack.callback(off.close)
        on = build_runtime(base.changed(server__data_dir=work / "on"),
                           models={"text": InstantTextModel()})  # type: ignore[dict-item]  # fmt: skip
        stack.callback(on.close)
        yield off, on


def sampler_of(runtime: Runtime) -> KeySampler:
    sampler = runtime.insights.sampler if runtime.insights is not None else None
    assert sampler is not None, "the 'on' runtime has no sampler"
    return sampler


def hammer(
    targets: list[tuple[Runtime, int]], inputs: list[str], seconds: float
) -> list[tuple[int, float]]:
    """For each (runtime, threads): that many clients calling classify on random cached inputs
    for `seconds`, all at once. Per target: (requests, CPU seconds of its client threads)."""
    stop = threading.Event()
    done: list[list[tuple[int, float]]] = [[] for _ in targets]

    def client(target: int, runtime: Runtime, seed: int) -> None:
        rng = random.Random(seed)
        classify, n, cpu = runtime.engine.classify, 0, time.thread_time()
        while not stop.is_set():
            for _ in range(100):
                result = classify("text", inputs[rng.randrange(len(inputs))])
                n += 1
            assert result.tier == "l1", result.tier
        done[target].append((n, time.thread_time() - cpu))

    workers = [threading.Thread(target=client, args=(t, runtime, 100 * t + i))
               for t, (runtime, threads) in enumerate(targets) for i in range(threads)]  # fmt: skip
    run_for(workers, seconds, stop)
    return [(sum(n for n, _ in rows), sum(c for _, c in rows)) for rows in done]


def scenario(name: str, distinct: int, args: argparse.Namespace) -> list[str]:
    inputs = [f"message {i}: where is parcel {i * 7919}?" for i in range(distinct)]
    with tempfile.TemporaryDirectory(prefix="sizing-cost-") as tmp, \
            runtimes(Path(tmp), cpu_share=args.cpu_share) as (off, on):  # fmt: skip
        sampler = sampler_of(on)
        for runtime in (off, on):
            for raw in inputs:  # every input cached (misses, not measured)
                runtime.engine.classify("text", raw)
            hammer([(runtime, args.threads)], inputs, args.warmup)  # on's budget settles at full load
            runtime.log_writer.flush()
        sampler.drain()
        per_hit: dict[str, list[float]] = {"off": [], "on": []}  # µs of CPU per hit, per turn
        requests_on, wall_on, sampler_cpu = 0, 0.0, 0.0
        order = [("off", off), ("on", on)]
        for _ in range(args.rounds):
            order.reverse()
            for label, runtime in order:
                before, started = sampler.stats().cpu_s, time.perf_counter()
                [(requests, cpu)] = hammer([(runtime, args.threads)], inputs, args.turn)
                if label == "on":
                    sampler.drain()  # what the turn queued is its cost too
                    wall_on += time.perf_counter() - started
                    cpu += sampler.stats().cpu_s - before
                    sampler_cpu += sampler.stats().cpu_s - before
                    requests_on += requests
                per_hit[label].append(1e6 * cpu / requests)
                runtime.log_writer.flush()  # its rows written before the next turn
        stats = sampler.stats()
    ratio = statistics.median(b / a for a, b in zip(per_hit["off"], per_hit["on"], strict=True))
    off_us, on_us = statistics.median(per_hit["off"]), statistics.median(per_hit["on"])
    return [name, f"{distinct:,}", f"{requests_on / wall_on:,.0f}", f"{off_us:.2f}", f"{on_us:.2f}",
            f"{100 * (ratio - 1):+.1f}%", f"{100 * sampler_cpu / wall_on:.2f}%", f"{stats.rate_cap:.4f}",
            f"{stats.dropped}"]  # fmt: skip


def paced(args: argparse.Namespace, per_second: int = 300, seconds: float = 6.0) -> str:
    """One client at `per_second` requests a second over 500 keys: the sampling rate after."""
    inputs = [f"message {i}: where is parcel {i * 7919}?" for i in range(500)]
    with tempfile.TemporaryDirectory(prefix="sizing-cost-") as tmp, \
            runtimes(Path(tmp), cpu_share=args.cpu_share) as (_off, on):  # fmt: skip
        sampler = sampler_of(on)
        rng = random.Random(3)
        started = time.perf_counter()
        for n in range(int(per_second * seconds)):
            on.engine.classify("text", inputs[rng.randrange(len(inputs))])
            delay = started + (n + 1) / per_second - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        profile = sampler.profiles()["text"]
        stats = sampler.stats()
    return (f"(c) paced {per_second} requests/s for {seconds:g} s over 500 keys: sampling rate "
            f"{profile.rate:g} (cap {stats.rate_cap:g}), {stats.applied} uses sampled, "
            f"{stats.dropped} dropped")  # fmt: skip


def request_path(count: int = 200_000) -> str:
    """The hook's own cost in a tight loop (no other thread, so little noise): keys outside the
    sample (a sampler whose 16-key bound put its rate near 0), against a no-op call."""
    keys = [f"infcache:text:v1:0:b3{random.Random(i).getrandbits(128):032x}" for i in range(20_000)]
    sampler = KeySampler(sizer=lambda _key, _value: 100, max_keys=16)
    for key in keys:
        sampler.observe("text", key, None)
    sampler.drain()

    def noop(task: str, key: str, value: object) -> None:
        return None

    best: dict[str, float] = {}
    for _ in range(5):  # interleaved; the fastest of five: the cost without another job's noise
        for label, call in (("no-op", noop), ("observe", sampler.observe)):
            started = time.thread_time()
            for i in range(count):
                call("text", keys[i % 20_000], None)
            best[label] = min(best.get(label, 1.0), (time.thread_time() - started) / count * 1e6)
    return (f"(d) the request path alone: observe() {best['observe']:.2f} µs a call outside the sample "
            f"(rate {sampler.profiles()['text'].rate:.4f}), a no-op hook {best['no-op']:.2f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4, help="client threads (default 4)")
    parser.add_argument("--rounds", type=int, default=16, help="off/on turns each (default 16)")
    parser.add_argument("--turn", type=float, default=0.5, help="seconds a turn (default 0.5)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before (default 5)")
    parser.add_argument("--few", type=int, default=64, help="distinct keys of (a) (default 64)")
    parser.add_argument("--many", type=int, default=20_000, help="distinct keys of (b) (default 20,000)")
    parser.add_argument("--cpu-share", type=float, default=Settings.from_env({}).console.sizing_cpu_share,
                        help="SIZING_CPU_SHARE (default %(default)s)")  # fmt: skip
    args = parser.parse_args()
    rows = [scenario("(a) few keys", args.few, args), scenario("(b) many keys", args.many, args)]
    print(f"L1 hits, {args.threads} client threads, {args.rounds} × {args.turn:g} s turns each after "
          f"{args.warmup:g} s of warm-up, "
          f"SIZING_CPU_SHARE={args.cpu_share:g}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    print(format_table(("scenario", "keys", "hits/s (on)", "CPU µs/hit off", "CPU µs/hit on",
                        "on vs off (median)", "sampler CPU", "rate R", "dropped"), rows))  # fmt: skip
    print(paced(args))
    print(request_path())


if __name__ == "__main__":
    main()
