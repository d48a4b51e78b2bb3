"""Start-up's clock: each phase of a start logs how long it took and when it ended, counted
from the process's own start (the kernel's record, so the interpreter and the first imports
count too). One format, which `bench.cold_start` reads:

    start-up: <phase>: 1.23 s (at 4.56 s)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("startup")

_IMPORTED = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (/proc; elsewhere, since this module was imported)."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def record(name: str, seconds: float) -> None:
    log.info("start-up: %s: %.2f s (at %.2f s)", name, seconds, process_age_s())


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Logs the phase's duration when it ends (not when it raises: the failure says enough)."""
    started = time.perf_counter()
    yield
    record(name, time.perf_counter() - started)
