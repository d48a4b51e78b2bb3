"""bench.remote in quick mode, on the session's exported repository: it runs end to end (a real
tritonserver with and one without Triton's response cache, two replicas of each fleet as their own
processes on a real redis-server, the real tritonclient) and the figures it prints are the servers'
own counters: rows that reached the remote server per distinct input (the fleet's single flight:
exactly one), and Triton's response cache calls plus hits adding up to the requests sent to it.

Four app processes and two Triton servers start: about a minute on a quiet machine (its cost is
start-up; the stream is short)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from bench.remote import QUICK, SIDES, print_report, run

pytestmark = pytest.mark.timeout(900)


def test_the_quick_run_prints_what_the_servers_counted(
    triton_repository: Path, onnx_export_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = run(QUICK, repository=triton_repository, export_dir=onnx_export_dir, log=lambda _: None)
    assert {name: side.requests for name, side in report.sides.items()} == dict.fromkeys(
        SIDES, QUICK.requests
    )
    assert report.disagreements == []  # remote, local and Triton's cache gave every input one answer
    # One remote row per distinct input, fleet-wide: the replicas' misses, and nothing for their hits.
    assert report.remote_rows == report.unique
    for fleet in ("remote", "local"):  # one answer computed per distinct input, the rest cached
        assert Counter(report.sides[fleet].tiers)["miss"] == report.unique_total, fleet
    # Triton's response cache: each request reached the model or was a hit, nothing else.
    triton_side = report.sides["triton-cache"]
    assert sum(report.triton_rows.values()) + sum(report.triton_hits.values()) == triton_side.requests
    assert sum(report.triton_hits.values()) > 0
    print_report(report)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    figures = dict(pair.split("=") for pair in re.findall(r"\w+=[\d.na]+", summary))
    assert summary.startswith("SUMMARY ")
    assert float(figures["remote_calls_per_unique"]) == pytest.approx(
        sum(report.remote_rows.values()) / report.unique_total, abs=1e-3
    )
    assert float(figures["remote_calls_per_unique"]) == pytest.approx(1.0)
    assert float(figures["triton_calls_per_unique"]) == pytest.approx(
        sum(report.triton_rows.values()) / report.unique_total, abs=1e-3
    )
    for key in ("hit_p50_remote_vs_local", "cpu_remote_vs_local"):
        assert float(figures[key]) > 0
