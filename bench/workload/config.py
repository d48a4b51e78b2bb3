"""What a run is made of: the systems, the workloads, the sizes and the targets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# `nocache-app` is nocache on the app's inference backend (onnxruntime on a CPU): ours against
# it is what the cache itself gives, it against nocache what the backend gives.
SYSTEMS = ("nocache", "nocache-app", "seed", "grcache", "ours")
PEERS = ("nocache", "seed", "grcache")
# Which loaded models a system runs: the peers plain torch, as a user's own app would; this
# app (and its no-cache twin) on its own backend (INFERENCE_BACKEND=auto).
TORCH_MODELS, APP_MODELS = "torch", "app"
# Opt-in (--systems), to say where a difference comes from: `ours-l1` is ours with
# REDIS_URL=off (the Redis tier's cost, by difference); `ours-tcp` is ours with its Redis on
# loopback TCP instead of a unix socket (what the transport costs); `ours-nobatch` is ours with
# BATCH_MAX_SIZE=1 (what micro-batching gives); `ours-signed` is ours with CACHE_SIGNING_KEY
# set (what signing L2 values costs); `nocache-twin` is a second, identical nocache
# (the run's noise floor: its ratio to nocache should be 1.00).
ATTRIBUTION_SYSTEMS = ("ours-l1", "ours-tcp", "ours-nobatch", "ours-signed", "nocache-twin")
ALL_SYSTEMS = SYSTEMS + ATTRIBUTION_SYSTEMS
WORKLOADS = ("zipf-restart", "unique")
USES_REDIS = frozenset({"seed", "ours", "ours-tcp", "ours-nobatch", "ours-signed"})
# Every Redis this script starts is like the app's private one (REDIS_URL unset): a unix
# socket, no TCP port; these systems get loopback TCP instead.
REDIS_OVER_TCP = frozenset({"ours-tcp"})

# --http: three paths side by side, each its own server process (and Redis): path ->
# (the app it serves, the API its clients speak).
HTTP_PATHS = {
    "grcache": ("grcache", "gradio"),  # the minimal gr.cache app, through Gradio
    "ours": ("ours", "gradio"),  # this app, through Gradio (/gradio_api/call/classify_*)
    "ours-rest": ("ours", "rest"),  # this app, through REST (/v2/models/{task}/infer)
}
HTTP_SYSTEMS = tuple(HTTP_PATHS)
HTTP_SESSIONS = ("mixed", "with", "without")  # Gradio clients with a session hash: half, all, none

FULL_REQUESTS = 20_000
QUICK_REQUESTS = 2_000
QUICK_HTTP_REQUESTS = 1_000
IMAGES = 2_000
MESSAGES = 2_000
CLIENTS = 4
ZIPF_S = 1.1
SEED = 20_240_611
SEGMENTS = 20
UNIQUE_SHARE = 5  # the unique workload replays min(requests / 5, inputs) requests
# Cached answers timed one at a time per path, session mode and task (in 5 interleaved rounds),
# and calls without a session hash over which the servers' memory growth is measured.
HIT_SAMPLES, QUICK_HIT_SAMPLES = 400, 100
RSS_CALLS, QUICK_RSS_CALLS = 3_000, 1_000
# torch intra-op threads per process. Four clients already run up to four forward passes at
# once; torch's default (one thread per CPU each) oversubscribes the CPUs, and on a busy machine
# its threads wait on each other at every op (tenfold slowdowns measured). Same for every system.
THREADS = 1
REDIS_MAXMEMORY_MB = 256  # the app's default for its private redis-server

# summary key -> (">=" or "<=", bound); the in-process keys first, then the HTTP ones.
TARGETS = {
    "speedup_vs_nocache": (">=", 10.0),  # 5 before the CPU backend
    "speedup_vs_grcache": (">=", 1.2),
    "speedup_vs_seed": (">=", 1.2),
    "unique_vs_nocache": (">=", 1.5),  # 0.95 before
    "gradio_vs_grcache": (">=", 3.0),  # 2.5 before, 1.5 before that
    "rest_vs_grcache": (">=", 8.0),  # 5 before
    "rest_hit_p50_vs_gradio": ("<=", 0.25),
    "miss_cpu_vs_torch_image": ("<=", 0.5),
    "miss_cpu_vs_torch_text": ("<=", 0.5),
}
# New inputs per task for the miss-cost comparison (bench.workload.miss_cpu); 0: not measured.
MISS_INPUTS, QUICK_MISS_INPUTS = 60, 20
RSS_GROWTH_LIMIT_MB = 60.0  # per 3,000 calls without a session hash (issue 18)
REPORT_PATH = Path(__file__).resolve().parents[1] / "REPORT.md"  # bench/
CHART_PATH = Path(__file__).resolve().parents[1] / "workload_chart.html"
NOTES_MARKER = "<!-- notes: everything below this line is kept when the report is rewritten -->"

Labels = tuple[tuple[str, float], ...]
Job = tuple[str, Any]  # (task, raw input as received: PNG/JPEG bytes or a str)


@dataclass(frozen=True)
class Config:
    requests: int = FULL_REQUESTS
    miss_inputs: int = MISS_INPUTS
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
    http_requests: int | None = None  # the HTTP stream's length (None: `requests`)
    http_sessions: str = "mixed"  # one of HTTP_SESSIONS
    hit_samples: int = HIT_SAMPLES
    rss_calls: int = RSS_CALLS
    inputs_cache: Path | None = None  # where generated inputs are kept between runs (None: nowhere)

    @property
    def http_paths(self) -> tuple[str, ...]:
        """The HTTP paths whose app is among the systems."""
        return tuple(path for path, (app, _) in HTTP_PATHS.items() if app in self.systems)


def models_of(system: str) -> str:
    """TORCH_MODELS or APP_MODELS: the model set `system` (or HTTP app) runs."""
    return APP_MODELS if system.startswith("ours") or system == "nocache-app" else TORCH_MODELS
