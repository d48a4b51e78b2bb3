"""Scenarios of operations: the request log locked, the admin API brute-forced."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections import Counter
from typing import Any

import httpx

from faults.client import http_json
from faults.config import PREFIX, TOKEN
from faults.harness import (
    Run,
    latency_ms,
)


def log_locked(run: Run) -> None:
    """Another writer holds A's SQLite request log (BEGIN EXCLUSIVE) for seconds, under load on A."""
    ctx, sizes = run.ctx, run.ctx.sizes
    a = ctx.apps[0]
    base = ctx.admin(0, "GET", "/admin/api/stats?window=5m")["log_writer"]
    blocker = sqlite3.connect(a.sqlite_path, timeout=10.0)
    with run.load(ctx.pool, [0], failover=False):
        time.sleep(sizes.phase_s / 2)
        blocker.execute("BEGIN EXCLUSIVE")
        locked_at = time.monotonic()
        time.sleep(sizes.lock_s)
        blocker.rollback()
        released_at = time.monotonic()
        time.sleep(sizes.phase_s / 2)
    blocker.close()
    sent_to_a = sum(1 for o in run.observations if o.replica == 0 and o.outcome.kind != "unreachable")
    deadline, stats = time.monotonic() + 60, base
    while time.monotonic() < deadline:
        stats = ctx.admin(0, "GET", "/admin/api/stats?window=5m")["log_writer"]
        accounted = stats["written"] - base["written"] + stats["dropped"] - base["dropped"]
        if stats["queued"] == 0 and accounted >= sent_to_a:
            break
        time.sleep(0.5)
    written = stats["written"] - base["written"]
    dropped = stats["dropped"] - base["dropped"]
    during = run.between(locked_at, released_at)
    worst = max((o.done_at - o.sent_at for o in during), default=0.0)
    worst_engine = max((latency_ms(o) / 1000 for o in during), default=0.0)
    for o in during:
        if latency_ms(o) / 1000 > 1.5:
            run.downgrade(
                o, "failed", f"took {latency_ms(o) / 1000:.2f}s in the engine while the log was locked"
            )
    run.figure("lock held", f"{released_at - locked_at:.1f}s")
    run.figure(
        "requests while locked",
        f"{len(during)} (slowest {worst:.2f}s end to end, {worst_engine:.3f}s engine)",
    )
    run.figure("log rows: requests / written / dropped", f"{sent_to_a} / {written} / {dropped}")
    run.figure("failed write attempts (retried)", stats["failed_batches"] - base["failed_batches"])
    run.check("requests were served while the log was locked", len(during) > 0)
    run.check("the writer met the lock", stats["failed_batches"] > base["failed_batches"])
    run.check(
        "every request's row written or counted as dropped",
        written + dropped == sent_to_a,
        f"{written} + {dropped} vs {sent_to_a}",
    )


