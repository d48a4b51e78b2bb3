"""The figures of a run: tables, ratios, answer checks, the SUMMARY line, REPORT.md and the chart."""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from bench.models import SCORE_TOLERANCE, fmt_ms, format_table
from bench.workload.config import (
    ALL_SYSTEMS,
    HTTP_PATHS,
    HTTP_SYSTEMS,
    NOTES_MARKER,
    PEERS,
    REDIS_OVER_TCP,
    RSS_GROWTH_LIMIT_MB,
    TARGETS,
    Config,
)
from bench.workload.inputs import unique_requests
from bench.workload.over_http import HttpRun, session_plan
from bench.workload.replay import Result, same_answer

IN_PROCESS_KEYS = (
    "speedup_vs_nocache", "speedup_vs_grcache", "speedup_vs_seed", "unique_vs_nocache",
    "speedup_vs_nocache_app", "miss_cpu_vs_torch_image", "miss_cpu_vs_torch_text",
)  # fmt: skip
HTTP_KEYS = ("gradio_vs_grcache", "rest_vs_grcache", "rest_hit_p50_vs_gradio")
SUMMARY_KEYS = (*IN_PROCESS_KEYS, "hit_ratio", *HTTP_KEYS)
FINE_KEYS = frozenset({"hit_ratio", "rest_hit_p50_vs_gradio"})  # three decimals
SUMMARY_PATTERN = re.compile(
    r"^SUMMARY " + " ".join(rf"{key}=(?P<{key}>[0-9.]+|nan)" for key in SUMMARY_KEYS) + "$"
)


@dataclass
class Run:
    config: Config
    results: dict[str, dict[str, Result]]
    http: HttpRun | None
    values: dict[str, float]
    lines: list[str]  # the printed report, without the summary line
    progress: list[str]  # what was logged during the run (load averages at each workload's start and end)
    started: datetime
    elapsed_s: float
    device: str


def ratio(ours: Result | None, peer: Result | None) -> float:
    if ours is None or peer is None or not peer.throughput or math.isnan(peer.throughput):
        return float("nan")
    return ours.throughput / peer.throughput


