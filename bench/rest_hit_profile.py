"""Where the server's CPU goes on a cached REST hit: `python -m bench.rest_hit_profile`.

Starts `python app.py` (REDIS_URL=off, built-in models) under a wrapper (`--serve`) that turns
cProfile on and off on the server's main thread (uvicorn's event loop, where a small hit is
answered) at SIGUSR1 / SIGUSR2. For each row (text/image, JSON/binary tensors, the same
tritonclient requests as bench.triton_peer) it sends N hits twice: once unprofiled, taking
the CPU time of each of the server's threads (/proc/<pid>/task) over the batch, and once with
cProfile on, printing the functions that take the event loop's time. Figures per hit.

    python -m bench.rest_hit_profile [--requests 3000] [--rows text-binary,image-binary] [--top 30]
        [--timer cpu|wall]   (cProfile's clock: the thread's CPU time, the default, or wall time)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from bench.cached_routes import start_app

ROOT = Path(__file__).resolve().parent.parent


# ---- the server side --------------------------------------------------------------------


def serve(out_dir: Path) -> None:
    """app.main() with cProfile switched by signals; thread names written at each stop."""
    # CPU time of the thread by default: under load, wall time charges a preempted function
    # (a socket write that wakes the client) with the time other processes ran.
    wall = os.environ.get("REST_HIT_PROFILE_TIMER") == "wall"
    profiler = cProfile.Profile() if wall else cProfile.Profile(time.thread_time)
    count = [0]

    def start(_signum: int, _frame: Any) -> None:
        profiler.enable()

    def stop(_signum: int, _frame: Any) -> None:
        profiler.disable()
        count[0] += 1
        profiler.dump_stats(out_dir / f"profile-{count[0]}.prof")
        profiler.clear()
        names = {t.native_id: t.name for t in threading.enumerate()}
        (out_dir / f"threads-{count[0]}.json").write_text(json.dumps(names))
        (out_dir / f"done-{count[0]}").write_text("")

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.path.insert(0, str(ROOT))
    import app

    app.main()


# ---- the client side --------------------------------------------------------------------


def thread_cpu(pid: int) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def start_server(out_dir: Path, timer: str) -> tuple[subprocess.Popen[bytes], str]:
    return start_app(
        out_dir / "data",
        command=("-m", "bench.rest_hit_profile", "--serve", str(out_dir)),
        env={"REST_HIT_PROFILE_TIMER": timer, "ADMIN_TOKEN": "bench-rest-hit-profile"},
    )


def report(
    row: str,
    args: argparse.Namespace,
    wall: float,
    before: dict[int, float],
    after: dict[int, float],
    names: dict[int, str],
    stats: pstats.Stats,
) -> None:
    n = args.requests
    per_thread = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    total = sum(per_thread.values())
    print(f"\n===== {row}: {n} hits, {1000 * wall / n:.3f} ms wall per hit, "
          f"server CPU {1000 * total / n:.3f} ms per hit (unprofiled), by thread:")  # fmt: skip
    for tid, cpu in sorted(per_thread.items(), key=lambda item: -item[1]):
        if cpu > 0:
            print(f"  {names.get(tid, f'tid {tid}')}: {1000 * cpu / n:.4f} ms")
    table = stats.stats  # type: ignore[attr-defined]
    for title, column in (("own time", 2), ("cumulative time", 3)):
        print(f"--- the event loop thread under cProfile, top {args.top} by {title} (ms per hit):")
        for (filename, line, function), numbers in sorted(table.items(), key=lambda i: -i[1][column])[
            : args.top
        ]:
            calls, tottime, cumtime = numbers[1], numbers[2], numbers[3]
            where = filename.replace(str(ROOT) + "/", "").split("site-packages/")[-1]
            print(f"  own {1000 * tottime / n:8.4f} cum {1000 * cumtime / n:8.4f} "
                  f"{calls / n:6.2f}/hit  {where}:{line} {function}")  # fmt: skip


@contextmanager
def profiled_server(timer: str) -> Iterator[tuple[int, str, Path]]:
    """The profiled server, started in a temporary folder: its pid, URL and that folder."""
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        process, url = start_server(out_dir, timer)
        try:
            yield process.pid, url, out_dir
        finally:
            process.terminate()
            process.wait(timeout=30)


def profile_row(
    pid: int, out_dir: Path, stop: int, row: str, args: argparse.Namespace, send: Callable[[int], object]
) -> None:
    """Warm up, then `send(args.requests)` unprofiled (CPU per thread) and again under cProfile
    (the server's `stop`th profile), and report the row."""
    send(300)
    before, started = thread_cpu(pid), time.perf_counter()
    send(args.requests)
    wall = time.perf_counter() - started
    after = thread_cpu(pid)
    os.kill(pid, signal.SIGUSR1)
    time.sleep(0.2)
    send(args.requests)
    os.kill(pid, signal.SIGUSR2)
    while not (out_dir / f"done-{stop}").exists():
        time.sleep(0.05)
    names = json.loads((out_dir / f"threads-{stop}.json").read_text())
    report(row, args, wall, before, after, {int(k): v for k, v in names.items()},
           pstats.Stats(str(out_dir / f"profile-{stop}.prof")))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rows", default="text-json,text-binary,image-json,image-binary")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--timer", choices=("cpu", "wall"), default="cpu", help="cProfile's clock")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    import skimage
    import tritonclient.http as triton

    from bench.triton_peer import MESSAGE, hits, request_of

    photo = (Path(skimage.__file__).parent / "data" / "chelsea.png").read_bytes()
    with profiled_server(args.timer) as (pid, url, out_dir):
        client = triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=60)
        for stop, row in enumerate(args.rows.split(","), start=1):
            task, encoding = row.split("-")
            request = request_of(encoding, MESSAGE if task == "text" else photo)
            client.infer(task, request[0], outputs=request[1])  # the miss
            profile_row(pid, out_dir, stop, row, args,
                        lambda n, t=task, r=request: hits(client, t, r, n, ours=True))  # fmt: skip
        client.close()


if __name__ == "__main__":
    main()
