"""A newcomer's first start: `PORT=... make run`, as the README says, ends its log with the URL
to open, after naming the data directory, the ONNX exports and the request log as absolute
paths; the URL answers with the page."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
START_S = 300.0


def test_make_run_takes_the_port_and_ends_with_the_url_to_open(tmp_path: Path) -> None:
    port = free_port()
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("ADMIN_TOKEN", "DATABASE_URL", "ONNX_EXPORT_DIR")}
    env.update(PORT=str(port), DATA_DIR=str(data_dir), REDIS_URL="off", GRADIO_ANALYTICS_ENABLED="False",
               PYTHONUNBUFFERED="1")  # fmt: skip
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(["make", "--no-print-directory", "run"], cwd=ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + START_S
        text = ""
        while "ready: open" not in text:
            assert process.poll() is None, f"make run exited:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"no 'ready' line within {START_S:.0f} s:\n{text[-3000:]}"
            time.sleep(0.5)
            text = log_path.read_text(errors="replace")
        time.sleep(0.5)  # anything logged right after the line would show below
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        url = f"http://localhost:{port}/"
        assert f"ready: open {url}" in lines[-1], lines[-3:]
        assert "token printed above" in lines[-1]
        token_line = next(line for line in lines if "admin token is:" in line)
        assert lines.index(token_line) < len(lines) - 1
        paths = re.search(r"data directory: (\S+); ONNX exports: (\S+); request log: (\S+)", lines[-2])
        assert paths is not None, lines[-2]
        named = [Path(p) for p in paths.groups()]
        assert all(p.is_absolute() for p in named), named
        assert named[0] == data_dir.resolve() and named[1] == data_dir.resolve() / "onnx"
        assert named[2].is_file() and named[2].parent == data_dir.resolve()
        assert any(named[1].iterdir()), "the ONNX exports are where the line says"
        # A first start exports the graphs: the log says what, for about how long, then how long it took.
        for name in ("efficientnet-lite0", "all-MiniLM-L6-v2-intents"):
            assert re.search(rf"exporting {name} \S+ to ONNX \(once per model version, then reused; ~\d+ s\)",
                             text), name  # fmt: skip
            done = re.search(rf"exported {name} \S+ to ONNX in [\d.]+ s \(\d+ MB\) → (\S+)", text)
            assert done is not None and Path(done[1]).parent == named[1], name
        assert re.search(r"start-up: ready: [\d.]+ s", text)
        page = httpx.get(url, timeout=30)
        assert page.status_code == 200 and "<html" in page.text.lower()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
