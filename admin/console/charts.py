"""Plotly figures built from the read models' plain data (see AdminService.stats)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go

from admin.console.stats import LATENCY_BUCKETS_MS, OVERFLOW_MS, REFUSED, TIERS

TIER_COLOURS = {"l1": "#16a34a", "l2": "#2563eb", "coalesced": "#9333ea", "miss": "#ea580c",
                REFUSED: "#6b7280"}  # fmt: skip
OVERFLOW_PLOT_MS = 20_000.0  # where the "slower than every bound" bucket is drawn
TIER_NAMES = {"l1": "L1 memory", "l2": "L2 Redis", "coalesced": "coalesced", "miss": "miss (model)",
              REFUSED: "refused miss (client over budget)"}  # fmt: skip


def _layout(fig: go.Figure, title: str, detail: str | None = None, **extra: Any) -> go.Figure:
    """Short titles: plotly never wraps one, and a phone's chart (about 350 px wide) cuts a
    long one off. What the chart counts (`detail`) goes on a second, smaller line."""
    text = f"{title}<br><sup>{detail}</sup>" if detail else title
    layout: dict[str, Any] = {
        "title": text, "height": 320, "margin": {"l": 50, "r": 20, "t": 64 if detail else 50, "b": 40},
        "legend": {"orientation": "h", "y": -0.2}, "template": "plotly_white",
    }  # fmt: skip
    fig.update_layout(**(layout | extra))
    return fig


def _minute_times(per_minute: list[dict[str, Any]]) -> list[datetime]:
    return [datetime.fromtimestamp(b["minute"], tz=UTC) for b in per_minute]


def hit_rate_figure(per_minute: list[dict[str, Any]]) -> go.Figure:
    fig = go.Figure(
        go.Scatter(
            x=_minute_times(per_minute),
            y=[None if b["hit_rate"] is None else 100.0 * b["hit_rate"] for b in per_minute],
            mode="lines+markers",
            name="hit rate",
            line={"color": TIER_COLOURS["l1"]},
        )
    )
    return _layout(fig, "Hit rate per minute (%)", yaxis={"range": [0, 100], "ticksuffix": "%"})


def tiers_figure(per_minute: list[dict[str, Any]]) -> go.Figure:
    times = _minute_times(per_minute)
    fig = go.Figure(
        [
            go.Bar(
                x=times,
                y=[b["by_tier"].get(tier, 0) for b in per_minute],
                name=TIER_NAMES[tier],
                marker_color=TIER_COLOURS[tier],
            )
            for tier in (*TIERS, REFUSED)
        ]
    )
    return _layout(fig, "Requests by tier per minute", barmode="stack")


def latency_figure(latency: list[dict[str, Any]]) -> go.Figure:
    """A step histogram per tier on a log latency axis: hits (µs) and misses (tens of ms)
    differ by orders of magnitude, so bars on a linear axis would hide one or the other."""
    bounds = [*LATENCY_BUCKETS_MS, OVERFLOW_PLOT_MS]
    traces = []
    for tier in TIERS:
        counts = {b["upper_ms"]: b["count"] for b in latency if b["tier"] == tier}
        if not counts:
            continue
        traces.append(
            go.Scatter(
                x=bounds,
                y=[counts.get(bound, 0) for bound in [*LATENCY_BUCKETS_MS, OVERFLOW_MS]],
                name=TIER_NAMES[tier],
                mode="lines+markers",
                line={"shape": "hv", "color": TIER_COLOURS[tier]},
            )
        )
    fig = go.Figure(traces)
    return _layout(
        fig,
        "Latency by tier",
        "requests per bucket, log axis",
        xaxis={"type": "log", "title": "latency ≤ ms", "range": [math.log10(0.03), math.log10(30000)]},
    )


def hot_keys_figure(hot_keys: list[dict[str, Any]]) -> go.Figure:
    keys = list(reversed(hot_keys))  # biggest on top
    fig = go.Figure(
        go.Bar(
            x=[k["count"] for k in keys],
            y=[f"{k['task']}:{k['key_digest'][:8]}" for k in keys],
            orientation="h",
            text=[f"{k['last_label'] or '?'} · {100 * k['share']:.1f}%" for k in keys],
            textposition="auto",
            marker_color=TIER_COLOURS["l2"],
        )
    )
    return _layout(fig, "Hot keys", "requests, last label, share", height=max(320, 24 * len(keys) + 80))


def all_figures(data: dict[str, Any]) -> dict[str, go.Figure]:
    return {
        "hit_rate": hit_rate_figure(data["per_minute"]),
        "tiers": tiers_figure(data["per_minute"]),
        "latency": latency_figure(data["latency"]),
        "hot_keys": hot_keys_figure(data["hot_keys"]),
    }
