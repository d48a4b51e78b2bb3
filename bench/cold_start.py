"""How long `make run` takes to be ready: `python -m bench.cold_start [--runs 3] [--second-only DIR]`.

Starts `python app.py` (the embedded defaults: a private redis-server if installed, SQLite and
the ONNX exports in DATA_DIR) as a subprocess on a free port: first with a fresh DATA_DIR (a
first start, which exports the ONNX graphs), then `--runs` times again on the same DATA_DIR
(a second start, which reuses them). For each start: the seconds from the launch to the first
200 of /healthz (listening) and of /readyz (ready), the first request (a text message over REST,
a miss) and the start-up phases the log names (common.startup_clock's `start-up: <phase>: N s`
lines, plus the ONNX export and session lines). Prints the load average before and after: on
a shared machine a start takes what the other processes leave it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300.0
PHASE = re.compile(r"start-up: (?P<name>.+?): (?P<s>[\d.]+) s \(at (?P<at>[\d.]+) s\)")
OTHER = (  # (label, pattern with a name and a seconds group)
    ("onnx export: {0}", re.compile(r"exported (\S+) \S+ to ONNX in ([\d.]+) s")),
    ("onnx session: {0}",
     re.compile(r"reusing the ONNX export \S*/(\S+?)-[0-9a-f]{16}-\S* \(session in ([\d.]+) s\)")),
    ("onnx session and probe: {0}",
     re.compile(r"(\S+) \S+: served by onnxruntime \(session and probe in ([\d.]+) s\)")),
)  # fmt: skip


@dataclass
class Start:
    healthz_s: float
    readyz_s: float
    first_request_s: float
    phases: dict[str, float] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def one_start(data_dir: Path, log_path: Path) -> Start:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("ADMIN_TOKEN", "DATABASE_URL", "ONNX_EXPORT_DIR",
                                                             "REDIS_URL", "PORT", "DATA_DIR")}  # fmt: skip
    env.update(PORT=str(port), DATA_DIR=str(data_dir), GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        launched = time.monotonic()
        process = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    healthz = readyz = None
    try:
        with httpx.Client(timeout=30) as client:
            while readyz is None:
                if process.poll() is not None:
                    raise RuntimeError(f"app.py exited:\n{log_path.read_text(errors='replace')[-3000:]}")
                if time.monotonic() - launched > TIMEOUT_S:
                    raise RuntimeError(f"not ready within {TIMEOUT_S:.0f} s")
                try:
                    if healthz is None and client.get(f"{base}/healthz").status_code == 200:
                        healthz = time.monotonic() - launched
                    if healthz is not None and client.get(f"{base}/readyz").status_code == 200:
                        readyz = time.monotonic() - launched
                except httpx.TransportError:
                    pass
                if readyz is None:
                    time.sleep(0.05)
            body = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES",
                                "data": [f"where is my parcel {time.time_ns()}"]}]}  # fmt: skip
            started = time.monotonic()
            answer = client.post(f"{base}/v2/models/text/infer", json=body)
            first = time.monotonic() - started
            answer.raise_for_status()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert healthz is not None
    return Start(healthz, readyz, first, phases(log_path.read_text(errors="replace")))


def phases(log: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in log.splitlines():
        if (match := PHASE.search(line)) is not None:
            found[match["name"]] = float(match["s"])
            continue
        for label, pattern in OTHER:
            if (match := pattern.search(line)) is not None:
                found[label.format(match[1])] = float(match[2])
    return found


def report(title: str, starts: list[Start]) -> None:
    def summary(values: list[float]) -> str:
        if len(values) == 1:
            return f"{values[0]:6.2f}"
        return f"{statistics.median(values):6.2f} (min {min(values):.2f}, max {max(values):.2f})"

    print(f"\n{title}: {len(starts)} start(s); seconds, median over the starts")
    print(f"  {'/healthz 200 (listening)':<58} {summary([s.healthz_s for s in starts])}")
    print(f"  {'/readyz 200 (ready)':<58} {summary([s.readyz_s for s in starts])}")
    print(f"  {'first request (a text miss over REST)':<58} {summary([s.first_request_s for s in starts])}")
    names = list(dict.fromkeys(name for s in starts for name in s.phases))
    for name in names:
        values = [s.phases[name] for s in starts if name in s.phases]
        print(f"    {name:<56} {summary(values)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="second starts (reusing the exports)")
    parser.add_argument("--second-only", type=Path, default=None,
                        help="a DATA_DIR with exports already in it: only second starts")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the DATA_DIR and the logs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    data_dir = args.second_only or work / "data"
    print(f"python app.py, {os.cpu_count()} cores; load average {load_average()} (1, 5, 15 min)")
    try:
        if args.second_only is None:
            first = one_start(data_dir, work / "first.log")
            report("first start (fresh DATA_DIR: exports the ONNX graphs)", [first])
        seconds = [one_start(data_dir, work / f"second-{n}.log") for n in range(args.runs)]
        report("second start (same DATA_DIR: reuses the exports)", seconds)
    finally:
        print(f"\nload average after: {load_average()}")
        if args.keep:
            print(f"logs and data in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
