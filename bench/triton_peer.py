"""A cached hit of this app's REST door against NVIDIA Triton's own response cache, one client.

`python -m bench.triton_peer [--requests 1000] [--rounds 5] [--warmup 200]` (`make bench-triton`):

- **ours**: `python app.py` (REDIS_URL=off, the built-in models) in its own process, as
  bench.cached_routes starts it; requests to `/v2/models/<task>/infer`.
- **Triton**: a real `tritonserver` 2.51 (nvidia-pytriton 0.7.0, CPU) started by
  bench/triton_server.py in its own venv (scripts/triton_venv.sh, created on demand), with the
  local response cache on (`--cache-config local,size=64 MiB`, `response_cache` on each model).
  Its models are Python callables with the app's /v2 signature that answer fixed labels, not a
  real model's: only hits are measured, and a hit never reaches them (their calls are counted).

The same `tritonclient.http` request goes to both, one keep-alive client each: one BYTES
input `input` of shape [1] (a support message; chelsea.png's bytes), outputs `label` and
`score`, in JSON tensors (`binary_data=False` on input and outputs; the image base64 with the
tensor parameter `content_type: base64`, which tritonclient has no public setter for) or in
Triton's binary tensor extension (`binary_data=True`, tritonclient's default). Each row warms
both servers (the first request is a miss on each), then rounds interleave ours and Triton's
batches of N hits, alternating who goes first. Per row: p50 and p99 of the client's latency
over every hit, and server CPU per hit (user + sys of the server's process tree over each
batch, from /proc via psutil, summed over rounds / hits): for ours the app's process, for
Triton the `tritonserver` process and its children (its Python-backend stubs), not PyTriton's
own Python process, which runs the callables and is shown apart. Every answer of ours is
checked to be a hit (`tier` l1); Triton's cache hit count comes from its statistics API.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.cached_routes import start_app
from storage.redis.embedded import free_port
from testing.triton_server import TritonProcess, TritonSetupError, triton_python

ROOT = Path(__file__).resolve().parent.parent
SERVER_SCRIPT = ROOT / "bench" / "triton_server.py"
MESSAGE = "Where is my parcel? It was supposed to arrive on Monday."
TASKS = ("text", "image")
ENCODINGS = ("json", "binary")
TARGET_P50 = 1.25  # ours / Triton, at most
TARGET_CPU = 2.0
TritonPeerError = TritonSetupError  # the Triton side could not be set up; the message says what happened


class TritonPeer:
    """bench/triton_server.py in the Triton venv: tritonserver on free loopback ports."""

    def __init__(self, python: Path, log_path: Path) -> None:
        self.ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
        self.log_path = log_path
        args = ["--http-port", str(self.ports["http"]), "--grpc-port", str(self.ports["grpc"]),
                "--metrics-port", str(self.ports["metrics"])]  # fmt: skip
        self._process = TritonProcess(python, SERVER_SCRIPT, args, log_path)
        self.process = self._process.process
        servers = [p for p in psutil.Process(self.process.pid).children(recursive=True)
                   if p.name() == "tritonserver"]  # fmt: skip
        if not servers:
            self.close()
            raise TritonPeerError("triton_server.py is ready but no tritonserver process runs under it")
        self.server = servers[0]
        self.url = f"127.0.0.1:{self.ports['http']}"

    def log_tail(self, lines: int = 25) -> str:
        return self._process.log_tail(lines)

    def callable_calls(self) -> dict[str, int]:
        """How many times each bound Python callable has run (a hit must not run it)."""
        return self._process.request({"op": "calls"})["calls"]

    def cpu_s(self) -> float:
        """user + sys seconds of tritonserver and its children (the Python-backend stubs)."""
        return tree_cpu_s(self.server)

    def host_cpu_s(self) -> float:
        """PyTriton's own Python process (it runs the callables; not counted as the server's)."""
        return _own_cpu_s(psutil.Process(self.process.pid))

    def close(self) -> None:
        self._process.close()


def _own_cpu_s(process: psutil.Process) -> float:
    cpu = process.cpu_times()
    return cpu.user + cpu.system


def tree_cpu_s(process: psutil.Process) -> float:
    total = _own_cpu_s(process)
    for child in process.children(recursive=True):
        try:
            total += _own_cpu_s(child)
        except psutil.NoSuchProcess:
            pass
    return total


# ---- requests ---------------------------------------------------------------------------


@dataclass
class Row:
    task: str
    encoding: str
    ours_ms: list[float] = field(default_factory=list)
    theirs_ms: list[float] = field(default_factory=list)
    ours_cpu_s: float = 0.0
    theirs_cpu_s: float = 0.0
    theirs_host_cpu_s: float = 0.0
    hits: int = 0  # per side

    @property
    def name(self) -> str:
        return f"{self.task}, {self.encoding}"


def request_of(encoding: str, raw: str | bytes) -> tuple[list[Any], list[Any]]:
    """The tritonclient inputs and outputs of one request in the app's /v2 signature (a message, or
    an image's file bytes), in JSON or binary tensors; the same objects may go to several servers."""
    import tritonclient.http as triton

    binary = encoding == "binary"
    tensor = triton.InferInput("input", [1], "BYTES")
    if isinstance(raw, str):
        tensor.set_data_from_numpy(np.array([raw.encode()], dtype=object), binary_data=binary)
    elif binary:
        tensor.set_data_from_numpy(np.array([raw], dtype=object), binary_data=True)
    else:
        # JSON carries text only: the image goes base64, and the app needs to be told so. tritonclient
        # (2.73) has no public setter for a tensor's parameters, hence its private dict.
        tensor.set_data_from_numpy(np.array([base64.b64encode(raw)], dtype=object), binary_data=False)
        tensor._parameters["content_type"] = "base64"
    outputs = [triton.InferRequestedOutput(name, binary_data=binary) for name in ("label", "score")]
    return [tensor], outputs


