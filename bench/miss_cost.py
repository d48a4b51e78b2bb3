"""What a cache miss costs the server, torch against onnxruntime, side by side in one run.

Two engines in this process (L1 only, no Redis: the miss itself is measured, not the network),
each serving the two built-in models, one on torch and one on onnxruntime
(engine.models.onnx_backend). Every request is a new input (`bench.workload`'s images and
messages), so every one is a whole miss: decode, key, preprocessing, forward pass, top-k, L1
write. Per task, sequential and with `--clients` concurrent clients, the two backends run the
same inputs in interleaved chunks (rotating which goes first), so the machine's noise falls on
both alike. Server CPU is this process's CPU time (every thread: torch's and onnxruntime's
pools included) per miss; latency is each request's wall time.

Two apps in one process share its thread pools' tails: torch's idle OpenMP threads spin for
milliseconds after its last op (measured: 7 ms of CPU after a chunk), which a clock started at
once would charge to the next chunk, the other app's. So each chunk starts on a settled process
and its clock stops only when its own pools have settled: each app pays its own tail, never the
other's (as two processes would).

    .venv/bin/python -m bench.miss_cost [--inputs 120] [--chunk 10] [--clients 4] [--tasks image,text]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.models import format_table
from engine.models.base import Classifier
from engine.models.config import DEFAULT_SPECS
from engine.models.loader import load_all
from process_setup import resume_collector
from runtime import Runtime, build_runtime, load_options
from settings import Settings

BACKENDS = ("torch", "onnxruntime")


@dataclass
class Totals:
    cpu_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)

    def row(self) -> tuple[float, float, float]:
        """(CPU ms per miss, median latency ms, p90 latency ms)."""
        done = self.latencies_ms
        p90 = sorted(done)[int(0.9 * (len(done) - 1))]
        return 1000 * self.cpu_s / len(done), statistics.median(done), p90


def load(backend: str, export_dir: Path) -> dict[str, Classifier]:
    # As the app loads them (runtime.load_options): its session threads and pass slots.
    settings = Settings.from_env({}).changed(models__device="cpu", models__inference_backend=backend)
    options = load_options(settings.changed(models__onnx_export_dir=export_dir))
    started = time.perf_counter()
    models = load_all(DEFAULT_SPECS, options)
    print(f"{backend}: models loaded in {time.perf_counter() - started:.1f} s "
          f"({', '.join(f'{t} on {m.backend}' for t, m in models.items())})")  # type: ignore[attr-defined]
    for task, model in models.items():
        if getattr(model, "backend", "torch") != backend:
            raise SystemExit(f"{task} is not on {backend}: {getattr(model, 'backend_reason', None)}")
    return models


@contextlib.contextmanager
def runtimes(work: Path, models: Mapping[str, Mapping[str, Classifier]]) -> Iterator[dict[str, Runtime]]:
    base = Settings.from_env({}).changed(
        server__admin_token=secrets.token_urlsafe(24), redis__url="off", quality__shadow_sample_rate=0.0,
        fairness__client_miss_rate=0.0,
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        built = {}
        for name, loaded in models.items():
            built[name] = build_runtime(base.changed(server__data_dir=work / name), models=dict(loaded))
            stack.callback(built[name].close)
        # As app.py once ready: what start-up built is kept out of the collector's scans. Without
        # it every full collection walks both apps' models (torch's modules, the tokenizers), a
        # cost the served process never pays, charged to whichever app's miss triggered it.
        resume_collector()
        yield built


SETTLE_SLICE_S = 0.01
SETTLE_IDLE_CPU_S = 0.0005  # a slice's CPU below this: no pool is spinning any more


def settle(limit_s: float = 1.0) -> None:
    """Sleeps until this process's threads are idle (a slice's sleep costs next to no CPU), or
    `limit_s`: what a pool burns after the last op happens here, not in the next timed chunk."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        cpu = time.process_time()
        time.sleep(SETTLE_SLICE_S)
        if time.process_time() - cpu < SETTLE_IDLE_CPU_S:
            return


