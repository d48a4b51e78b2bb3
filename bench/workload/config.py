"""What a run is made of: the systems, the workloads, the sizes and the targets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYSTEMS = ("nocache", "seed", "grcache", "ours")
PEERS = ("nocache", "seed", "grcache")
# Opt-in (--systems), to say where a difference comes from: `ours-l1` is ours with
# REDIS_URL=off (the Redis tier's cost, by difference); `ours-tcp` is ours with its Redis on
# loopback TCP instead of a unix socket (what the transport costs); `ours-nobatch` is ours with
# BATCH_MAX_SIZE=1 (what micro-batching gives); `nocache-twin` is a second, identical nocache
# (the run's noise floor: its ratio to nocache should be 1.00).
ATTRIBUTION_SYSTEMS = ("ours-l1", "ours-tcp", "ours-nobatch", "nocache-twin")
ALL_SYSTEMS = SYSTEMS + ATTRIBUTION_SYSTEMS
WORKLOADS = ("zipf-restart", "unique")
HTTP_SYSTEMS = ("grcache", "ours")
USES_REDIS = frozenset({"seed", "ours", "ours-tcp", "ours-nobatch"})
# Every Redis this script starts is like the app's private one (REDIS_URL unset): a unix
# socket, no TCP port; these systems get loopback TCP instead.
REDIS_OVER_TCP = frozenset({"ours-tcp"})
FULL_REQUESTS = 20_000
QUICK_REQUESTS = 4_000
IMAGES = 2_000
MESSAGES = 2_000
CLIENTS = 4
ZIPF_S = 1.1
SEED = 20_240_611
SEGMENTS = 20
UNIQUE_SHARE = 5  # the unique workload replays min(requests / 5, inputs) requests
# torch intra-op threads per process. Four clients already run up to four forward passes at
# once; torch's default (one thread per CPU each) oversubscribes the CPUs, and on a busy machine
# its threads wait on each other at every op (tenfold slowdowns measured). Same for every system.
THREADS = 1
REDIS_MAXMEMORY_MB = 256  # the app's default for its private redis-server
TARGETS = {  # summary key -> minimum
    "speedup_vs_nocache": 5.0,
    "speedup_vs_grcache": 1.2,
    "speedup_vs_seed": 1.2,
    "unique_vs_nocache": 0.95,
}
REPORT_PATH = Path(__file__).resolve().parents[1] / "REPORT.md"  # bench/
CHART_PATH = Path(__file__).resolve().parents[1] / "workload_chart.html"
NOTES_MARKER = "<!-- notes: everything below this line is kept when the report is rewritten -->"
Labels = tuple[tuple[str, float], ...]
Job = tuple[str, Any]  # (task, raw input as received: PNG/JPEG bytes or a str)


@dataclass(frozen=True)
class Config:
    requests: int = FULL_REQUESTS
    images: int = IMAGES
    messages: int = MESSAGES
    clients: int = CLIENTS
    zipf_s: float = ZIPF_S
    seed: int = SEED
    segments: int = SEGMENTS
    systems: tuple[str, ...] = SYSTEMS
    workloads: tuple[str, ...] = WORKLOADS
    device: str = "auto"
    threads: int | None = THREADS
    isolated: bool = True  # each system in its own process (False: tests, --in-process)
    http: bool = False
    http_sessions: bool = True  # each HTTP client keeps one Gradio session, as gradio_client does
    inputs_cache: Path | None = None  # where generated inputs are kept between runs (None: nowhere)