def hits(client: Any, task: str, request: tuple[list[Any], list[Any]], n: int, *, ours: bool) -> list[float]:
    """n requests, one at a time; each one's latency in ms. Ours must all be hits."""
    inputs, outputs = request
    latencies = []
    for _ in range(n):
        started = time.perf_counter_ns()
        result = client.infer(task, inputs, outputs=outputs)
        latencies.append((time.perf_counter_ns() - started) / 1e6)
        if ours and result.get_response()["parameters"].get("tier") != "l1":
            raise RuntimeError(f"not an L1 hit: {result.get_response()['parameters']}")
    return latencies


def first_answer(client: Any, task: str, request: tuple[list[Any], list[Any]]) -> tuple[Any, Any]:
    inputs, outputs = request
    result = client.infer(task, inputs, outputs=outputs)
    return result.as_numpy("label")[0][:2].tolist(), result.as_numpy("score")[0][:2].tolist()


def cache_hits(client: Any) -> dict[str, int]:
    """Triton's response-cache hit count per model (its statistics API)."""
    counts = {}
    for task in TASKS:
        stats = client.get_inference_statistics(task)["model_stats"][0]["inference_stats"]
        counts[task] = int(stats["cache_hit"]["count"])
    return counts


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def run(args: argparse.Namespace) -> None:
    import skimage
    import tritonclient.http as triton

    photo = (Path(skimage.__file__).parent / "data" / "chelsea.png").read_bytes()
    python = triton_python()
    load_before = os.getloadavg()
    started_at = dt.datetime.now(dt.UTC)
    rows = [Row(task, encoding) for task in TASKS for encoding in ENCODINGS]
    with tempfile.TemporaryDirectory() as workdir:
        peer = TritonPeer(python, Path(workdir) / "tritonserver.log")
        app, url = None, ""
        try:
            app, url = start_app(Path(workdir) / "app-data")
            ours_pid = psutil.Process(app.pid)
            ours = triton.InferenceServerClient(url.removeprefix("http://"), connection_timeout=60,
                                                network_timeout=60)  # fmt: skip
            theirs = triton.InferenceServerClient(peer.url, connection_timeout=60, network_timeout=60)
            print(f"tritonserver pid {peer.server.pid} (its log: {peer.log_path}); app pid {app.pid}, {url}")
            requests = {row.name: request_of(row.encoding, MESSAGE if row.task == "text" else photo)
                        for row in rows}  # fmt: skip
            for row in rows:
                request = requests[row.name]
                print(f"{row.name}: first answers: ours {first_answer(ours, row.task, request)}, "
                      f"Triton {first_answer(theirs, row.task, request)}")  # fmt: skip
                hits(ours, row.task, request, args.warmup, ours=True)
                hits(theirs, row.task, request, args.warmup, ours=False)
            calls_before, hits_before = peer.callable_calls(), cache_hits(theirs)
            for round_index in range(args.rounds):
                for row in rows:
                    request = requests[row.name]
                    order = (True, False) if round_index % 2 == 0 else (False, True)
                    for is_ours in order:
                        if is_ours:
                            before = tree_cpu_s(ours_pid)
                            row.ours_ms += hits(ours, row.task, request, args.requests, ours=True)
                            row.ours_cpu_s += tree_cpu_s(ours_pid) - before
                        else:
                            before, host_before = peer.cpu_s(), peer.host_cpu_s()
                            row.theirs_ms += hits(theirs, row.task, request, args.requests, ours=False)
                            row.theirs_cpu_s += peer.cpu_s() - before
                            row.theirs_host_cpu_s += peer.host_cpu_s() - host_before
                    row.hits += args.requests
            calls_after, hits_after = peer.callable_calls(), cache_hits(theirs)
            ours.close()
            theirs.close()
        except TritonPeerError:
            raise
        except Exception:
            print(f"Triton's log ends:\n{peer.log_tail()}", file=sys.stderr)
            raise
        finally:
            if app is not None:
                app.terminate()
                app.wait(timeout=30)
            peer.close()
    load_after = os.getloadavg()
    report(
        args,
        rows,
        started_at,
        (load_before, load_after),
        (calls_before, calls_after),
        (hits_before, hits_after),
    )


