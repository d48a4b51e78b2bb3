"""The report of a run: one block per scenario, the table, the SUMMARY line."""

from __future__ import annotations

from collections.abc import Sequence

from bench.models import format_table
from faults.harness import ScenarioResult, fmt_s


def describe(result: ScenarioResult) -> str:
    lines = [f"== {result.name}: {result.title} ({result.duration_s:.1f}s)"]
    lines.append(
        f"   requests: sent {result.sent}, succeeded {result.succeeded}, failed {result.failed}, "
        f"wrong {result.wrong}, retried on the other replica {result.retried}"
        + (f", recovery {fmt_s(result.recovery_s)}" if result.recovery_s is not None else "")
    )
    for name, value in result.figures.items():
        lines.append(f"   {name}: {value}")
    for check in result.checks:
        lines.append(
            f"   [{'ok' if check.ok else 'FAIL'}] {check.name}"
            + (f" ({check.detail})" if check.detail else "")
        )
    for problem in result.problems:
        lines.append(f"   ! {problem}")
    if result.error:
        lines.append(f"   ! the scenario crashed: {result.error}")
    return "\n".join(lines)


def table(results: Sequence[ScenarioResult]) -> str:
    rows = [
        [
            r.name,
            str(r.sent),
            str(r.succeeded),
            str(r.failed),
            str(r.wrong),
            str(r.retried),
            "n/a" if r.recovery_s is None else f"{r.recovery_s:.2f}",
            f"{sum(c.ok for c in r.checks)}/{len(r.checks)}" + (" crashed" if r.error else ""),
        ]
        for r in results
    ]
    headers = ["scenario", "sent", "succeeded", "failed", "wrong", "retried", "recovery s", "checks"]
    return format_table(headers, rows)


def summary_line(results: Sequence[ScenarioResult]) -> str:
    failed = sum(r.failed for r in results)
    wrong = sum(r.wrong for r in results)
    return f"SUMMARY scenarios={len(results)} failed_requests={failed} wrong_results={wrong}"
