"""What collecting hard examples (engine.quality.hard_examples) costs a miss, side by side in one run.

Two engines in this process share the built-in models and one private redis-server: one
collects (HARD_EXAMPLES_SIZE=1000), one does not. Every request is a new input (bench.workload's
images and messages), so every one is a whole miss. Worst case: `--max-score 1.0` makes every
answer a hard one (the default of the app is 0.5, then only the unsure are). The two engines
answer the same inputs in interleaved chunks, the order rotating; the collecting one flushes
at the end of each of its chunks, inside its timed span, so all its background work (PNG,
Redis write) is counted on its side. CPU is this process's (every thread) per miss; Redis's
own CPU is another process's and not counted.

    .venv/bin/python -m bench.hard_examples [--inputs 120] [--chunk 10] [--max-score 1.0] [--burst-s 0]

The app starts with 1 s of CPU credit (the first few dozen images are stored at once, a
one-off); the bench starts with none by default, so it measures the steady state.

Prints per task the CPU per miss without collection (twice: "off again" is the same engine
again, its ratio to "off" shows the noise of a side-by-side run on this machine), with it, the
ratios, and the collection's own CPU (its flushes, measured in their thread) per miss: the
budget is 2 %. Then note()'s cost per answer on the request path.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.models import format_table
from engine.quality.hard_examples import HardExamples
from runtime import Runtime, build_runtime, load_models
from settings import Settings
from storage.redis.embedded import EmbeddedRedis, free_port
from storage.redis.hard_examples import HardExampleStore

SIZE = 1000


def collecting(runtime: Runtime, *, max_score: float, share: float, burst_s: float) -> HardExamples:
    """Wired as runtime._hard_examples does, but flushed by the bench (not every 5 s)."""
    store = runtime.engine.l2_store()
    assert store is not None
    collector = HardExamples(HardExampleStore(store, prefix=runtime.settings.cache.prefix), size=SIZE,
                             ttl_s=600, max_score=max_score, min_margin=0.1,
                             models=lambda: runtime.engine.models, cpu_share=share,
                             initial_credit_s=burst_s)  # fmt: skip
    runtime.engine.add_answer_hook(collector.note)
    return collector


def timed(runtime: Runtime, task: str, inputs: Sequence[Any], collector: HardExamples | None) -> float:
    started = time.process_time()
    for raw in inputs:
        if runtime.engine.classify(task, raw).tier != "miss":
            raise SystemExit("expected a miss: the inputs must be new")
    if collector is not None:
        collector.flush()
    return time.process_time() - started


def side_by_side(engines: dict[str, tuple[Runtime, HardExamples | None]], task: str, jobs: Sequence[Any],
                 chunk: int) -> dict[str, float]:  # fmt: skip
    """CPU seconds per engine over the same number of new inputs, in rotating chunks."""
    cpu = dict.fromkeys(engines, 0.0)
    names = list(engines)
    for start in range(0, len(jobs), chunk * len(names)):
        names = names[1:] + names[:1]
        for index, name in enumerate(names):
            part = jobs[start + index * chunk : start + (index + 1) * chunk]
            runtime, collector = engines[name]
            cpu[name] += timed(runtime, task, part, collector)
    return cpu


def note_cost_us(collector: HardExamples, result: Any, calls: int = 200_000) -> float:
    """note()'s cost on the request path for one answer that is not kept (µs)."""
    started = time.process_time()
    for _ in range(calls):
        collector.note("text", result, "a message")
    return 1e6 * (time.process_time() - started) / calls


