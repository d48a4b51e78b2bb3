"""The settings reference: every environment variable the app reads, its default, its meaning
and its group. docs/CONFIGURATION.md is generated from this module and checked against it by
tests/test_docs.py, so the page cannot go stale:

    python -m settings_reference --write       # rewrites docs/CONFIGURATION.md
    python -m settings_reference > page.md     # the same text on stdout

A variable `Settings.from_env` reads has `read_by="settings.py"`; a few are read elsewhere
(named in `read_by`). Adding a variable to settings.py without an entry here fails the tests.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PAGE = ROOT / "docs" / "CONFIGURATION.md"


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # as text, Markdown allowed
    meaning: str  # Markdown, one paragraph
    group: str
    read_by: str = "settings.py"


# Groups in the order the page shows them, each with a sentence under its heading.
GROUPS: dict[str, str] = {
    "Server": "Where the app listens, where it keeps its files, who may use the console.",
    "Models": "Which models serve, on which device and backend, and how misses share the model.",
    "Cache and Redis": "The two tiers (L1 in process memory, L2 in Redis), their sizes and lifetimes, "
    "how Redis is reached and what happens when it is slow or away.",
    "Log database": "The request and audit log behind the operator console.",
    "Fairness and limits": "The per-client miss budget, how clients are told apart behind proxies, "
    "and the bounds on every request (see [API.md](API.md#limits-on-every-request)).",
    "Fleet": "Several replicas sharing one Redis (see "
    "[DEPLOYMENT.md](DEPLOYMENT.md#running-several-replicas)).",
    "Hard examples and warm-up": "Users' inputs kept in Redis on purpose (both off by default; see "
    "[CONSOLE.md](CONSOLE.md#hard-examples) and [CONSOLE.md](CONSOLE.md#warm-up)).",
    "Operator console": "The console's answers: what caching is worth and how big the tiers should be.",
    "Process": "Read outside `settings.py`, by the process before the settings.",
}

VARIABLES: tuple[Variable, ...] = (
    # --- Server -------------------------------------------------------------------------
    Variable("PORT", "`7860`", "HTTP port: the UI, the Gradio API, REST (`/v2`) and the admin API all "
             "listen on it.", "Server"),
    Variable("HOST", "`0.0.0.0`", "Address the server binds.", "Server"),
    Variable("ADMIN_TOKEN", "random, printed once in the log", "Operator console and admin API token "
             "(8+ characters). Unset: a random token is generated at each start and printed once in "
             "the server log. Replicas of one fleet need the same one.", "Server"),
    Variable("DATA_DIR", "`./data`", "SQLite request log, the private Redis's socket and snapshots, "
             "ONNX exports (unless `ONNX_EXPORT_DIR`). On a Space with persistent storage: `/data`.",
             "Server"),
    Variable("READY_L2_WAIT_S", "`10`", "At start-up, how long `/readyz` waits for Redis before the "
             "replica is ready without it (it keeps serving from L1 and the model; the breaker finds "
             "Redis later).", "Server"),
    # --- Models -------------------------------------------------------------------------
    Variable("MODELS_CONFIG", "unset (the two built-in models)", "A YAML file listing the served "
             "models, one per task (see [MODELS.md](MODELS.md#your-own-model)); a bad entry stops the "
             "start with a message naming it.", "Models"),
    Variable("DEVICE", "`auto`", "`auto` (CUDA when available), `cpu` or `cuda`.", "Models"),
    Variable("INFERENCE_BACKEND", "`auto`", "What runs a miss's forward pass: `auto` (ONNX Runtime on "
             "the CPU, torch on CUDA), `torch` or `onnxruntime`; a `MODELS_CONFIG` entry's `backend:` "
             "overrides it. A model stays on torch, with the reason in `/readyz` and the console, when "
             "its export or its exactness probe fails (see "
             "[MODELS.md](MODELS.md#a-miss-on-the-cpu-onnx-runtime-the-same-answers)).", "Models"),
    Variable("ONNX_EXPORT_DIR", "`DATA_DIR/onnx`", "Where each model version's ONNX export is kept and "
             "reused.", "Models"),
    Variable("HALF_PRECISION", "`0`", "CUDA only: the image model in float16 (part of its version).",
             "Models"),
    Variable("BATCH_MAX_SIZE", "`8`", "Most text misses in one shared forward pass; `1`: no batching.",
             "Models"),
    Variable("MISS_CONCURRENCY_CPU", "cores (at most 4)", "Concurrent forward passes of a model on the "
             "CPU that does not batch (a batching model runs one pass at a time and admits at least "
             "`BATCH_MAX_SIZE` misses to share it).", "Models"),
    Variable("MISS_CONCURRENCY_CUDA", "`4`", "The same, for a model on CUDA.", "Models"),
    Variable("SHADOW_SAMPLE_RATE", "`0.01`", "Share of cache hits recomputed off the request path while "
             "the model is idle and compared (tolerance 1e-5); a mismatch evicts the entry everywhere; "
             "`0` turns it off.", "Models"),
    # --- Cache and Redis ----------------------------------------------------------------
    Variable("REDIS_URL", "unset (a private `redis-server`)", "Unset: start a private `redis-server` on "
             "a unix socket under `DATA_DIR` (L1-only with a notice when it is not installed); `off`: no "
             "L2; one node: `redis://[[user]:password@]host[:port][/db]`, `rediss://…` (TLS), "
             "`unix:///path/redis.sock`; a Redis Cluster: "
             "`redis+cluster://[[user]:password@]host:port[,host:port…]` (any of its nodes; "
             "`rediss+cluster://` for TLS); the primary that Sentinels name: "
             "`redis+sentinel://[[user]:password@]host:port[,host:port…]/<service_name>[/db]` (the "
             "password is the data nodes'; `rediss+sentinel://` for TLS). A malformed URL stops the "
             "start with a message listing these forms.", "Cache and Redis"),
    Variable("CACHE_PREFIX", "`infcache`", "Namespace of every Redis key.", "Cache and Redis"),
    Variable("CACHE_L1_MAX_BYTES", "256 MiB", "L1 (process memory) byte budget.", "Cache and Redis"),
    Variable("CACHE_L1_TTL_S", "`3600`", "L1 entry lifetime, in seconds.", "Cache and Redis"),
    Variable("CACHE_TTL_S", "`86400`", "L2 (Redis) entry lifetime, in seconds; every write has one.",
             "Cache and Redis"),
    Variable("CACHE_NEGATIVE_TTL_S", "`60`", "How long a rejected input is remembered, in seconds.",
             "Cache and Redis"),
    Variable("CACHE_SIGNING_KEY", "unset", "HMAC key (≥ 32 bytes) signing every L2 value; values it did "
             "not sign are refused, deleted, counted (`infcache_l2_forged_values`) and recomputed.",
             "Cache and Redis"),
    Variable("CACHE_SIGNING_KEYS", "unset", "Rotation instead of `CACHE_SIGNING_KEY`: `new,old` signs "
             "with `new` and accepts both; drop `old` once every replica runs `new`. Set one of the "
             "two, not both.", "Cache and Redis"),
    Variable("REDIS_SOCKET_TIMEOUT_S", "`0.25`", "Timeout of each Redis call, in seconds.",
             "Cache and Redis"),
    Variable("REDIS_MAXMEMORY_MB", "`256`", "The private Redis's `maxmemory` (`allkeys-lru`).",
             "Cache and Redis"),
    Variable("BREAKER_FAILURE_THRESHOLD", "`1`", "Circuit breaker: failed Redis calls before Redis is "
             "skipped.", "Cache and Redis"),
    Variable("BREAKER_RESET_S", "`2.0`", "Circuit breaker: delay before Redis is probed again "
             "(jittered, doubling up to 5 s).", "Cache and Redis"),
    # --- Log database -------------------------------------------------------------------
    Variable("DATABASE_URL", "SQLite under `DATA_DIR`", "Request and audit log database: "
             "`sqlite:///path` or `postgresql+psycopg://user:pass@host:5432/db` (one database shared by "
             "a fleet; schema migrated at start-up with Alembic).", "Log database"),
    Variable("LOG_RETENTION_DAYS", "`30`", "Request-log rows older than this are pruned.",
             "Log database"),
    Variable("LOG_MAX_ROWS", "`1000000`", "The request log keeps at most this many rows.",
             "Log database"),
    # --- Fairness and limits ------------------------------------------------------------
    Variable("CLIENT_MISS_RATE", "`0.5`", "Tokens per second of each client's miss budget, once its "
             "burst is spent. The budget is work-conserving: alone on a replica's model a client is "
             "served as fast as the model goes, however many new inputs it sends at once (spending "
             "tokens while it has them); while other clients want the same model (a miss in flight, or "
             "one started in the last 2 s), a client's one waiting miss is its round-robin turn and "
             "needs no token, each further one at once needs a token, and without one it is refused. A "
             "client that sends one new input at a time is never refused. Hits, coalesced answers and "
             "remembered rejections never count and are never refused. A refusal is a 429 with "
             "`Retry-After` (when its next token is there) or Gradio's error \"Too many new inputs from "
             "your address at once while others wait for the model…\"; `0` turns the budget off.",
             "Fairness and limits"),
    Variable("CLIENT_MISS_BURST", "`20`", "Tokens a client has after a pause (the bucket's size, at "
             "least 1); one bucket per client for the whole fleet, in Redis (each replica keeps its own "
             "while Redis is away).", "Fairness and limits"),
    Variable("FORWARDED_ALLOW_IPS", "`127.0.0.1,::1` (uvicorn's)", "Proxies, by address "
             "(comma-separated addresses or networks, `*` for any), whose `X-Forwarded-For` names the "
             "client: the right-most address in it that is not itself such a proxy. A direct caller "
             "cannot choose its identity. An IPv6 client is its /64.", "Fairness and limits"),
    Variable("FORWARDED_TRUSTED_HOPS", "`0`; **`1` on a Space** (`SPACE_ID` set)", "Proxies in front "
             "that append the client's address to `X-Forwarded-For`, trusted whatever their address: "
             "the client is the entry this many from the right (what the last proxy wrote; a caller can "
             "only prepend). Set 1 behind one load balancer or ingress at an address you cannot list; 0 "
             "where callers can reach the app directly. One untrusted peer forwarding several clients "
             "is logged once and shown in the console, since every visitor behind it would share one "
             "client's budget.", "Fairness and limits"),
    Variable("SPACE_ID", "unset (set by Hugging Face on a Space)", "Not for you to set: Hugging Face "
             "Spaces set it in every Space. When present, `FORWARDED_TRUSTED_HOPS` defaults to 1, so "
             "each visitor of a Space has a miss budget of their own.", "Fairness and limits"),
    Variable("MAX_UPLOAD_BYTES", "20 MiB", "Largest uploaded image (413 at the upload; the browser "
             "refuses it before sending).", "Fairness and limits"),
    Variable("MAX_IMAGE_PIXELS", "`40000000`", "Most pixels of an image (at most what Pillow decodes, "
             "178,956,970).", "Fairness and limits"),
    Variable("MAX_TEXT_CHARS", "`2000`", "Longest message.", "Fairness and limits"),
    Variable("MAX_HEADER_BYTES", "32 KiB", "A request's URL and headers together, on the app's own "
             "server (431; a head still incomplete after 30 s: 408). At least 4 KiB.",
             "Fairness and limits"),
    Variable("MAX_URL_BYTES", "8 KiB", "A request's URL alone (414). At least 1 KiB.",
             "Fairness and limits"),
    Variable("MAX_HEADER_COUNT", "`100`", "How many headers a request may have (431). At least 20.",
             "Fairness and limits"),
    Variable("MAX_GRADIO_BODY_BYTES", "1 MiB", "Body of Gradio's call, queue and component routes (413); "
             "uploads take `MAX_UPLOAD_BYTES` + 64 KiB.", "Fairness and limits"),
    # --- Fleet --------------------------------------------------------------------------
    Variable("REPLICA_ID", "`<hostname>-<pid>`", "Names this process in the request and audit logs and "
             "the replica registry (1–64 of letters, digits, `.`, `_`, `:`, `-`).", "Fleet"),
    Variable("GENERATION_REFRESH_S", "`0.5`", "How often a replica re-reads the generation (and the "
             "fleet's operation epoch).", "Fleet"),
    Variable("GENERATION_CONFIRM_S", "`2.0` (at least 2 × `GENERATION_REFRESH_S`)", "With Redis: how "
             "long a replica serves its L1 after it last confirmed the shared generation; past that, L1 "
             "reads are bypassed until it confirms again.", "Fleet"),
    Variable("FLEET_HEARTBEAT_S", "`1.0`", "Replica registry heartbeat; a replica missing 3 in a row is "
             "listed as lost.", "Fleet"),
    Variable("FLEET_ACK_TIMEOUT_S", "`5.0`", "How long a flush, bump or evict waits for every live "
             "replica's acknowledgement before answering (HTTP 202) with the ones that did not confirm.",
             "Fleet"),
    Variable("FLIGHT_LEASE_MAX_S", "`5.0`", "Single flight across replicas: the longest a miss waits on "
             "another replica's lease (and the lease of a task with no timing yet).", "Fleet"),
    # --- Hard examples and warm-up ------------------------------------------------------
    Variable("WARM_SET_SIZE", "`0` (off)", "Keep the inputs of this many hottest keys per task in Redis "
             "and recompute them in the background after a reload or a bump (these are users' inputs).",
             "Hard examples and warm-up"),
    Variable("WARM_SET_TTL_S", "`86400`", "Lifetime of the kept inputs, refreshed while the task gets "
             "requests.", "Hard examples and warm-up"),
    Variable("HARD_EXAMPLES_SIZE", "`0` (off)", "Keep this many inputs per task that the model was "
             "unsure of, for an operator to label and export (these are users' inputs).",
             "Hard examples and warm-up"),
    Variable("HARD_EXAMPLE_MAX_SCORE", "`0.5`", "A computed answer whose top score is below this is a "
             "hard example.", "Hard examples and warm-up"),
    Variable("HARD_EXAMPLE_MIN_MARGIN", "`0.1`", "… and one whose first two classes are closer than "
             "this.", "Hard examples and warm-up"),
    Variable("HARD_EXAMPLES_TTL_S", "`604800` (7 days)", "Lifetime of the kept examples and their "
             "labels, refreshed at every addition.", "Hard examples and warm-up"),
    Variable("HARD_EXAMPLES_CPU_SHARE", "`0.01`", "The most the collection may spend (storing PNGs, "
             "Redis writes), as a share of the misses' forward-pass time, after a 1 s burst at start; "
             "hard answers beyond it are counted, not kept.", "Hard examples and warm-up"),
    # --- Operator console ---------------------------------------------------------------
    Variable("MODEL_COST_PER_HOUR", "`0` (not shown)", "What an hour of model time costs, in any "
             "currency: the console and `/admin/api/worth` price the model time the cache saved with "
             "it.", "Operator console"),
    Variable("SIZING_MAX_KEYS", "`4096`", "Cache keys each sizing profile tracks (per task, and all "
             "tasks together): bounds the sampler's memory (about 1 MiB per 1,000 keys, both profiles) "
             "and CPU; `0` turns the sizing curves off.", "Operator console"),
    Variable("SIZING_CPU_SHARE", "`0.02`", "Share of one core the sizing sampler's background thread "
             "may use: above it the sampling rate falls (spatially, as SHARDS does), so a cache hit's "
             "added cost stays bounded at any request rate; `0`: no CPU bound (`SIZING_MAX_KEYS` alone "
             "bounds it).", "Operator console"),
    # --- Process ------------------------------------------------------------------------
    Variable("MALLOC_ARENA_MAX", "`2` (set by `app.py`)", "glibc's malloc arenas. `app.py` caps them at "
             "2 before any thread starts (one arena per allocating thread fragments memory under a "
             "threaded server); a value you set wins.", "Process", read_by="process_setup.py"),
)

HEADER = """\
# Configuration

