"""How big should each tier be: the miss-ratio curves of `engine.sizing.key_sampler`, as the console
and `GET /admin/api/sizing` show them.

For each task (and `overall`, every task's keys together: the stream one shared L1 sees), the
hit ratio an LRU cache would have had over the window at sizes from a tenth to ten times
today's (L1: CACHE_L1_MAX_BYTES; L2: Redis's maxmemory, or its used memory when it has no
limit), and the smallest of those sizes that reaches 95 % of the best ratio on the curve.
A task's curve is its hit ratio in the tier shared with the other tasks (distances measured in
the stream of all tasks), as the tier of that size would serve it, not as if it had the tier
alone.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from engine.sizing.key_sampler import HOUR_S, KEEP_HOURS, OVERALL, KeySampler, ReuseProfile, hit_ratios
from storage.redis.health import NodeHealth

STEPS_PER_DECADE = 10
GOOD_ENOUGH = 0.95  # "reaches 95 % of the best hit ratio"
FALLBACK_BYTES = 1 << 20  # a curve's centre when a tier has no size (L1 of 0 bytes)


def curve_sizes(current: int) -> list[int]:
    """From current/10 to current*10, STEPS_PER_DECADE points per decade (current included)."""
    centre = max(current, 1) if current > 0 else FALLBACK_BYTES
    steps = range(-STEPS_PER_DECADE, STEPS_PER_DECADE + 1)
    return [max(1, round(centre * 10 ** (k / STEPS_PER_DECADE))) for k in steps]


def redis_fixed_bytes(node: NodeHealth, per_key: float | None) -> int:
    """What a Redis primary holds besides the cache's entries, counted toward its maxmemory: its
    used memory less its keys at the sample's mean bytes a key (`per_key`), and at least what
    INFO names (memory at startup, clients, scripts). That is more than INFO names: a first
    EVAL, a first SUBSCRIBE and the like add a few hundred kB Redis reports nowhere apart,
    which a small maxmemory feels."""
    named = node.fixed_memory or 0
    if per_key is None or node.used_memory is None or node.keys is None:
        return named
    return int(min(node.used_memory, max(named, node.used_memory - node.keys * per_key)))


def tier_curve(
    counts: Any, histogram: dict[int, float], current: int, *, fixed: int = 0, **extra: Any
) -> dict[str, Any]:
    """`fixed`: bytes of each size the tier's entries cannot use (Redis's own memory)."""
    sizes = curve_sizes(current)
    ratios = hit_ratios(counts, histogram, [max(0, s - fixed) for s in sizes])
    best = max(ratios, default=0.0)
    enough = next((s for s, r in zip(sizes, ratios, strict=True) if best > 0 and r >= GOOD_ENOUGH * best),
                  None)  # fmt: skip
    return {
        "current_bytes": current,
        "current_hit_ratio": ratios[STEPS_PER_DECADE],
        "best_hit_ratio": round(best, 4),
        "smallest_bytes_for_95pct_of_best": enough,
        "curve": [{"bytes": s, "hit_ratio": round(r, 4)} for s, r in zip(sizes, ratios, strict=True)],
        **extra,
    }


def profile_report(
    profile: ReuseProfile, *, now: float, window_s: float, l1_bytes: int, l2: dict[str, Any] | None,
    shared: Any = None,
) -> dict[str, Any]:
    """`shared`: a task's counts within the stream of every task (the tiers it shares), for its
    curves; None: the profile's own (the overall stream)."""
    counts, distinct = profile.window(now, window_s)
    requests = counts.requests
    distinct = min(distinct, requests)
    tiers = counts if shared is None else shared
    # What the tiers answered over the same requests, next to the prediction at today's size:
    # L1's hits; L2's curve is of L1 and L2 together (L2 holds what L1 does, and more).
    served_l1 = round(counts.served_l1 / requests, 4) if requests else None
    served = round((counts.served_l1 + counts.served_l2) / requests, 4) if requests else None
    return {
        "requests": requests,
        "distinct_keys": distinct,
        # Share of requests whose input was already used in the window (an unbounded cache's hits).
        "repeat_ratio": round(1 - distinct / requests, 4) if requests else None,
        "l1": tier_curve(tiers, tiers.l1, l1_bytes, observed_hit_ratio=served_l1),
        "l2": (None if l2 is None
               else tier_curve(tiers, tiers.l2, l2["current_bytes"], fixed=l2.get("fixed_bytes", 0),
                               limit_set=l2["limit_set"], fixed_bytes=l2.get("fixed_bytes", 0),
                               observed_hit_ratio=served)),
        "sample": {"tracked_keys": profile.tracked(), "rate": round(profile.rate, 6)},
    }


def sizing_report(
    sampler: KeySampler, *, window_s: float, l1_bytes: int, l2: dict[str, Any] | None
) -> dict[str, Any]:
    """`l2`: {"current_bytes", "limit_set"} of Redis, or None without L2. A window longer than
    the sampler keeps (7 days) is cut to that (`window_s` says so)."""
    window_s = min(window_s, KEEP_HOURS * HOUR_S)
    now = sampler.now()
    profiles = sampler.profiles()
    args = {"now": now, "window_s": window_s, "l1_bytes": l1_bytes, "l2": l2}
    everyone, _ = profiles[OVERALL].window(now, window_s)
    return {
        "window_s": window_s,
        "tasks": {
            task: profile_report(p, **args, shared=everyone.task(task))
            for task, p in sorted(profiles.items())
            if task != OVERALL
        },
        "overall": profile_report(profiles[OVERALL], **args),
        "method": "SHARDS sampled reuse distances (bytes); LRU; a reuse later than the tier's TTL is a miss",
        # The sampler's own cost: its CPU budget's rate, uses dropped on a full queue, CPU seconds.
        "sampler": asdict(sampler.stats()),
    }