def report(
    args: argparse.Namespace,
    rows: list[Row],
    started_at: dt.datetime,
    loads: tuple[tuple[float, float, float], tuple[float, float, float]],
    calls: tuple[dict[str, int], dict[str, int]],
    cache_hit_counts: tuple[dict[str, int], dict[str, int]],
) -> None:
    (load_before, load_after), (calls_before, calls_after) = loads, calls
    hits_before, hits_after = cache_hit_counts
    print()
    print(f"{started_at:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs; load average before "
          f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after "
          f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")  # fmt: skip
    print(f"{args.rounds} rounds x {args.requests} hits per row and side (interleaved), after {args.warmup} "
          "warm-up requests; one tritonclient.http client per server, one request at a time")  # fmt: skip
    measured = {task: hits_after[task] - hits_before[task] for task in TASKS}
    expected = {task: sum(r.hits for r in rows if r.task == task) for task in TASKS}
    print(f"Triton's bound callables (fixed answers, not a model's) ran {calls_before} times before the "
          f"measured rounds and {calls_after} after; its cache hits in the rounds {measured} of "
          f"{expected} requests. Every answer of ours was an L1 hit.")  # fmt: skip
    print()
    print("| row | p50 ms ours | p50 ms Triton | p50 ours/Triton | p99 ms ours | p99 ms Triton "
          "| p99 ours/Triton | server CPU ms/hit ours | server CPU ms/hit Triton | CPU ours/Triton "
          "| targets (p50 ≤ 1.25x, CPU ≤ 2x) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        p50 = (percentile(row.ours_ms, 50), percentile(row.theirs_ms, 50))
        p99 = (percentile(row.ours_ms, 99), percentile(row.theirs_ms, 99))
        cpu = (1000 * row.ours_cpu_s / row.hits, 1000 * row.theirs_cpu_s / row.hits)
        p50_ratio, cpu_ratio = p50[0] / p50[1], cpu[0] / cpu[1] if cpu[1] > 0 else float("inf")
        verdict = (f"p50 {'met' if p50_ratio <= TARGET_P50 else 'missed'}, "
                   f"CPU {'met' if cpu_ratio <= TARGET_CPU else 'missed'}")  # fmt: skip
        print(f"| {row.name} | {p50[0]:.3f} | {p50[1]:.3f} | {p50_ratio:.2f} | {p99[0]:.3f} "
              f"| {p99[1]:.3f} | {p99[0] / p99[1]:.2f} | {cpu[0]:.3f} | {cpu[1]:.3f} | {cpu_ratio:.2f} "
              f"| {verdict} |")  # fmt: skip
    host = {row.name: round(1000 * row.theirs_host_cpu_s / row.hits, 4) for row in rows}
    print(f"\nPyTriton's own Python process (not counted above), CPU ms per hit: {host}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="hits per row, side and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=200, help="requests per row and side before the rounds")
    args = parser.parse_args()
    try:
        run(args)
    except TritonPeerError as exc:
        print(f"bench.triton_peer: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
