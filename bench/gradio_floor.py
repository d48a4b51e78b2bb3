"""What Gradio's two-step API costs with nothing behind it, beside this app's cached answers:
`python -m bench.gradio_floor [--calls 500] [--rounds 5]`.

Three servers, each its own process: a plain Gradio app whose one endpoint returns its input
(`echo`: the protocol's floor as Gradio serves it, no cache, no model), and this app (`python
app.py`, REDIS_URL=off). The rows, interleaved in rounds: the empty endpoint and a cached
message through `POST /gradio_api/call/<api>` then the GET of its event stream, each with
and without a session hash, and the same message over REST (`/v2`, one request). Server CPU
per call: the server process's CPU time over each round's batch (median of rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.cached_routes import start_app, wait_ready
from bench.workload.processes import process_cpu_s
from storage.redis.embedded import free_port
from testing.gradio_http import GradioHttpClient
from testing.oip_http import OipHttpClient

MESSAGE = "Where is my parcel? It was supposed to arrive on Monday."
EMPTY_APP = """
import sys
import gradio as gr
with gr.Blocks() as demo:
    text, out = gr.Textbox(), gr.Textbox()
    text.submit(lambda s: s, text, out, api_name="echo")
demo.queue().launch(server_name="127.0.0.1", server_port=int(sys.argv[1]), ssr_mode=False)
"""


def start_empty() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", EMPTY_APP, str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    return process, wait_ready(process, f"http://127.0.0.1:{port}", "/gradio_api/info", 120.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per row per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        empty, empty_url = start_empty()
        ours, ours_url = start_app(Path(data_dir))
        clients: list[GradioHttpClient | OipHttpClient] = []
        try:
            rows: dict[str, tuple[int, Callable[[], object]]] = {}
            servers = {"empty Gradio endpoint": (empty, empty_url, "echo"),
                       "this app, cached": (ours, ours_url, "classify_text")}  # fmt: skip
            for session in (True, False):
                label = "with" if session else "without"
                for name, (process, url, api) in servers.items():
                    client = GradioHttpClient(url, session_hash="f100r" + label if session else None)
                    clients.append(client)
                    rows[f"{name}, Gradio API, {label} a session hash"] = (
                        process.pid, lambda c=client, a=api: c.call(a, [MESSAGE]).outputs)  # fmt: skip
            rest = OipHttpClient(ours_url)
            clients.append(rest)
            rows["this app, cached, REST (one request)"] = (ours.pid, lambda: rest.infer("text", MESSAGE))
            for _, call in rows.values():
                for _ in range(50):
                    call()
            cpu: dict[str, list[float]] = {name: [] for name in rows}
            for _ in range(args.rounds):
                for name, (pid, call) in rows.items():
                    before = process_cpu_s(pid)
                    for _ in range(args.calls):
                        call()
                    cpu[name].append(1000 * (process_cpu_s(pid) - before) / args.calls)
        finally:
            for client in clients:
                client.close()
            for process in (empty, ours):
                process.terminate()
                process.wait(timeout=30)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds x {args.calls} calls per row")
    print("| row | server CPU ms per call (median of rounds) |")
    print("|---|---|")
    for name, values in cpu.items():
        print(f"| {name} | {statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
