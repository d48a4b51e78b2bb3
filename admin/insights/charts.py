"""The console's answers drawn and written: miss-ratio curves with today's size marked, the GPU
trend, and HTML cards for the verdict, Redis/GPU health and the live cache state. Plain data
in (admin.insights.service, AdminService.cache_state), figures and escaped HTML out."""

from __future__ import annotations

import html
import math
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go

from admin.console.charts import _layout

TASK_COLOURS = ("#2563eb", "#ea580c", "#9333ea", "#0891b2", "#ca8a04", "#be123c")
OVERALL_COLOUR = "#16a34a"
TIER_TITLES = {"l1": "L1 (process memory)", "l2": "L2 (Redis memory)"}


def human_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _pct(ratio: float | None) -> str:
    return "–" if ratio is None else f"{100 * ratio:.0f} %"


def sizing_sentence(entry: dict[str, Any] | None, tier: str) -> str:
    """E.g. "L1: today's 256 MB would have answered 62 % (best on the curve 70 %); 95 % of that
    from 64 MB." — the answer to "how big should it be"."""
    curve = (entry or {}).get(tier)
    name = TIER_TITLES[tier].split(" ")[0]
    if not curve or not entry or not entry["requests"]:
        return f"{name}: no requests sampled in this window yet."
    text = (
        f"{name}: today's {human_bytes(curve['current_bytes'])} would have answered "
        f"{_pct(curve['current_hit_ratio'])} (best on the curve {_pct(curve['best_hit_ratio'])})"
    )
    if curve["smallest_bytes_for_95pct_of_best"] is not None:
        text += f"; 95 % of that from {human_bytes(curve['smallest_bytes_for_95pct_of_best'])}"
    if tier == "l2" and not curve.get("limit_set", True):
        text += " (Redis has no maxmemory: the curve is centred on its used memory)"
    return text + "."


def sizing_figure(report: dict[str, Any], tier: str) -> go.Figure:
    """Hit ratio against size (log axis) per task and overall, today's size a dashed line."""
    overall = report.get("overall")
    with_tier = [(task, e) for task, e in report.get("tasks", {}).items() if e.get(tier)]
    series = [(task, e[tier]["curve"], "lines", {"color": TASK_COLOURS[i % len(TASK_COLOURS)]})
              for i, (task, e) in enumerate(with_tier)]  # fmt: skip
    if overall and overall.get(tier):
        thick = {"color": OVERALL_COLOUR, "width": 3}
        series.append(("all tasks", overall[tier]["curve"], "lines+markers", thick))
    traces = [
        go.Scatter(x=[p["bytes"] for p in points], y=[100 * p["hit_ratio"] for p in points], name=name,
                   mode=mode, line=line)
        for name, points, mode, line in series
    ]  # fmt: skip
    fig = go.Figure(traces)
    current = (overall or {}).get(tier, {}) or {}
    marks = (("current_bytes", "today", "dash", "#64748b", 1.0),
             ("smallest_bytes_for_95pct_of_best", "95 % of best", "dot", OVERALL_COLOUR, 0.08))  # fmt: skip
    for field, text, dash, colour, y in marks:
        if current.get(field):
            fig.add_vline(x=current[field], line_dash=dash, line_color=colour)
            # On a log axis an annotation's x is the exponent (plotly.js), a shape's the value.
            fig.add_annotation(x=math.log10(current[field]), y=y, yref="paper", text=text, showarrow=False,
                               xanchor="left", font={"color": colour})  # fmt: skip
    return _layout(
        fig,
        f"{tier.upper()} hit ratio by size",
        TIER_TITLES[tier],
        yaxis={"range": [0, 100], "ticksuffix": "%"},
        xaxis={"type": "log", "title": "cache size (bytes)"},
    )


def gpu_figure(gpu: dict[str, Any]) -> go.Figure:
    """Utilisation and memory use (% of the device) over the last hour; a note on the CPU."""
    fig = go.Figure()
    if not gpu.get("enabled"):
        fig.add_annotation(
            text=gpu.get("note") or "No GPU", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper"
        )
        return _layout(fig, "GPU", xaxis={"visible": False}, yaxis={"visible": False})
    trend = gpu.get("trend") or []
    times = [datetime.fromtimestamp(p["at"], tz=UTC) for p in trend]
    devices = sorted({g["device"] for p in trend for g in p["gpus"]})
    for device in devices:
        rows = [next((g for g in p["gpus"] if g["device"] == device), None) for p in trend]
        fig.add_scatter(
            x=times,
            y=[None if g is None or g["utilization"] is None else 100 * g["utilization"] for g in rows],
            name=f"{device} busy",
            mode="lines",
        )
        fig.add_scatter(
            x=times,
            y=[None if g is None else 100 * g["memory_used_bytes"] / g["memory_total_bytes"] for g in rows],
            name=f"{device} memory",
            mode="lines",
            line={"dash": "dot"},
        )
    return _layout(fig, "GPU use", "utilisation and memory, % of the device",
                   yaxis={"range": [0, 100], "ticksuffix": "%"})  # fmt: skip


