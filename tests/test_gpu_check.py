"""The GPU check (bench.gpu_check, scripts/gpu_check.sh) on a machine without CUDA: its CPU
dry run prints a sane SUMMARY line, and without `--device cpu` it refuses in one line.

Both run as subprocesses with CUDA hidden, so a GPU machine runs the same (short) tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(
    r"SUMMARY gpu=(?P<gpu>\S+) image_batched_vs_1=(?P<image>\d+\.\d\d) "
    r"text_batched_vs_1=(?P<text>\d+\.\d\d) fp16_top1_agreement=(?P<agreement>\d\.\d\d\d)"
)


def run_hidden_cuda(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_cpu_dry_run_ends_with_a_sane_summary() -> None:
    command = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--threads", "1"]
    proc = run_hidden_cuda(command, 120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = SUMMARY.fullmatch(last)
    assert match, f"last line is not the SUMMARY: {last!r}"
    assert match["gpu"] == "cpu_dry_run"
    assert float(match["image"]) > 0 and float(match["text"]) > 0
    assert 0.0 <= float(match["agreement"]) <= 1.0
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("SUMMARY") == 1
    for step in ("1. engine", "2. miss throughput", "3. Zipf run", "4. fp16 against fp32"):
        assert step in proc.stdout


def test_without_cuda_the_script_exits_non_zero_with_one_line() -> None:
    proc = run_hidden_cuda(["bash", str(ROOT / "scripts" / "gpu_check.sh")], 60)
    assert proc.returncode != 0
    assert "SUMMARY" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpu_check: CUDA is not available") and "--device cpu" in lines[0]
