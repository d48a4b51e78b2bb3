"""Is caching worth it here: from the request log, per task and window, how often inputs
repeat, how often the cache answered, the model time it saved and what that time costs
(MODEL_COST_PER_HOUR; 0 leaves money out), and a verdict in plain words."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.engine import Engine

from admin.console.stats import HIT_TIERS
from storage.sql import RequestRow

LOW_REPEAT = 0.10  # below this share of repeats a cache saves little
MISSED_REPEATS = 0.10  # hit ratio this far below the repeat ratio: entries leave too early


@dataclass(frozen=True)
class Worth:
    task: str  # a task, or "all"
    requests: int  # answered (status ok)
    distinct_inputs: int
    repeat_ratio: float | None  # requests whose input came earlier in the window
    hit_ratio: float | None
    model_seconds_saved: float  # hits x the task's mean model time per miss
    cost_saved: float | None  # model hours saved x MODEL_COST_PER_HOUR; None when it is 0
    verdict: str


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def window_name(window_s: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if window_s >= size and window_s % size == 0:
            return f"{window_s / size:.0f} {unit}"
    return duration(window_s)


def _verdict(w: dict[str, Any], window_s: float) -> str:
    if not w["requests"]:
        return f"No answered requests in the last {window_name(window_s)}: nothing to judge yet."
    repeat, hit = w["repeat_ratio"], w["hit_ratio"]
    money = f" (worth {w['cost_saved']:.2f} in model time)" if w["cost_saved"] else ""
    saved = duration(w["model_seconds_saved"])
    text = (f"{100 * repeat:.0f} % of requests repeat an earlier input; the cache answered {100 * hit:.0f} % "
            f"and saved {saved} of model time in {window_name(window_s)}{money}.")  # fmt: skip
    if repeat < LOW_REPEAT:
        return text + " Inputs rarely repeat here: caching gains little beyond its small lookup cost."
    if hit < repeat - MISSED_REPEATS:
        return text + (" It misses repeats it could serve: entries leave before they come back — "
                       "see Sizing for a larger L1/L2, or a longer TTL.")  # fmt: skip
    return text + " Caching pays here."


def worth(db: Engine, *, now: float, window_s: float, cost_per_hour: float) -> list[Worth]:
    """One entry per task seen in the window, then "all" (every task together)."""
    hit = case((RequestRow.tier.in_(HIT_TIERS), 1), else_=0)
    miss_ms = case((RequestRow.tier == "miss", RequestRow.model_ms))
    query = (
        select(RequestRow.task, func.count(), func.count(func.distinct(RequestRow.key_digest)), func.sum(hit),
               func.avg(miss_ms))
        .where(RequestRow.at >= now - window_s, RequestRow.status == "ok")
        .group_by(RequestRow.task)
        .order_by(RequestRow.task)
    )  # fmt: skip
    with db.connect() as conn:
        rows = conn.execute(query).all()
    entries = [
        {"task": task, "requests": int(n), "distinct_inputs": int(distinct), "hits": int(hits or 0),
         "model_seconds_saved": float(avg_ms or 0.0) * int(hits or 0) / 1000.0}
        for task, n, distinct, hits, avg_ms in rows
    ]  # fmt: skip
    entries.append({
        "task": "all", "requests": sum(e["requests"] for e in entries),
        "distinct_inputs": sum(e["distinct_inputs"] for e in entries),  # keys differ between tasks
        "hits": sum(e["hits"] for e in entries),
        "model_seconds_saved": sum(e["model_seconds_saved"] for e in entries),
    })  # fmt: skip
    out = []
    for e in entries:
        n, hits = e["requests"], e.pop("hits")
        e["repeat_ratio"] = round(1 - e["distinct_inputs"] / n, 4) if n else None
        e["hit_ratio"] = round(hits / n, 4) if n else None
        e["cost_saved"] = round(e["model_seconds_saved"] / 3600 * cost_per_hour, 4) if cost_per_hour else None
        e["model_seconds_saved"] = round(e["model_seconds_saved"], 3)
        out.append(Worth(**e, verdict=_verdict(e, window_s)))
    return out


def as_dict(entries: list[Worth], window_s: float, cost_per_hour: float) -> dict[str, Any]:
    return {
        "window_s": window_s,
        "model_cost_per_hour": cost_per_hour or None,
        "tasks": {w.task: asdict(w) for w in entries if w.task != "all"},
        "overall": asdict(entries[-1]),
    }