def _cards(rows: list[tuple[str, str, bool]]) -> str:
    """(name, value, warn) -> the console's card row; a warning card is marked."""
    return (
        '<div class="stat-cards">'
        + "".join(
            f'<div class="stat-card{" stat-warn" if warn else ""}">'
            f'<div class="stat-name">{html.escape(name)}</div>'
            f'<div class="stat-value">{html.escape(value)}</div></div>'
            for name, value, warn in rows
        )
        + "</div>"
    )


def _notes(lines: list[str], css: str) -> str:
    return "".join(f'<p class="{css}">{html.escape(line)}</p>' for line in lines)


def worth_html(worth: dict[str, Any]) -> str:
    """The verdict, in words, then a card per task."""
    overall = worth["overall"]
    rows = [
        (
            task,
            f"{_pct(w['repeat_ratio'])} repeat · {_pct(w['hit_ratio'])} hits · "
            f"{w['model_seconds_saved']:,.1f} s saved"
            + (f" · {w['cost_saved']:.2f}" if w["cost_saved"] is not None else ""),
            False,
        )
        for task, w in worth["tasks"].items()
    ]
    return (
        f'<div class="verdict" id="admin-verdict-text"><strong>Is caching worth it here?</strong> '
        f"{html.escape(overall['verdict'])}</div>" + _cards(rows)
    )


def health_html(health: dict[str, Any]) -> str:
    """A card per Redis primary (used / limit, policy, evictions) with the warnings, then the GPU."""
    redis, gpu = health["redis"], health["gpu"]
    rows = []
    if not redis["enabled"]:
        notes = _notes(["L2 is off: there is no Redis to watch."], "health-note")
    else:
        for n in redis["nodes"]:
            if not n["up"]:
                rows.append((f"Redis {n['node']}", "down", True))
                continue
            limit = human_bytes(n["maxmemory"]) if n["maxmemory"] else "no limit"
            fill = f" ({_pct(n['fill'])})" if n["fill"] is not None else ""
            rows.append(
                (
                    f"Redis {n['node']} memory",
                    f"{human_bytes(n['used_memory'])} / {limit}{fill}",
                    not n["maxmemory"] or (n["fill"] or 0) >= redis["warn_ratio"],
                )
            )
            rows.append(
                (
                    f"Redis {n['node']} policy · evicted · expired",
                    f"{n['policy']} · {n['evicted_keys']:,} · {n['expired_keys']:,}",
                    False,
                )
            )
        notes = _notes(redis["warnings"], "health-warning")
    for g in gpu["devices"]:
        busy = _pct(g["utilization"]) if g["utilization"] is not None else "– (no NVML)"
        rows.append(
            (
                f"{g['device']} {g['name']}",
                f"{busy} busy · {human_bytes(g['memory_used_bytes'])} / "
                f"{human_bytes(g['memory_total_bytes'])}",
                False,
            )
        )
    gpu_note = _notes([gpu["note"]], "health-note") if gpu["note"] else ""
    return _cards(rows) + notes + gpu_note


def state_html(state: dict[str, Any]) -> str:
    """The live cache state (AdminService.cache_state) as cards, instead of a JSON dump."""
    l1, l2 = state["l1"], state["l2"]
    rows = [
        (
            f"Model · {task}",
            f"{m.get('name', '?')} {str(m.get('version', ''))[:12]} · {m.get('device', '?')} · "
            f"{m.get('backend', 'torch')}",
            False,
        )
        for task, m in sorted(state.get("models", {}).items())
    ]
    used = l1["bytes"] / l1["max_bytes"] if l1.get("max_bytes") else None
    rows.append(
        (
            "L1 memory",
            f"{l1['entries']:,} entries · {human_bytes(l1['bytes'])} / "
            f"{human_bytes(l1['max_bytes'])} ({_pct(used)}) · {l1['evictions']:,} evicted",
            False,
        )
    )
    l2_text = l2["state"] + (f" · breaker {l2['breaker']}" if l2.get("breaker") else "")
    if l2.get("keys") is not None:
        l2_text += f" · {l2['keys']:,} keys · {human_bytes(l2.get('memory_bytes'))}"
    rows.append(("L2 Redis", l2_text, l2["state"] != "up"))
    for node in l2.get("nodes") or []:
        keys = "down" if node["keys"] is None else f"{node['keys']:,} keys"
        rows.append(
            (f"Redis {node['node']}", f"{keys} · breaker {node.get('breaker') or '–'}", node["keys"] is None)
        )
    rows.append(("Generation", str(state["generation"]), False))
    notice = _notes([l2["notice"]], "health-note") if l2.get("notice") else ""
    return _cards(rows) + notice
