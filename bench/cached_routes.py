"""Server CPU of a cached answer through each of Gradio's two-step routes: `POST
/gradio_api/call/<api>` with `{"data": [...]}` and `POST /gradio_api/call/v2/<api>` with named
parameters (the "Use via API" snippet), each followed by its GET, with and without an `Origin`
the app answers with CORS headers. Both are answered by the cached-call shortcut
(ui/cached_calls.py); the figures should match.

`python -m bench.cached_routes [--calls 300] [--rounds 5]`: starts `python app.py` (REDIS_URL=off,
the built-in models) in its own process, warms one message and one photo, then times the
routes in interleaved rounds; CPU per call is the server process's CPU time over each batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.workload.processes import process_cpu_s
from storage.redis.embedded import free_port
from testing.gradio_http import GradioHttpClient, parse_event_stream

ROOT = Path(__file__).resolve().parent.parent
MESSAGE = "Where is my parcel? It was supposed to arrive on Monday."
CROSS_SITE = {"host": "myspace.hf.space", "origin": "https://example.com"}


def start_app(
    data_dir: Path, *, command: Sequence[str] = ("app.py",), env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`python <command>` (the app, or a bench module serving it) on a free port, without Redis;
    returns the process and its URL once /readyz answers 200."""
    port = free_port()
    env = {**os.environ, "PORT": str(port), "REDIS_URL": "off", "DATA_DIR": str(data_dir),
           "ADMIN_TOKEN": "bench-cached-routes", **(env or {})}  # fmt: skip
    process = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return process, wait_ready(process, f"http://127.0.0.1:{port}", "/readyz")


def wait_ready(process: subprocess.Popen[bytes], url: str, path: str, timeout_s: float = 300.0) -> str:
    """`url` once `path` answers 200 there; the process is killed if it never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{url} did not become ready")


def one_call(http: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    queued = http.post(path, json=body, headers=headers)
    queued.raise_for_status()
    stream = http.get(f"{path}/{queued.json()['event_id']}", headers=headers)
    final = parse_event_stream(stream.text)
    if final is None or final[0] != "complete" or final[1][1]["tier"] == "miss":
        raise RuntimeError(f"not a cached answer: {stream.text[:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per route per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import skimage

    photo = (Path(skimage.__file__).parent / "data" / "chelsea.png").read_bytes()
    with tempfile.TemporaryDirectory() as data_dir:
        process, url = start_app(Path(data_dir))
        try:
            with GradioHttpClient(url) as client:
                image = client.upload_file("chelsea.png", photo, "image/png")
                client.call("classify_text", [MESSAGE]).outputs  # noqa: B018 (a miss: warms the cache)
                client.call("classify_image", [image]).outputs  # noqa: B018
                routes = {
                    "text, call": ("/gradio_api/call/classify_text", {"data": [MESSAGE]}, {}),
                    "text, call/v2": ("/gradio_api/call/v2/classify_text", {"message": MESSAGE}, {}),
                    "text, call/v2, cross-site": (
                        "/gradio_api/call/v2/classify_text",
                        {"message": MESSAGE},
                        CROSS_SITE,
                    ),
                    "image, call": ("/gradio_api/call/classify_image", {"data": [image]}, {}),
                    "image, call/v2": ("/gradio_api/call/v2/classify_image", {"image": image}, {}),
                }
                cpu: dict[str, list[float]] = {name: [] for name in routes}
                wall: dict[str, list[float]] = {name: [] for name in routes}
                for _ in range(args.rounds):
                    for name, (path, body, headers) in routes.items():
                        before, started = process_cpu_s(process.pid), time.perf_counter()
                        for _ in range(args.calls):
                            one_call(client.http, path, body, headers)
                        wall[name].append(1000 * (time.perf_counter() - started) / args.calls)
                        cpu[name].append(1000 * (process_cpu_s(process.pid) - before) / args.calls)
        finally:
            process.terminate()
            process.wait(timeout=30)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds x {args.calls} calls (POST + GET)")
    print("| route | server CPU ms per call (median of rounds) | wall ms per call |")
    print("|---|---|---|")
    for name in routes:
        print(f"| {name} | {statistics.median(cpu[name]):.3f} | {statistics.median(wall[name]):.2f} |")


if __name__ == "__main__":
    main()