def admin_bruteforce(run: Run) -> None:
    """Wrong admin tokens from one client (127.0.0.2): all refused, locked out, nothing changed."""
    ctx, sizes = run.ctx, run.ctx.sizes
    a = ctx.apps[0]
    cached = ctx.probe_case()
    run.send(cached, 0)
    run.send(cached, 0)

    expiring: dict[bytes, float] = {}  # keys with a TTL at the start -> when they may expire

    def state() -> dict[str, Any]:
        # A key that expires on its own meanwhile (an earlier scenario's short-lived entry) is
        # not a change: keys are compared as the set present, less those whose TTL ran out.
        now = time.monotonic()
        with contextlib.closing(ctx.direct) as direct:
            keys = set(direct.scan_iter(match=f"{PREFIX}:*", count=500))
            if not expiring:
                for key in keys:
                    ttl_ms = direct.pttl(key)
                    if ttl_ms is not None and ttl_ms >= 0:
                        expiring[key] = now + ttl_ms / 1000.0
        with contextlib.closing(sqlite3.connect(f"file:{a.sqlite_path}?mode=ro", uri=True)) as db:
            audit = db.execute("SELECT COUNT(*) FROM admin_audit").fetchone()[0]
        generations = [httpx.get(app.url + "/readyz", timeout=5).json()["generation"] for app in ctx.apps]
        return {"redis keys": len(keys), "audit rows": audit, "generations": generations, "keyset": keys}

    before = state()
    # Authorization header values (bytes: some are not ASCII), all wrong.
    wrong: list[bytes] = [
        b"Bearer x",
        f"Bearer {TOKEN[:-1]}".encode(),
        f"Bearer {TOKEN}x".encode(),
        f"Bearer {TOKEN.upper()}".encode(),
        f"Bearer {TOKEN[::-1]}".encode(),
        f"Basic {TOKEN}".encode(),
        f"Token {TOKEN}".encode(),
        f"Bearer{TOKEN}".encode(),
        b"Bearer null",
        b"Bearer " + b"a" * 10_000,
        f"Bearer {TOKEN.replace('-', '_')}".encode(),
        b"Bearer ' OR '1'='1",
        f"Bearer {TOKEN}\u00e9".encode(),
        b"Bearer \xff\xfe",
        b"",
    ]
    endpoints = [
        ("POST", "/admin/api/flush", {"tier": "all"}),
        ("POST", "/admin/api/bump-version", {}),
        ("GET", "/admin/api/stats", None),
    ]
    statuses: list[int] = []
    attacker = httpx.Client(
        base_url=a.url, timeout=30.0, transport=httpx.HTTPTransport(local_address="127.0.0.2")
    )
    with attacker:
        for i in range(sizes.brute_attempts):
            method, path, body = endpoints[i % len(endpoints)]
            authorization = wrong[i % len(wrong)]
            headers: dict[str, Any] = {"Authorization": authorization} if authorization else {}
            if i % 2:  # a forged client address must not reset the count
                headers["X-Forwarded-For"] = f"10.{i % 250}.0.1"
            try:
                status, _ = http_json(attacker, method, path, token=None, body=body, headers=headers)
            except httpx.HTTPError as exc:
                run.count_extra("failed", f"attempt {i}: {exc!r}")
                continue
            statuses.append(status)
            if status == 200:
                run.count_extra("wrong", f"attempt {i} ({authorization[:30]!r}) accepted: {method} {path}")
            elif status >= 500:
                run.count_extra("failed", f"attempt {i} ({authorization[:30]!r}): HTTP {status}")
            else:
                run.count_extra("ok")
        right_while_locked, _ = http_json(attacker, "GET", "/admin/api/stats")
    with httpx.Client(base_url=a.url, timeout=30.0) as client:
        operator, _ = http_json(client, "GET", "/admin/api/stats?window=5m")
    after = state()
    # What was there and had not expired by the end must still be there; nothing new may appear.
    ended = time.monotonic()
    start_keys, present = before.pop("keyset"), after.pop("keyset")
    removed = {key for key in start_keys - present if expiring.get(key, float("inf")) > ended}
    added = present - start_keys
    keys_changed = bool(removed or added)
    hit = run.send(cached, 0)
    first_429 = next((i + 1 for i, s in enumerate(statuses) if s == 429), None)
    run.figure("attempts", f"{len(statuses)}: {dict(Counter(statuses))}")
    run.figure("first 429 at attempt", first_429)
    run.figure("state before / after", f"{before} / {after}")
    run.check("no wrong token accepted", 200 not in statuses)
    run.check(
        "rate limiting engaged within 5 attempts", first_429 is not None and first_429 <= 5, str(first_429)
    )
    run.check(
        "every attempt after the first 429 refused with 429",
        first_429 is not None and set(statuses[first_429 - 1 :]) == {429},
    )
    run.check(
        "the right token from the locked-out client is refused too",
        right_while_locked == 429,
        str(right_while_locked),
    )
    run.check("the operator on another address is unaffected", operator == 200, str(operator))
    same = before["audit rows"] == after["audit rows"] and before["generations"] == after["generations"]
    detail = f"{before} -> {after}; keys removed {sorted(removed)[:3]}, added {sorted(added)[:3]}"
    run.check("no state changed (keys, audit log, generation)", same and not keys_changed, detail)
    run.check("cached entry still served from memory", (hit.outcome.info or {}).get("tier") == "l1")
