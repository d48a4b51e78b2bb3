"""A whole run, and the command line: `python -m bench.workload [--quick] [--http] ...`."""

from __future__ import annotations

import argparse
import pickle
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import bench.workload
from bench.models import host_load, set_threads
from bench.workload.config import (
    ALL_SYSTEMS,
    ATTRIBUTION_SYSTEMS,
    CHART_PATH,
    CLIENTS,
    FULL_REQUESTS,
    HIT_SAMPLES,
    HTTP_SESSIONS,
    HTTP_SYSTEMS,
    IMAGES,
    MESSAGES,
    MISS_INPUTS,
    QUICK_HIT_SAMPLES,
    QUICK_HTTP_REQUESTS,
    QUICK_MISS_INPUTS,
    QUICK_REQUESTS,
    QUICK_RSS_CALLS,
    REPORT_PATH,
    RSS_CALLS,
    SEED,
    SEGMENTS,
    SYSTEMS,
    THREADS,
    TORCH_MODELS,
    WORKLOADS,
    Config,
)
from bench.workload.inprocess import run_workload
from bench.workload.inputs import cached_inputs, make_streams, zipf_stream
from bench.workload.miss_cpu import miss_cpu_ratios
from bench.workload.over_http import run_http
from bench.workload.processes import ModelSets, load_model_sets
from bench.workload.replay import Result
from bench.workload.report import Run, report_lines, summary_line, summary_values, write_chart, write_report


def run_benchmark(
    config: Config,
    *,
    models: ModelSets | None = None,
    log: Callable[[str], None] = print,
    workdir: Path | None = None,
) -> Run:
    started_at, started = datetime.now(UTC), time.perf_counter()
    progress: list[str] = []
    outer_log = log

    def log(message: str) -> None:
        progress.append(message)
        outer_log(message)

    with ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-workload-")))
        t0 = time.perf_counter()
        jobs, origin = cached_inputs(config.images, config.messages, config.seed, config.inputs_cache)
        inputs_path = workdir / "inputs.pickle"
        inputs_path.write_bytes(pickle.dumps(jobs, protocol=pickle.HIGHEST_PROTOCOL))
        streams = make_streams(len(jobs), config.requests, config.zipf_s, config.seed)
        image_kib = sum(len(raw) for task, raw in jobs if task == "image") / max(config.images, 1) / 1024
        log(
            f"inputs: {config.images:,} images (mean {image_kib:.0f} KiB, PNG and JPEG), {config.messages:,} "
            f"messages, {origin} in {time.perf_counter() - t0:.1f} s | seed {config.seed}"
        )
        for name, stream in streams.items():
            distinct = len(set(stream.tolist()))
            log(f"{name}: {len(stream):,} requests over {distinct:,} distinct inputs")
        results: dict[str, dict[str, Result]] = {}
        for workload in config.workloads:
            results[workload] = run_workload(
                workload, streams[workload], config, workdir, inputs_path, models=models, jobs=jobs, log=log
            )
        http = None
        if config.http and config.http_paths:
            http_requests = config.http_requests or config.requests
            stream = (
                streams["zipf-restart"]
                if http_requests == config.requests
                else zipf_stream(len(jobs), http_requests, config.zipf_s, config.seed)
            )
            http = run_http(stream, jobs, config, workdir, models=models, log=log)
        device = "cpu"
        if models is not None:
            device = str(getattr(models[TORCH_MODELS]["image"], "device", "cpu"))
        elif config.device != "auto":
            device = config.device
        else:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        miss_cpu: dict[str, float] = {}
        if config.miss_inputs:
            log(f"miss cost: {config.miss_inputs} new inputs per task, app backend against torch")
            sets = models if models is not None else load_model_sets(device)
            miss_cpu = miss_cpu_ratios(sets, jobs, config.miss_inputs, workdir / "miss-cost")
    values = summary_values(results, http, miss_cpu)
    lines = report_lines(config, results, http, values, device)
    return Run(
        config, results, http, values, lines, progress, started_at, time.perf_counter() - started, device
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.workload", description=bench.workload.__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_REQUESTS:,} requests instead of {FULL_REQUESTS:,}, and the HTTP run with "
        f"{QUICK_HTTP_REQUESTS:,} (unless --no-http)",
    )
    parser.add_argument(
        "--requests", type=int, default=None, help="zipf-restart requests (overrides --quick)"
    )
    parser.add_argument(
        "--http",
        action="store_true",
        help="also send the Zipf stream over HTTP: this app through Gradio and REST, the gr.cache app "
        "through Gradio (--quick does this unless --no-http)",
    )
    parser.add_argument("--no-http", action="store_true", help="no HTTP run, even with --quick")
    parser.add_argument(
        "--http-only", action="store_true", help="the HTTP run alone (no in-process workloads)"
    )
    parser.add_argument("--http-requests", type=int, default=None, help="the HTTP stream's length")
    parser.add_argument(
        "--http-paths",
        default=None,
        help=f"comma-separated subset of {','.join(HTTP_SYSTEMS)} (default: all); e.g. grcache,ours "
        "for the Gradio comparison alone",
    )
    parser.add_argument(
        "--http-sessions",
        choices=HTTP_SESSIONS,
        default="mixed",
        help="Gradio clients that send a session hash: half (mixed, the default), all, or none",
    )
    parser.add_argument(
        "--http-no-session",
        action="store_true",
        help="the same as --http --http-sessions without (curl style: a new Gradio session per request)",
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}; opt-in: {','.join(ATTRIBUTION_SYSTEMS)}"
        " (ours without Redis; a second nocache, the noise floor)",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument("--images", type=int, default=IMAGES)
    parser.add_argument("--messages", type=int, default=MESSAGES)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--segments", type=int, default=SEGMENTS, help="turns per system (interleaving)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--miss-inputs", type=int, default=None,
        help=f"new inputs per task for the miss-cost ratios (default {MISS_INPUTS}, --quick "
             f"{QUICK_MISS_INPUTS}; 0: not measured)",
    )  # fmt: skip
    parser.add_argument(
        "--inputs-cache",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="folder that keeps the generated inputs between runs (default: the temp folder)",
    )
    parser.add_argument("--no-inputs-cache", action="store_true", help="make the inputs afresh, keep nothing")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--threads",
        type=int,
        default=THREADS,
        help=f"torch intra-op threads per serving process (default {THREADS}: clients run forwards at once)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="all systems in this process, sharing one copy of the models (no RSS figures)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        help=f"write the report here (default run: {REPORT_PATH.name}; --quick: nowhere)",
    )
    parser.add_argument(
        "--chart",
        type=Path,
        default=None,
        help=f"write the plotly chart here (default run: {CHART_PATH.name}; --quick: nowhere)",
    )
    args = parser.parse_args(argv)
    args.systems = tuple(s for s in ALL_SYSTEMS if s in args.systems.split(","))
    args.workloads = tuple(w for w in WORKLOADS if w in args.workloads.split(","))
    if not args.systems or not args.workloads:
        parser.error(
            f"--systems takes some of {','.join(ALL_SYSTEMS)}; --workloads some of {','.join(WORKLOADS)}"
        )
    if min(args.images, args.messages, args.clients, args.segments) < 1 or (
        args.threads is not None and args.threads < 1
    ):
        parser.error("--images, --messages, --clients, --segments and --threads must be >= 1")
    if args.requests is not None and args.requests < 2:
        parser.error("--requests must be >= 2")
    if args.http_requests is not None and args.http_requests < 2:
        parser.error("--http-requests must be >= 2")
    if args.http_paths is not None:
        args.http_paths = tuple(p for p in HTTP_SYSTEMS if p in args.http_paths.split(","))
        if not args.http_paths:
            parser.error(f"--http-paths takes some of {','.join(HTTP_SYSTEMS)}")
    if args.no_http and (args.http or args.http_only or args.http_no_session):
        parser.error("--no-http contradicts --http, --http-only and --http-no-session")
    return args


