"""Cached REST hits on two builds side by side: this checkout against a git revision.

`python -m bench.build_ab --against REV [--rows image-json,image-binary,text-json,text-binary]
[--rounds 8] [--requests 300]`

A change to the hit path is judged by the same requests on the build before it and the build
after it, in one run: on this shared machine a figure from another hour says little. The
revision is checked out in a temporary `git worktree` and served by `python app.py` from there
(this venv, REDIS_URL=off, the built-in models, its own DATA_DIR), beside this checkout's app.
Each row sends bench.triton_peer's `tritonclient.http` request (the support message, or
chelsea.png's bytes; JSON or binary tensors) to both, warmed, then `--rounds` rounds of
`--requests` hits each, alternating which build goes first. Per row: server CPU per hit (user +
sys of each app's process over its batches, psutil) and the client's p50, then their ratios
(this checkout over the revision). Every answer must be an L1 hit.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.cached_routes import start_app
from bench.models import format_table
from bench.triton_peer import MESSAGE, hits, request_of, tree_cpu_s

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("image-json", "image-binary", "text-json", "text-binary")
BUILDS = ("before", "after")


@contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """`revision` checked out in a temporary worktree, removed after."""
    with tempfile.TemporaryDirectory(prefix="build-ab-") as tmp:
        path = Path(tmp) / "tree"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", "--quiet", str(path), revision], check=True)
        try:
            yield path
        finally:
            subprocess.run([*git, "remove", "--force", str(path)], check=False)


def run(args: argparse.Namespace) -> None:
    import skimage
    import tritonclient.http as triton

    photo = (Path(skimage.__file__).parent / "data" / "chelsea.png").read_bytes()
    rows = [row for row in args.rows.split(",") if row]
    if not rows or set(rows) - set(ROWS):
        raise SystemExit(f"--rows: a comma-separated subset of {','.join(ROWS)}, not {args.rows!r}")
    requests: dict[str, Any] = {}
    for row in rows:
        task, encoding = row.split("-")
        requests[row] = (task, request_of(encoding, MESSAGE if task == "text" else photo))
    cpu = {(row, build): 0.0 for row in rows for build in BUILDS}
    latencies: dict[tuple[str, str], list[float]] = {(row, build): [] for row in rows for build in BUILDS}
    with worktree(args.against) as tree, tempfile.TemporaryDirectory(prefix="build-ab-data-") as data:
        apps = {}
        try:
            for build, root in (("before", tree), ("after", ROOT)):
                apps[build] = start_app(Path(data) / build, command=(str(root / "app.py"),),
                                        env={"PYTHONPATH": str(root)})  # fmt: skip
            clients = {build: triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=60)
                       for build, (_, url) in apps.items()}  # fmt: skip
            processes = {build: psutil.Process(process.pid) for build, (process, _) in apps.items()}
            for task, request in requests.values():
                for client in clients.values():
                    client.infer(task, request[0], outputs=request[1])  # the miss
                    hits(client, task, request, args.requests // 3, ours=True)
            for round_index in range(args.rounds):
                order = BUILDS if round_index % 2 == 0 else BUILDS[::-1]
                for row, (task, request) in requests.items():
                    for build in order:
                        before = tree_cpu_s(processes[build])
                        latencies[row, build] += hits(clients[build], task, request, args.requests, ours=True)
                        cpu[row, build] += tree_cpu_s(processes[build]) - before
            for client in clients.values():
                client.close()
        finally:
            for process, _ in apps.values():
                process.terminate()
                process.wait(timeout=30)
    n = args.rounds * args.requests
    table, summary = [], []
    for row in rows:
        cpu_ms = {build: 1000 * cpu[row, build] / n for build in BUILDS}
        p50 = {build: float(np.median(latencies[row, build])) for build in BUILDS}
        ratio, p50_ratio = cpu_ms["after"] / cpu_ms["before"], p50["after"] / p50["before"]
        table.append((row, f"{cpu_ms['before']:.3f}", f"{cpu_ms['after']:.3f}", f"{ratio:.2f}",
                      f"{p50['before']:.3f}", f"{p50['after']:.3f}", f"{p50_ratio:.2f}"))  # fmt: skip
        summary.append(f"cpu_{row.replace('-', '_')}={ratio:.2f}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{started}: this checkout (after) against {args.against} (before), {args.rounds} rounds x "
          f"{args.requests} hits a row and build")  # fmt: skip
    headers = ("row", "CPU ms before", "CPU ms after", "after/before", "p50 ms before", "p50 ms after",
               "after/before")  # fmt: skip
    print(format_table(headers, table))
    print("SUMMARY " + " ".join(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the git revision to compare this checkout with")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=300, help="hits per row, build and round")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
