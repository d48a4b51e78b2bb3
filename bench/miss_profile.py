"""Where a whole cache miss goes, stage by stage, torch against onnxruntime (issue 25, item 4).

One engine per backend in this process, each with its own private Redis (a real L2 write on
every miss), answering the same new inputs one at a time through `InferenceEngine.classify`.
Each stage is timed where it runs, by wrapping the functions the engine calls (this script's
instances only; nothing in the app is changed):

    key digests     raw_digest (the uploaded bytes) + digest_parts (the canonical input)
    decode          canonicalize: image bytes -> RGB pixels (EXIF, mode, size checks) / text cleaning
    preprocess      image: resize, crop, normalise to the input tensor; text: tokenize (and pool)
    forward pass    the model itself (torch or the ONNX Runtime session)
    top-k           the rest of predict_batch: softmax / centroid scores, top classes
    engine          what is left of the miss: lookups, single flight, the answer's encoding,
                    the L1 write, the request log, the L2 write's hand-off

    .venv/bin/python -m bench.miss_profile [--inputs 60]
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import engine.pipeline.service
from bench.miss_cost import BACKENDS, load
from bench.models import format_table
from bench.workload.processes import fresh_redis
from runtime import Runtime, build_runtime
from settings import Settings

STAGES = ("key digests", "decode", "preprocess", "forward pass", "top-k", "engine")


class StageClock:
    """Wall and process CPU time per stage, summed over every call of the functions it wraps.
    Process CPU counts every thread's: a stage that runs on a pool (torch's intra-op threads)
    costs more CPU than wall time; what no stage holds (background writers) is the engine's."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.cpu_ms: dict[str, float] = defaultdict(float)

    def timed(self, stage: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.ms[stage] += 1000 * (time.perf_counter() - started)
                self.cpu_ms[stage] += 1000 * (time.process_time() - cpu)

        return wrapper


@contextlib.contextmanager
def profiled(model: Any, clock: StageClock) -> Iterator[None]:
    """The model's stages timed on this instance; the engine's key digests on its module."""
    names = ("canonicalize", "predict_batch", "_pass", "preprocess", "_embed")
    wrapped = [name for name in names if hasattr(model, name)]
    stage_of = {"canonicalize": "decode", "predict_batch": "predict", "_pass": "forward pass",
                "preprocess": "preprocess", "_embed": "embed"}  # fmt: skip
    for name in wrapped:
        setattr(model, name, clock.timed(stage_of[name], getattr(model, name)))
    digests = {name: getattr(engine.pipeline.service, name) for name in ("raw_digest", "digest_parts")}
    for name, function in digests.items():
        setattr(engine.pipeline.service, name, clock.timed("key digests", function))
    try:
        yield
    finally:
        for name in wrapped:
            delattr(model, name)  # the class's method again
        for name, function in digests.items():
            setattr(engine.pipeline.service, name, function)


def exclusive(ms: dict[str, float], total: float, n: int) -> dict[str, float]:
    """Per miss; nested timings made exclusive (predict holds preprocess, embed and the pass)."""
    preprocess = ms["preprocess"] + max(0.0, ms["embed"] - ms["forward pass"])  # text: tokenize, pool
    top_k = ms["predict"] - ms["preprocess"] - max(ms["embed"], ms["forward pass"])
    stages = {"key digests": ms["key digests"], "decode": ms["decode"], "preprocess": preprocess,
              "forward pass": ms["forward pass"], "top-k": top_k}  # fmt: skip
    stages["engine"] = total - sum(stages.values())
    return {stage: value / n for stage, value in stages.items()}


def profile(runtime: Runtime, task: str, inputs: Sequence[Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(wall ms, process CPU ms) per stage per miss over `inputs`, all new."""
    clock = StageClock()
    model = runtime.engine.models[task]
    if runtime.torch_threads is not None:  # as if alone in its process (the setting is process-wide)
        runtime.torch_threads.apply(runtime.engine.models.values())
    with profiled(model, clock):
        cpu, total = time.process_time(), 0.0
        for raw in inputs:
            started = time.perf_counter()
            result = runtime.engine.classify(task, raw)
            total += 1000 * (time.perf_counter() - started)
            if result.tier != "miss":
                raise SystemExit(f"expected a miss, got {result.tier}")
        time.sleep(0.2)  # the background writers' share of the last misses
        cpu_total = 1000 * (time.process_time() - cpu)
    n = len(inputs)
    return exclusive(clock.ms, total, n), exclusive(clock.cpu_ms, cpu_total, n)


def main(argv: Sequence[str] | None = None) -> None:
    from bench.workload.inputs import make_images, make_messages

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=60, help="new inputs per task and backend (default 60)")
    args = parser.parse_args(argv)
    warm = 5
    count = len(BACKENDS) * (args.inputs + warm)
    inputs = {"image": make_images(count, 25, workers=1), "text": make_messages(count, 25)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="miss-profile-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        base = Settings.from_env({}).changed(
            server__admin_token=secrets.token_urlsafe(24), quality__shadow_sample_rate=0.0,
        )
        built = {}
        for backend in BACKENDS:
            redis = stack.enter_context(fresh_redis(work / f"{backend}-redis"))
            settings = base.changed(server__data_dir=work / backend, redis__url=redis.url)
            built[backend] = build_runtime(settings, models=load(backend, work / "onnx"))
            stack.callback(built[backend].close)
        for task in ("image", "text"):
            for index, backend in enumerate(BACKENDS):
                first = index * (args.inputs + warm)
                profile(built[backend], task, inputs[task][first : first + warm])  # first-use costs
                measured = inputs[task][first + warm : first + warm + args.inputs]
                wall, cpu = profile(built[backend], task, measured)
                for label, ms in (("wall", wall), ("CPU", cpu)):
                    total = sum(ms.values())
                    cells = [f"{ms[s]:.2f} ({100 * ms[s] / total:.0f}%)" for s in STAGES]
                    rows.append((task, backend, label, *cells, f"{total:.1f}"))
    print(f"{args.inputs} new inputs per task and backend, one at a time, Redis L2; ms per miss (share)")
    print(format_table(("task", "backend", "ms", *STAGES, "total"), rows))


if __name__ == "__main__":
    main()
