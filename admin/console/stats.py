"""Read models for the console. Every query aggregates in SQL over a time window."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import and_, case, func, literal, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import aliased

from storage.sql import RequestRow

HIT_TIERS = ("l1", "l2", "coalesced")
TIERS = ("l1", "l2", "coalesced", "miss")
# Refused misses (the client's miss budget, engine.capacity.fairness): drawn with the tiers, never
# counted as answers (hit rate, totals).
REFUSED = "refused"
# Latency histogram bucket upper bounds (ms), log-spaced: hits live in the first few.
LATENCY_BUCKETS_MS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
OVERFLOW_MS = 1e9  # the "slower than every bound" bucket (JSON has no infinity)


@dataclass(frozen=True)
class Summary:
    window_s: float
    total: int
    ok: int
    invalid: int
    errors: int
    by_tier: dict[str, int]
    by_task: dict[str, int]
    # Requests per replica (REPLICA_ID; "" for rows written before replicas were named): replicas
    # that share the database are all counted, and this tells them apart.
    by_replica: dict[str, int]
    hit_rate: float | None  # hits / answered requests; None when there were none
    avg_miss_model_ms: float | None
    model_seconds_saved: float


@dataclass(frozen=True)
class MinuteBucket:
    minute: float  # unix seconds at the start of the minute
    total: int
    hits: int
    by_tier: dict[str, int]

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.total if self.total else None


@dataclass(frozen=True)
class LatencyBucket:
    tier: str
    upper_ms: float
    count: int


@dataclass(frozen=True)
class HotKey:
    task: str
    key_digest: str
    count: int
    share: float
    last_label: str | None


def _window(now: float, window_s: float) -> Any:
    return RequestRow.at >= now - window_s


def summary(engine: Engine, *, now: float, window_s: float) -> Summary:
    in_window = _window(now, window_s)
    with engine.connect() as conn:
        status_rows = conn.execute(
            select(RequestRow.status, func.count()).where(in_window).group_by(RequestRow.status)
        ).all()
        tier_rows = conn.execute(
            select(RequestRow.tier, func.count())
            .where(in_window, RequestRow.status == "ok")
            .group_by(RequestRow.tier)
        ).all()
        task_rows = conn.execute(
            select(RequestRow.task, func.count()).where(in_window).group_by(RequestRow.task)
        ).all()
        replica_rows = conn.execute(
            select(RequestRow.replica, func.count()).where(in_window).group_by(RequestRow.replica)
        ).all()
        avg_model_ms = conn.execute(
            select(func.avg(RequestRow.model_ms)).where(
                in_window, RequestRow.tier == "miss", RequestRow.model_ms.is_not(None)
            )
        ).scalar()
    by_status = dict(status_rows)
    by_tier = {tier: 0 for tier in TIERS} | {t: n for t, n in tier_rows if t}
    hits = sum(by_tier[t] for t in HIT_TIERS)
    answered = hits + by_tier["miss"]
    return Summary(
        window_s=window_s,
        total=sum(by_status.values()),
        ok=by_status.get("ok", 0),
        invalid=by_status.get("invalid", 0),
        errors=by_status.get("error", 0),
        by_tier=by_tier,
        by_task=dict(task_rows),
        by_replica={replica or "": n for replica, n in replica_rows},
        hit_rate=hits / answered if answered else None,
        avg_miss_model_ms=float(avg_model_ms) if avg_model_ms is not None else None,
        model_seconds_saved=(float(avg_model_ms) * hits / 1000.0) if avg_model_ms else 0.0,
    )


def per_minute(engine: Engine, *, now: float, window_s: float) -> list[MinuteBucket]:
    minute = (func.floor(RequestRow.at / 60) * 60).label("minute")
    with engine.connect() as conn:
        rows = conn.execute(
            select(minute, RequestRow.tier, RequestRow.status, func.count())
            .where(_window(now, window_s), RequestRow.status.in_(("ok", REFUSED)))
            .group_by(minute, RequestRow.tier, RequestRow.status)
            .order_by(minute)
        ).all()
    buckets: dict[float, dict[str, int]] = {}
    for start, tier, status, count in rows:
        tiers = buckets.setdefault(float(start), {t: 0 for t in (*TIERS, REFUSED)})
        tiers[REFUSED if status == REFUSED else tier] += count
    return [
        MinuteBucket(start, sum(tiers[t] for t in TIERS), sum(tiers[t] for t in HIT_TIERS), tiers)
        for start, tiers in sorted(buckets.items())
    ]


def latency_histogram(engine: Engine, *, now: float, window_s: float) -> list[LatencyBucket]:
    bucket = case(
        *[(RequestRow.latency_ms <= bound, literal(bound)) for bound in LATENCY_BUCKETS_MS],
        else_=literal(OVERFLOW_MS),
    ).label("upper")
    with engine.connect() as conn:
        rows = conn.execute(
            select(RequestRow.tier, bucket, func.count())
            .where(_window(now, window_s), RequestRow.status == "ok")
            .group_by(RequestRow.tier, bucket)
            .order_by(RequestRow.tier, bucket)
        ).all()
    return [LatencyBucket(tier, float(upper), count) for tier, upper, count in rows]


def hot_keys(engine: Engine, *, now: float, window_s: float, limit: int = 20) -> list[HotKey]:
    in_window = _window(now, window_s)
    counts = (
        select(
            RequestRow.task,
            RequestRow.key_digest,
            func.count().label("n"),
            func.max(RequestRow.id).label("last_id"),
        )
        .where(in_window, RequestRow.status == "ok", RequestRow.key_digest.is_not(None))
        .group_by(RequestRow.task, RequestRow.key_digest)
        .order_by(func.count().desc())
        .limit(limit)
        .subquery()
    )
    last = aliased(RequestRow)
    with engine.connect() as conn:
        total = conn.execute(select(func.count()).where(in_window, RequestRow.status == "ok")).scalar_one()
        rows = conn.execute(
            select(counts.c.task, counts.c.key_digest, counts.c.n, last.top_label)
            .join(last, and_(last.id == counts.c.last_id))
            .order_by(counts.c.n.desc(), counts.c.key_digest)
        ).all()
    return [HotKey(task, digest, n, n / total if total else 0.0, label) for task, digest, n, label in rows]


def as_plain(value: Any) -> Any:
    """Dataclasses (and lists of them) as JSON-ready dicts."""
    if isinstance(value, list):
        return [as_plain(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value
