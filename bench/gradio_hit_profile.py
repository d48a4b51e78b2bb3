"""Where the server's CPU goes on a cached answer through Gradio's two-step API:
`python -m bench.gradio_hit_profile`.

The server of bench.rest_hit_profile (`python app.py` with cProfile switched on and off on
its event loop thread by signals), sent the Gradio calls of the workload's stream: a cached
message with and without a session hash (`POST /gradio_api/call/classify_text`, then the GET
of its event stream), and a cached photo (`POST /gradio_api/upload`, then the call). Each row
is sent N times unprofiled (the CPU of each of the server's threads over the batch) and N
times profiled (the functions that take the event loop's time). Figures per call.

    python -m bench.gradio_hit_profile [--requests 2000] [--rows text-session,text,image] [--top 30]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from bench.rest_hit_profile import profile_row, profiled_server
from testing.gradio_http import GradioHttpClient

MESSAGE = "Where is my parcel? It was supposed to arrive on Monday."
ROWS = ("text-session", "text", "image-session", "image")


def row_call(url: str, row: str, photo: bytes) -> tuple[GradioHttpClient, Callable[[], None]]:
    """A client for `row` and one cached call of it (the first call, a miss, made here)."""
    task, _, session = row.partition("-")
    client = GradioHttpClient(url, session_hash="c0ffee" + row.replace("-", "") if session else None)

    def call() -> None:
        if task == "image":
            outputs = client.call("classify_image", [client.upload_file("chelsea.png", photo, "image/png")])
        else:
            outputs = client.call("classify_text", [MESSAGE])
        outputs.outputs  # noqa: B018 (raises for anything but a complete event)

    call()
    return client, call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--timer", choices=("cpu", "wall"), default="cpu", help="cProfile's clock")
    args = parser.parse_args()
    import skimage

    photo = (Path(skimage.__file__).parent / "data" / "chelsea.png").read_bytes()
    with profiled_server(args.timer) as (pid, url, out_dir):
        for stop, row in enumerate(args.rows.split(","), start=1):
            client, call = row_call(url, row, photo)
            profile_row(pid, out_dir, stop, row, args, lambda n, c=call: [c() for _ in range(n)])
            client.close()


if __name__ == "__main__":
    main()