def timed_chunk(runtime: Runtime, task: str, inputs: Sequence[Any], clients: int, totals: Totals) -> None:
    def one(raw: Any) -> float:
        started = time.perf_counter()
        result = runtime.engine.classify(task, raw)
        if result.tier != "miss":
            raise SystemExit(f"expected a miss, got {result.tier}")
        return 1000 * (time.perf_counter() - started)

    if runtime.torch_threads is not None:  # as if alone in its process (the setting is process-wide)
        runtime.torch_threads.apply(runtime.engine.models.values())
    settle()  # the previous chunk's pools (maybe the other app's): not this chunk's cost
    cpu = time.process_time()
    if clients == 1:
        latencies = [one(raw) for raw in inputs]
    else:
        with ThreadPoolExecutor(max_workers=clients) as pool:
            latencies = list(pool.map(one, inputs))
    settle()  # this chunk's own pools winding down: its cost
    totals.cpu_s += time.process_time() - cpu
    totals.latencies_ms += latencies


def side_by_side(built: Mapping[str, Runtime], task: str, inputs: Sequence[Any], *, chunk: int,
                 clients: int) -> dict[str, Totals]:  # fmt: skip
    """Every runtime in `built` answers the same new inputs, in interleaved chunks with the
    order rotating, after one uncounted warm-up chunk: `inputs` is that chunk, then the rest."""
    warm_up, jobs = inputs[:chunk], inputs[chunk:]
    totals = {name: Totals() for name in built}
    for runtime in built.values():  # not counted; new inputs too, so all misses
        timed_chunk(runtime, task, warm_up, clients, Totals())
    order = list(built)
    for start in range(0, len(jobs), chunk):
        order = order[1:] + order[:1]
        for name in order:
            timed_chunk(built[name], task, jobs[start : start + chunk], clients, totals[name])
    return totals


def main(argv: Sequence[str] | None = None) -> None:
    from bench.workload.inputs import make_images, make_messages

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=120, help="new inputs per task and mode (default 120)")
    parser.add_argument("--chunk", type=int, default=10, help="inputs per turn (default 10)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--tasks", default="image,text", help="tasks to measure (default image,text)")
    args = parser.parse_args(argv)
    tasks = [task for task in ("image", "text") if task in args.tasks.split(",")]
    if not tasks or set(args.tasks.split(",")) - set(tasks):
        parser.error(f"--tasks: a comma-separated subset of image,text, not {args.tasks!r}")
    count = 2 * (args.inputs + args.chunk)  # each mode: a warm-up chunk, then its inputs
    makers = {"image": lambda: make_images(count, 25, workers=1), "text": lambda: make_messages(count, 25)}
    inputs = {task: makers[task]() for task in tasks}
    rows = []
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="miss-cost-") as tmp:
        work = Path(tmp)
        models = {backend: load(backend, work / "onnx") for backend in BACKENDS}
        with runtimes(work, models) as built:
            for task in tasks:
                modes = (("sequential", 1), (f"{args.clients} clients", args.clients))
                for index, (label, clients) in enumerate(modes):
                    first = index * (args.inputs + args.chunk)
                    mode_inputs = inputs[task][first : first + args.chunk + args.inputs]
                    totals = side_by_side(built, task, mode_inputs, chunk=args.chunk, clients=clients)
                    cells = {b: totals[b].row() for b in BACKENDS}
                    ratio = cells["onnxruntime"][0] / cells["torch"][0]
                    ratios[f"{task} {label}"] = ratio
                    figures = [f"{v:.1f}" for b in BACKENDS for v in cells[b]]
                    rows.append((task, label, *figures, f"{ratio:.2f}"))
    print(f"{args.inputs} new inputs per task and mode, chunks of {args.chunk}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    headers = ("task", "clients", "torch CPU ms", "torch p50 ms", "torch p90 ms",
               "ort CPU ms", "ort p50 ms", "ort p90 ms", "CPU ort/torch")  # fmt: skip
    print(format_table(headers, rows))
    summary = []
    for task in tasks:  # sequential under bench.workload's name, then with the concurrent clients
        summary.append(f"miss_cpu_vs_torch_{task}={ratios[f'{task} sequential']:.2f}")
        concurrent = ratios[f"{task} {args.clients} clients"]
        summary.append(f"miss_cpu_vs_torch_{task}_{args.clients}_clients={concurrent:.2f}")
    print("SUMMARY " + " ".join(summary))


if __name__ == "__main__":
    main()