<!-- Generated by `python -m settings_reference --write` from settings_reference.py; do not edit by
hand: tests/test_docs.py fails when this page and that module differ. -->

Every setting is an environment variable, read once at start-up (`Settings.from_env` in
`settings.py`); a value the app cannot run with stops the start with a message naming it.
Sizes are in bytes, durations in seconds. Example: `PORT=8080 REDIS_URL=off make run`.

Back to the [README](../README.md). The settings most people change are in the README's short
table; every one is below.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The whole of docs/CONFIGURATION.md."""
    unknown = {v.group for v in VARIABLES} - set(GROUPS)
    if unknown:
        raise ValueError(f"groups without a heading: {sorted(unknown)}")
    lines = [HEADER]
    lines.append("| group | variables |\n|---|---|")
    for group in GROUPS:
        names = ", ".join(f"`{v.name}`" for v in VARIABLES if v.group == group)
        anchor = group.lower().replace(" ", "-")
        lines.append(f"| [{group}](#{anchor}) | {names} |")
    for group, intro in GROUPS.items():
        lines.append(f"\n## {group}\n\n{intro}\n")
        lines.append("| variable | default | meaning |\n|---|---|---|")
        for v in (v for v in VARIABLES if v.group == group):
            meaning = v.meaning if v.read_by == "settings.py" else f"{v.meaning} (Read by `{v.read_by}`.)"
            lines.append(f"| `{v.name}` | {_cell(v.default)} | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the settings reference (docs/CONFIGURATION.md).")
    parser.add_argument("--write", action="store_true", help="write docs/CONFIGURATION.md, not stdout")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        PAGE.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
