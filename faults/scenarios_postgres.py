"""Scenarios of the shared request-log database: PostgreSQL restarted under load.

App B writes its request log to the suite's PostgreSQL server (`Context.postgres`); A keeps
SQLite. The log is telemetry written off the request path, so a database outage must cost
no request anything, and every request's row must be written once the database is back, or
dropped and counted (`infcache_log_rows_dropped`, the writer's `dropped`), never lost unseen.
"""

from __future__ import annotations

import contextlib
import time

import psycopg

from faults.harness import Run, latency_ms, tiers

B = 1  # the replica whose request log is on PostgreSQL


def _rows_in_postgres(run: Run) -> int:
    postgres = run.ctx.postgres
    assert postgres is not None
    with contextlib.closing(psycopg.connect(postgres.dsn("infcache"), connect_timeout=10)) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM request_log").fetchone()[0])


def postgres_restarted(run: Run) -> None:
    """PostgreSQL stopped as if it crashed (immediate shutdown: connections cut, no checkpoint)
    under load on A and B, down for `outage_s`, then started again on the same port and data."""
    ctx, sizes = run.ctx, run.ctx.sizes
    postgres = ctx.postgres
    if postgres is None:
        raise RuntimeError("the suite started no PostgreSQL server (Context.postgres)")
    base = ctx.admin(B, "GET", "/admin/api/stats?window=5m")["log_writer"]
    rows_before = _rows_in_postgres(run)
    sent_from = time.monotonic()
    with run.load(ctx.pool, [0, B], failover=False):
        time.sleep(sizes.phase_s / 2)
        down_at = time.monotonic()
        postgres.stop("immediate")
        time.sleep(sizes.outage_s)
        postgres.start()
        up_at = time.monotonic()
        time.sleep(sizes.phase_s / 2)
    sent_to_b = sum(
        1 for o in run.observations
        if o.replica == B and o.sent_at >= sent_from and o.outcome.kind != "unreachable"
    )  # fmt: skip
    # B's writer retries with backoff (up to 1 s apart): wait until every row is accounted for.
    deadline, stats, drained_s = time.monotonic() + 60, base, None
    while time.monotonic() < deadline:
        stats = ctx.admin(B, "GET", "/admin/api/stats?window=5m")["log_writer"]
        accounted = stats["written"] - base["written"] + stats["dropped"] - base["dropped"]
        if stats["queued"] == 0 and accounted >= sent_to_b:
            drained_s = time.monotonic() - up_at
            break
        time.sleep(0.25)
    written = stats["written"] - base["written"]
    dropped = stats["dropped"] - base["dropped"]
    rows_added = _rows_in_postgres(run) - rows_before
    during = [o for o in run.between(down_at, up_at) if o.replica == B]
    slowest_engine = max((latency_ms(o) / 1000 for o in during), default=0.0)
    for o in during:  # the log is off the request path: an outage must not slow a request down
        if latency_ms(o) / 1000 > 1.5:
            run.downgrade(o, "failed", f"{latency_ms(o) / 1000:.2f}s in the engine while PostgreSQL was down")
    run.result.recovery_s = drained_s
    run.figure("PostgreSQL down", f"{up_at - down_at:.1f}s (immediate shutdown, then started again)")
    run.figure("B's requests while it was down",
               f"{len(during)} {tiers(during)}, slowest {slowest_engine:.3f}s engine")  # fmt: skip
    run.figure("B's log rows: requests / written / dropped", f"{sent_to_b} / {written} / {dropped}")
    run.figure("rows that reached PostgreSQL", rows_added)
    run.figure("failed write attempts (retried)", stats["failed_batches"] - base["failed_batches"])
    run.check("B served requests while PostgreSQL was down", len(during) > 0)
    run.check("B's writer met the outage", stats["failed_batches"] > base["failed_batches"])
    run.check("every request's row written or counted as dropped", written + dropped == sent_to_b,
              f"{written} + {dropped} vs {sent_to_b}")  # fmt: skip
    run.check("rows counted as written are in PostgreSQL, once", rows_added == written,
              f"{rows_added} in the table vs {written} written")  # fmt: skip
    summary = ctx.admin(B, "GET", "/admin/api/stats?window=5m")["summary"]
    run.check("B's console reads the restarted database", summary["total"] >= written, str(summary["total"]))
