"""A /healthz poller in a process of its own, so that what it measures is the app's delay,
not the suite's: the suite's own threads (normal clients, attackers building requests) hold
its GIL, and a poller thread among them would report their time as the app's.

    python -m faults.healthz URL FILE    # polls until its stdin closes

Each poll is one line of FILE, written as it completes: `sent_at seconds ok`, `sent_at` on
the system's monotonic clock (the same `time.monotonic()` in every process on Linux).
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from faults.config import ROOT
from faults.processes import die_with_parent

EVERY_S = 0.01
TIMEOUT_S = 15.0  # a poll that waits this long is a failed one (and counts as this slow)


class HealthPoller:
    """GET `url`/healthz every EVERY_S on one keep-alive connection, from its own process,
    while in use; `windows` reads the polls sent in spans of time."""

    def __init__(self, url: str, file: Path) -> None:
        self._url = url
        self._file = file
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> HealthPoller:
        self._file.unlink(missing_ok=True)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "faults.healthz", self._url, str(self._file)],
            cwd=ROOT, stdin=subprocess.PIPE, preexec_fn=die_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + 60.0
        while not self._samples():  # started (imports) and answered once
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the /healthz poller did not start (exit status {self._process.poll()})")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _samples(self) -> list[tuple[float, float, bool]]:
        try:
            lines = self._file.read_text().splitlines()
        except OSError:
            return []
        samples = []
        for line in lines:
            fields = line.split()
            if len(fields) == 3:  # a line being written is skipped
                samples.append((float(fields[0]), float(fields[1]), fields[2] == "1"))
        return samples

    def windows(self, spans: Sequence[tuple[float, float]]) -> tuple[list[float], int]:
        """Seconds of the polls sent in any of the spans [start, end), and how many failed."""
        picked = [(s, ok) for at, s, ok in self._samples() if any(a <= at < b for a, b in spans)]
        return [s for s, _ in picked], sum(not ok for _, ok in picked)


def p99(values: Sequence[float]) -> float:
    """Nearest rank: the smallest value with at least 99 % of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else math.inf


def main(url: str, file: str) -> None:
    stop = threading.Event()
    # The parent closes our stdin when it is done (or dies, and the kernel closes it).
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), stop.set()), daemon=True).start()
    with open(file, "w", buffering=1) as out, httpx.Client(timeout=TIMEOUT_S) as http:
        while not stop.is_set():
            sent_at = time.monotonic()
            try:
                ok = http.get(url + "/healthz").status_code == 200
            except httpx.HTTPError:
                ok = False
            out.write(f"{sent_at:.6f} {time.monotonic() - sent_at:.6f} {int(ok)}\n")
            stop.wait(EVERY_S)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