def summary_values(
    results: Mapping[str, Mapping[str, Result]],
    http: HttpRun | None = None,
    miss_cpu: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """The SUMMARY's ratios. `speedup_vs_nocache` is against plain torch (a user's own app);
    `speedup_vs_nocache_app` against no cache on the app's own backend (the cache's gain alone);
    `miss_cpu_vs_torch_*` the backend's, per task (bench.workload.miss_cpu)."""
    nan = float("nan")
    zipf, unique = results.get("zipf-restart", {}), results.get("unique", {})
    ours = zipf.get("ours")
    over_http = http.results if http is not None else {}
    gradio_hit = http.hit("ours", True, "text") if http is not None else None
    rest_hit = http.hit("ours-rest", None, "text") if http is not None else None
    return {
        "speedup_vs_nocache": ratio(ours, zipf.get("nocache")),
        "speedup_vs_grcache": ratio(ours, zipf.get("grcache")),
        "speedup_vs_seed": ratio(ours, zipf.get("seed")),
        "unique_vs_nocache": ratio(unique.get("ours"), unique.get("nocache")),
        "speedup_vs_nocache_app": ratio(ours, zipf.get("nocache-app")),
        "miss_cpu_vs_torch_image": (miss_cpu or {}).get("image", nan),
        "miss_cpu_vs_torch_text": (miss_cpu or {}).get("text", nan),
        "hit_ratio": ours.hit_ratio if ours is not None else float("nan"),
        "gradio_vs_grcache": ratio(over_http.get("ours"), over_http.get("grcache")),
        "rest_vs_grcache": ratio(over_http.get("ours-rest"), over_http.get("grcache")),
        # A cached text answer over REST against one through Gradio (with a session, as
        # gradio_client keeps it), p50, keep-alive clients, measured side by side.
        "rest_hit_p50_vs_gradio": (
            rest_hit.percentile(50) / gradio_hit.percentile(50)
            if rest_hit is not None and gradio_hit is not None and gradio_hit.n and rest_hit.n
            else float("nan")
        ),
    }


def summary_line(values: Mapping[str, float]) -> str:
    def cell(key: str) -> str:
        value = values.get(key, float("nan"))
        return "nan" if math.isnan(value) else f"{value:.3f}" if key in FINE_KEYS else f"{value:.2f}"

    return "SUMMARY " + " ".join(f"{key}={cell(key)}" for key in SUMMARY_KEYS)


def parse_summary(line: str) -> dict[str, float]:
    found = SUMMARY_PATTERN.match(line.strip())
    if found is None:
        raise ValueError(f"not a summary line: {line!r}")
    return {key: float(found.group(key)) for key in SUMMARY_KEYS}


def _mib(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.0f}"


def results_table(results: Mapping[str, Result]) -> str:
    rows = []
    for r in results.values():
        growth = (
            None if r.rss_peak_mib is None or r.rss_start_mib is None else r.rss_peak_mib - r.rss_start_mib
        )
        rows.append(
            [
                r.system,
                f"{r.requests:,}",
                f"{r.wall_s:.1f}",
                f"{r.throughput:.1f}",
                fmt_ms(r.percentile(50)),
                fmt_ms(r.percentile(95)),
                fmt_ms(r.percentile(99)),
                f"{r.hit_ratio:.3f}",
                f"{r.model_calls:,}",
                "-" if math.isnan(r.cpu_s) else f"{1000 * r.cpu_s / max(r.requests, 1):.2f}",
                _mib(r.rss_peak_mib),
                _mib(growth),
                "-" if r.redis_mib is None else f"{r.redis_mib:.1f}",
                "-" if r.restart_s is None else f"{r.restart_s:.2f}",
            ]
        )
    headers = [
        "system",
        "requests",
        "wall s",
        "req/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "hit ratio",
        "model calls",
        "CPU ms/req",
        "peak RSS MiB",
        "RSS growth MiB",
        "Redis MiB",
        "restart s",
    ]
    return format_table(headers, rows)


def ratio_table(results: Mapping[str, Mapping[str, Result]]) -> str:
    rows = []
    pairs = [("ours", peer) for peer in PEERS] + [
        ("ours", "nocache-app"),
        ("nocache-app", "nocache"),
        ("ours-rest", "grcache"),
        ("ours-rest", "ours"),
        ("ours", "ours-l1"),
        ("ours-tcp", "ours"),
        ("ours-nobatch", "ours"),
        ("ours-signed", "ours"),
        ("nocache-twin", "nocache"),
    ]
    for workload, by_system in results.items():
        for name, peer in pairs:
            subject, other = by_system.get(name), by_system.get(peer)
            if subject is None or other is None:
                continue
            rows.append(
                [
                    f"{workload}: {name} / {peer}",
                    f"{ratio(subject, other):.2f}x",
                    _times(other.percentile(50), subject.percentile(50)),
                    _times(other.percentile(99), subject.percentile(99)),
                    _times(other.cpu_s / max(other.requests, 1), subject.cpu_s / max(subject.requests, 1)),
                    f"{other.model_calls / max(subject.model_calls, 1):.2f}x",
                ]
            )
    headers = [
        "",
        "throughput",
        "p50 (peer/ours)",
        "p99 (peer/ours)",
        "CPU/req (peer/ours)",
        "model calls (peer/ours)",
    ]
    return format_table(headers, rows)


def _times(peer: float, ours: float) -> str:
    return "n/a" if not ours or math.isnan(ours) or math.isnan(peer) else f"{peer / ours:.2f}x"


def tier_line(result: Result) -> str:
    parts = [f"{tier} {result.tiers.get(tier, 0):,}" for tier in ("l1", "l2", "coalesced", "miss")]
    errors = "" if result.l2_errors is None else f"; Redis calls failed or timed out: {result.l2_errors:,}"
    return f"{result.workload}, {result.system} by tier: " + ", ".join(parts) + errors


def check_answers(results: Mapping[str, Result], reference: str = "nocache") -> list[str]:
    """Every system's answer on every input it saw, against the reference system's (the model's)."""
    lines = []
    base = results.get(reference)
    if base is None:
        return [f"answers: no {reference} run to compare with"]
    for name, result in results.items():
        problems = list(result.disagreements)
        identical = 0
        for index, labels in result.answers.items():
            expected = base.answers.get(index)
            if expected is None:
                continue
            if labels == expected:
                identical += 1
            elif not same_answer(labels, expected):
                problems.append(f"input {index}: {labels} but {reference} says {expected}")
        compared = sum(1 for index in result.answers if index in base.answers)
        if name == reference:
            continue
        note = (
            f"{identical:,} of {compared:,} identical, the rest within {SCORE_TOLERANCE:g}"
            if identical < compared
            else f"all {compared:,} identical"
        )
        lines.append(
            f"answers {result.workload}, {name} vs {reference}: "
            + (f"{len(problems)} differ, e.g. {problems[0]}" if problems else note)
        )
    return lines


def _verdict(value: float, op: str, bound: float) -> str:
    if math.isnan(value):
        return "n/a"
    return "met" if (value >= bound if op == ">=" else value <= bound) else "SHORT"


def target_lines(
    values: Mapping[str, float], http: HttpRun | None = None, *, in_process: bool = True
) -> list[str]:
    """One line per target of what the run measured: met, SHORT or n/a."""
    lines = []
    for key, (op, bound) in TARGETS.items():
        value = values.get(key, float("nan"))
        if (key in HTTP_KEYS and http is None) or (key in IN_PROCESS_KEYS and not in_process):
            continue
        lines.append(f"target {key} {op} {bound:g}: {value:.3f} ({_verdict(value, op, bound)})")
    if http is None:
        return lines
    for session in (True, False):  # issue 18: a hit costs no more server CPU than gr.cache's
        ours, peer = http.hit("ours", session, "text"), http.hit("grcache", session, "text")
        value = ours.cpu_ms / peer.cpu_ms if ours and peer and peer.cpu_ms else float("nan")
        lines.append(
            f"target server CPU per cached text answer, ours / grcache through Gradio, "
            f"{'with' if session else 'without'} a session hash <= 1: {value:.2f} "
            f"({_verdict(value, '<=', 1.0)})"
        )
    for growth in http.memory:
        if HTTP_PATHS[growth.path][0] != "ours":
            continue
        limit = RSS_GROWTH_LIMIT_MB * growth.calls / 3000  # MB over 3,000 calls, scaled to this run's
        mib = growth.growth_mib * 2**20 / 1e6
        lines.append(
            f"target server RSS growth over {growth.calls:,} calls without a session ({growth.path}) "
            f"<= {limit:.0f} MB: {mib:+.1f} MB ({_verdict(mib, '<=', limit)})"
        )
    return lines


CEILING_PATHS = {"ours": "gradio_vs_grcache", "ours-rest": "rest_vs_grcache"}


def ceiling_lines(http: HttpRun) -> list[str]:
    """What bounds each HTTP ratio, from the run's own figures: the stream is CPU-bound on 2 cores,
    so throughput follows server CPU per request, and ours = hit share x a hit's CPU (the cached
    answers one at a time, weighted by the stream's task mix) + the rest (misses, queueing). With
    free hits the ratio could reach grcache's CPU over the rest alone; the hit cost the target
    needs follows from the same sum."""
    peer = http.results.get("grcache")
    if peer is None or not peer.requests or math.isnan(peer.cpu_s):
        return []
    peer_ms = 1000 * peer.cpu_s / peer.requests
    lines = []
    for path, key in CEILING_PATHS.items():
        ours = http.results.get(path)
        costs = {task: [h.cpu_ms for h in http.hits if h.path == path and h.task == task and h.n]
                 for task in http.task_share}  # fmt: skip
        if ours is None or not ours.requests or math.isnan(ours.cpu_s) or not all(costs.values()):
            continue
        hit_ms = sum(share * float(np.mean(costs[task])) for task, share in http.task_share.items())
        ours_ms = 1000 * ours.cpu_s / ours.requests
        rest_ms = ours_ms - ours.hit_ratio * hit_ms
        target = TARGETS[key][1]
        needed = (peer_ms / target - rest_ms) / ours.hit_ratio if ours.hit_ratio else float("nan")
        reach = (
            f"the target needs hits <= {needed:.2f} ms"
            if needed > 0
            else "out of reach even with free hits: the rest alone costs more than the target allows"
        )
        lines.append(
            f"ceiling {key} (target >= {target:g}): CPU per request grcache {peer_ms:.2f} ms, {path} "
            f"{ours_ms:.2f} ms = hits {ours.hit_ratio:.3f} x {hit_ms:.2f} ms + the rest (misses, queueing) "
            f"{rest_ms:.2f} ms; CPU ratio {peer_ms / ours_ms:.2f}x, with free hits {peer_ms / rest_ms:.2f}x; "
            + reach
        )
    return lines


def http_lines(config: Config, http: HttpRun) -> list[str]:
    """The HTTP run: the stream's table, the cached answers one at a time, the servers' memory."""
    plan = session_plan(http.sessions, config.clients)
    lines = [
        "",
        f"zipf-restart over HTTP, {len(http.results)} paths side by side ({config.clients} keep-alive "
        f"clients per path; Gradio clients with a session hash: {sum(plan)} of {len(plan)}; ours-rest: "
        "/v2 REST, JSON; CPU: the server process and its Redis; restart: new processes, models loaded "
        "again):",
        results_table(http.results),
    ]
    lines += [tier_line(r) for name, r in http.results.items() if HTTP_PATHS[name][0] == "ours"]
    rows = []
    for hit in http.hits:
        session = "-" if hit.session is None else "with" if hit.session else "without"
        tiers = (
            ", ".join(f"{tier} {count}" for tier, count in sorted(hit.tiers.items()) if tier != "?") or "-"
        )
        cpu = "-" if math.isnan(hit.cpu_ms) else f"{hit.cpu_ms:.2f}"
        rows.append([hit.path, session, hit.task, str(hit.n), fmt_ms(hit.percentile(50)),
                     fmt_ms(hit.percentile(99)), cpu, tiers])  # fmt: skip
    if rows:
        lines += [
            "",
            "cached answers, one at a time (one keep-alive client per row, rows interleaved in rounds; "
            "server CPU: its process and its Redis, per answer; tiers: this app's cache_info):",
            format_table(
                ["path", "session hash", "task", "n", "p50 ms", "p99 ms", "server CPU ms", "tiers"], rows
            ),
        ]
    for growth in http.memory:
        lines.append(
            f"server memory, {growth.path}: {growth.calls:,} cached text calls without a session hash, RSS "
            f"{_mib(growth.start_mib)} -> {_mib(growth.end_mib)} MiB ({growth.growth_mib:+.1f} MiB)"
        )
    ceilings = ceiling_lines(http)
    return lines + (["", *ceilings] if ceilings else [])


def machine_lines() -> list[str]:
    import gradio
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            found = re.search(r"model name\s*:\s*(.+)", info.read())
            cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    return [
        f"CPU: {cpu}, {os.cpu_count()} logical CPUs; memory {psutil.virtual_memory().total / 2**30:.0f} GiB",
        f"OS: {platform.platform()}; Python {platform.python_version()}",
        f"torch {torch.__version__} (its default: {torch.get_num_threads()} intra-op threads), "
        f"gradio {gradio.__version__}",
    ]


def report_lines(
    config: Config,
    results: Mapping[str, Mapping[str, Result]],
    http: HttpRun | None,
    values: Mapping[str, float],
    device: str,
) -> list[str]:
    tcp_note = " (ours-tcp: loopback TCP)" if REDIS_OVER_TCP & set(config.systems) else ""
    lines = [
        f"device: {device} | {config.clients} concurrent clients | Zipf s={config.zipf_s} | torch threads "
        f"{config.threads or 'default'} | "
        f"{'each system in its own process' if config.isolated else 'all systems in one process (RSS n/a)'}"
        f" | Redis on unix sockets{tcp_note}",
    ]
    for workload, by_system in results.items():
        lines += ["", f"{workload}:", results_table(by_system)]
        if "ours" in by_system:
            lines.append(tier_line(by_system["ours"]))
    if http is not None:
        lines += http_lines(config, http)
    ratio_input: dict[str, Mapping[str, Result]] = dict(results)
    if http is not None:
        ratio_input["zipf-restart (HTTP)"] = http.results
    lines += ["", ratio_table(ratio_input), ""]
    for by_system in results.values():
        lines += check_answers(by_system)
    if http is not None and "grcache" in http.results:
        lines += check_answers(http.results, reference="grcache")
    lines += ["", *target_lines(values, http, in_process=bool(results))]
    return lines


def write_chart(run: Run, path: Path) -> None:
    """Latency CDF per system (one panel per workload, and HTTP) and throughput bars."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels: list[tuple[str, Mapping[str, Result]]] = list(run.results.items())
    if run.http is not None:
        panels.append(("zipf-restart over HTTP", run.http.results))
    titles = [f"latency CDF: {name}" for name, _ in panels] + ["throughput (requests/s)"]
    fig = make_subplots(rows=1, cols=len(panels) + 1, subplot_titles=titles)
    colours = {"nocache": "#7f7f7f", "nocache-app": "#bcbd22", "seed": "#ff7f0e", "grcache": "#1f77b4",
               "ours": "#2ca02c",
               "ours-l1": "#98df8a", "ours-tcp": "#ff9896", "ours-nobatch": "#c5b0d5",
               "ours-signed": "#f7b6d2", "nocache-twin": "#c7c7c7", "ours-rest": "#17becf"}  # fmt: skip
    for col, (_, by_system) in enumerate(panels, start=1):
        for name, result in by_system.items():
            ordered = np.sort(result.latencies_ms)
            if not len(ordered):
                continue
            picks = np.unique(np.linspace(0, len(ordered) - 1, num=min(len(ordered), 400)).astype(int))
            fig.add_trace(
                go.Scatter(
                    x=ordered[picks],
                    y=(picks + 1) / len(ordered),
                    mode="lines",
                    name=name,
                    line={"color": colours.get(name)},
                    legendgroup=name,
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(type="log", title_text="ms (log)", row=1, col=col)
        fig.update_yaxes(title_text="share of requests", range=[0, 1], row=1, col=col)
    bar_col = len(panels) + 1
    for name in dict.fromkeys(ALL_SYSTEMS + HTTP_SYSTEMS):
        xs = [label for label, by_system in panels if name in by_system]
        ys = [by_system[name].throughput for _, by_system in panels if name in by_system]
        fig.add_trace(
            go.Bar(x=xs, y=ys, name=name, marker_color=colours.get(name), legendgroup=name, showlegend=False),
            row=1,
            col=bar_col,
        )
    fig.update_yaxes(type="log", title_text="req/s (log)", row=1, col=bar_col)
    fig.update_layout(
        title=f"bench.workload, {run.started:%Y-%m-%d}: {summary_line(run.values)}",
        barmode="group",
        height=520,
        width=560 * (len(panels) + 1),
    )
    path.write_text(fig.to_html(include_plotlyjs="cdn", full_html=True), encoding="utf-8")


def write_report(run: Run, path: Path, command: str) -> None:
    kept = ""
    if path.exists():
        old = path.read_text(encoding="utf-8")
        if NOTES_MARKER in old:
            kept = old[old.index(NOTES_MARKER) :]
    config = run.config
    unique = unique_requests(config.requests, config.images + config.messages)
    body = [
        "# Workload benchmark report",
        "",
        "Written by `bench/workload/` (the table below is the output of the run; the notes at the end",
        "are kept when the report is rewritten).",
        "",
        f"- command: `{command}`",
        f"- date: {run.started:%Y-%m-%d %H:%M} UTC; the run took {run.elapsed_s / 60:.1f} minutes",
        *(f"- {line}" for line in machine_lines()),
        f"- requests: {config.requests:,} (zipf-restart), {unique:,} (unique); inputs {config.images:,} "
        f"images + {config.messages:,} messages; seed {config.seed}; {config.segments} segments; "
        f"torch intra-op threads per process: {config.threads or 'torch default'}",
        "",
        "```",
        *run.lines,
        summary_line(run.values),
        "```",
        "",
        "Progress log of the run (the load average counts every runnable process on the machine, "
        "this run's included):",
        "",
        "```",
        *run.progress,
        "```",
        "",
    ]
    path.write_text("\n".join(body) + (("\n" + kept) if kept else ""), encoding="utf-8")
