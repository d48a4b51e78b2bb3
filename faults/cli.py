"""The command line: `python -m faults [--quick] [--only NAME,...] [--list] [--keep]`."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import faults
from faults.config import FULL, QUICK
from faults.harness import ScenarioResult, build_context
from faults.report import describe, summary_line, table
from faults.scenarios import SCENARIOS, run_scenario


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m faults", description=faults.__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="every scenario, briefly (a few minutes)")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (app logs)")
    args = parser.parse_args(argv)
    if args.list:
        for scenario in SCENARIOS:
            print(f"{scenario.name:28} {scenario.title}")
        return 0
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only.split(",")]
    if not chosen:
        parser.error(f"no scenario named {args.only!r}; see --list")
    sizes = QUICK if args.quick else FULL
    # SIGTERM (a CI timeout, `kill`): unwind normally, so the apps and Redis are stopped and the
    # work directory is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="infcache-faults-"))
    print(
        f"fault suite ({sizes.label}): {len(chosen)} scenarios, {os.cpu_count()} CPUs, work dir {work}",
        flush=True,
    )
    started = time.monotonic()
    results: list[ScenarioResult] = []
    ctx = build_context(sizes, work, log=lambda line: print(line, flush=True))
    try:
        for index, scenario in enumerate(chosen):
            ctx.remaining = len(chosen) - index - 1
            result = run_scenario(ctx, scenario)
            results.append(result)
            print(describe(result), flush=True)
    finally:
        ctx.close()
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(results))
    checks_failed = [(r.name, c) for r in results for c in r.checks_failed]
    crashed = [r.name for r in results if r.error]
    passed = sum(len(r.checks) for r in results) - len(checks_failed)
    print(
        f"\nchecks: {passed} passed, {len(checks_failed)} failed"
        + (f"; crashed: {', '.join(crashed)}" if crashed else "")
        + f"; {time.monotonic() - started:.0f}s in all"
    )
    for name, check in checks_failed:
        print(f"  FAIL {name}: {check.name}" + (f" ({check.detail})" if check.detail else ""))
    print(summary_line(results))
    return 0 if all(r.passed for r in results) else 1