def main(argv: Sequence[str] | None = None) -> None:
    from bench.workload.inputs import make_images, make_messages

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=120, help="new inputs per task and engine")
    parser.add_argument("--chunk", type=int, default=10, help="inputs per turn (default 10)")
    parser.add_argument("--max-score", type=float, default=1.0,
                        help="HARD_EXAMPLE_MAX_SCORE (default 1.0: every answer is hard, the worst case)")
    parser.add_argument("--cpu-share", type=float, default=0.01, help="HARD_EXAMPLES_CPU_SHARE")
    parser.add_argument("--burst-s", type=float, default=0.0,
                        help="CPU credit at start (the app's is 1 s, a one-off; 0: the steady state)")
    parser.add_argument("--backend", default="auto", help="INFERENCE_BACKEND (default auto)")
    args = parser.parse_args(argv)
    engines = ("off", "off again", "on")  # "off again": the same as "off", to show the noise
    count = len(engines) * args.inputs + args.chunk
    inputs = {"image": make_images(count, 31, workers=1), "text": make_messages(count, 31)}
    rows, summary = [], []
    with tempfile.TemporaryDirectory(prefix="hard-examples-bench-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        redis = EmbeddedRedis(data_dir=work / "redis", maxmemory_mb=512, port=free_port(), save=False)
        url = redis.start()
        stack.callback(redis.close)
        base = Settings.from_env({}).changed(
            server__admin_token=secrets.token_urlsafe(24), redis__url=url, quality__shadow_sample_rate=0.0,
            models__inference_backend=args.backend, models__device="cpu",
            models__onnx_export_dir=Path(os.environ.get("ONNX_EXPORT_DIR", "data/onnx")),
        )  # fmt: skip
        models = load_models(base)
        built: dict[str, tuple[Runtime, HardExamples | None]] = {}
        for index, name in enumerate(engines):
            runtime = build_runtime(
                base.changed(server__data_dir=work / f"e{index}", cache__prefix=f"e{index}"), models=models,
            )  # fmt: skip
            stack.callback(runtime.close)
            collector = None
            if name == "on":
                collector = collecting(runtime, max_score=args.max_score, share=args.cpu_share,
                                       burst_s=args.burst_s)  # fmt: skip
                stack.callback(collector.close)
            built[name] = (runtime, collector)
        on = built["on"][1]
        assert on is not None
        for task in ("image", "text"):
            jobs = inputs[task]
            for runtime, collector in built.values():  # warm-up, not counted (each its own cache)
                timed(runtime, task, jobs[: args.chunk], collector)
            before = on.counters()
            cpu = side_by_side(built, task, jobs[args.chunk :], args.chunk)
            after = on.counters()
            per = {name: 1000 * seconds / args.inputs for name, seconds in cpu.items()}
            flush_ms = 1000 * (after["flush_cpu_s"] - before["flush_cpu_s"]) / args.inputs
            own = flush_ms / per["off"]
            rows.append((task, args.inputs, after["candidates"] - before["candidates"],
                         after["kept"] - before["kept"], f"{per['off']:.2f}", f"{per['off again']:.2f}",
                         f"{per['on']:.2f}", f"{per['off again'] / per['off']:.3f}",
                         f"{per['on'] / per['off']:.3f}", f"{flush_ms:.3f}",
                         f"{100 * own:.2f}%"))  # fmt: skip
            summary.append(f"hard_examples_cpu_{task}={100 * own:.2f}%")
            summary.append(f"side_by_side_on_off_{task}={per['on'] / per['off']:.3f}")
        hit = SimpleNamespace(tier="l1", key="e2:text:v:0:b3" + "0" * 32, prediction=None, model_ms=None)
        note_us = note_cost_us(on, hit)
    print(f"{args.inputs} new inputs per task and engine, chunks of {args.chunk}, max score "
          f"{args.max_score}, CPU share {args.cpu_share}, burst {args.burst_s} s, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")
    headers = ("task", "misses", "hard", "stored", "CPU ms/miss off", "off again", "on", "off again/off",
               "on/off", "collection CPU ms/miss", "collection / miss")  # fmt: skip
    print(format_table(headers, [tuple(str(c) for c in row) for row in rows]))
    print(f"note() on the request path, an answer not kept: {note_us:.2f} µs")
    print("SUMMARY " + " ".join(summary) + f" note_us={note_us:.2f}")


if __name__ == "__main__":
    main()