def config_from_args(args: argparse.Namespace) -> Config:
    requests = args.requests or (QUICK_REQUESTS if args.quick else FULL_REQUESTS)
    http = (args.http or args.http_only or args.http_no_session or args.quick) and not args.no_http
    http_requests = args.http_requests or (QUICK_HTTP_REQUESTS if args.quick and not args.requests else None)
    miss_inputs = QUICK_MISS_INPUTS if args.quick else MISS_INPUTS
    if args.miss_inputs is not None:
        miss_inputs = args.miss_inputs
    return Config(
        requests=requests,
        images=args.images,
        messages=args.messages,
        clients=args.clients,
        seed=args.seed,
        segments=args.segments,
        systems=args.systems,
        workloads=() if args.http_only else args.workloads,
        device=args.device,
        threads=args.threads,
        isolated=not args.in_process,
        http=http,
        http_requests=http_requests,
        http_sessions="without" if args.http_no_session else args.http_sessions,
        hit_samples=QUICK_HIT_SAMPLES if args.quick else HIT_SAMPLES,
        rss_calls=QUICK_RSS_CALLS if args.quick else RSS_CALLS,
        miss_inputs=miss_inputs,
        inputs_cache=None if args.no_inputs_cache else args.inputs_cache,
        http_only_paths=args.http_paths,
    )


def main(argv: Sequence[str] | None = None, *, models: ModelSets | None = None) -> int:
    from storage.redis.embedded import find_redis_server

    args = parse_args(argv)
    if find_redis_server() is None:
        print("redis-server is not installed: `apt-get install -y redis-server`.", file=sys.stderr)
        return 2
    config = config_from_args(args)
    if models is not None:
        config = replace(config, isolated=False)
    elif not config.isolated:
        set_threads(config.threads)
        models = load_model_sets(config.device)
    command = "python -m bench.workload" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv)
    )
    print(f"{command} | {host_load()}")
    run = run_benchmark(config, models=models)
    print()
    print("\n".join(run.lines))
    is_default = not args.quick and args.requests is None
    report = args.report or (REPORT_PATH if is_default else None)
    chart = args.chart or (CHART_PATH if is_default else None)
    if report is not None:
        write_report(run, report, command)
        print(f"report: {report}")
    if chart is not None:
        write_chart(run, chart)
        print(f"chart: {chart}")
    ok = not any(line.startswith("answers") and " differ" in line for line in run.lines)
    print(summary_line(run.values))
    return 0 if ok else 1
