"""The settings, one class per concern. Each field names its environment variable, its default
as the reference shows it and its meaning; docs/CONFIGURATION.md is generated from them."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, field_validator, model_validator

from settings.base import Float, Group, Int, Lower, var
from settings.errors import SettingsError
from settings.redis_url import parse_redis_url

MIB = 1024 * 1024
# Pillow refuses larger headers itself (2 x its MAX_IMAGE_PIXELS); ours must stay below.
PILLOW_PIXEL_CEILING = 178_956_970
# Concurrent forward passes per model that does not batch: on the CPU as many as there are
# cores (a pass uses about one; more only contend), on CUDA a few (kernels of small passes
# overlap; more queue on the device).
MISS_CONCURRENCY_CUDA = 4
MIN_SIGNING_KEY_BYTES = 32
# A person clicking through the demo starts a new input every few seconds at most, a handful
# in a row when trying the examples; a script that sends new inputs as fast as it can is held
# to one every 2 s after its first 20 (on 2 CPUs a model pass takes 10-50 ms: a flooder then
# holds a few % of the model, against all of it without a budget).
CLIENT_MISS_RATE = 0.5
CLIENT_MISS_BURST = 20
FORWARDED_ALLOW_IPS = "127.0.0.1,::1"  # uvicorn's default

# A replica id names a process in the request log, the audit log and the replica registry:
# short and printable, so it can sit in a Redis key and a SQL column (String(64)).
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def default_replica_id() -> str:
    """`<hostname>-<pid>`: unique per process on a host, readable in the console."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:48].strip("-.") or "host"
    return f"{host}-{os.getpid()}"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _given(data: Any, *keys: str) -> Any:
    """The first of `keys` in a group's raw input (by variable or by field name), else None."""
    return next((data[k] for k in keys if isinstance(data, dict) and k in data), None)


class Server(Group):
    """Where the app listens, where it keeps its files, who may use the console."""

    heading = "Server"

    port: Int = var("PORT", 7860, ge=1, shown="`7860`", description="HTTP port: the UI, the Gradio API, "
                    "REST (`/v2`) and the admin API all listen on it.")  # fmt: skip
    host: str = var("HOST", "0.0.0.0", shown="`0.0.0.0`", description="Address the server binds.")
    admin_token: str | None = var(
        "ADMIN_TOKEN", None, repr=False, shown="random, printed once in the log",
        description="Operator console and admin API token (8+ characters). Unset: a random token is "
        "generated at each start and printed once in the server log. Replicas of one fleet need the same "
        "one.",
    )  # fmt: skip
    data_dir: Path = var(
        "DATA_DIR", Path("data"), shown="`./data`",
        description="SQLite request log, the private Redis's socket and snapshots, ONNX exports (unless "
        "`ONNX_EXPORT_DIR`). On a Space with persistent storage: `/data`.",
    )  # fmt: skip
    # Names this process in the request and audit logs and in the replica registry.
    replica_id: str = var(
        "REPLICA_ID", default_factory=default_replica_id, shown="`<hostname>-<pid>`",
        description="Names this process in the request and audit logs and the replica registry (1–64 of "
        "letters, digits, `.`, `_`, `:`, `-`).",
    )  # fmt: skip
    # At start-up, how long readiness waits for Redis before it declares the replica ready
    # without L2 (it keeps serving from L1 and the model; the breaker finds Redis later).
    ready_l2_wait_s: Float = var(
        "READY_L2_WAIT_S", 10.0, ge=0.0, shown="`10`",
        description="At start-up, how long `/readyz` waits for Redis before the replica is ready without it "
        "(it keeps serving from L1 and the model; the breaker finds Redis later).",
    )  # fmt: skip

    @field_validator("admin_token")
    @classmethod
    def _long_enough(cls, token: str | None) -> str | None:
        if token is not None and len(token) < 8:
            raise SettingsError("ADMIN_TOKEN must be at least 8 characters (or unset to generate one)")
        return token

    @field_validator("replica_id")
    @classmethod
    def _printable(cls, value: str) -> str:
        if not _REPLICA_ID.fullmatch(value):
            raise SettingsError(
                f"REPLICA_ID={value!r} must be 1-64 characters of letters, digits, '.', '_', ':' or '-'"
            )
        return value


def _existing_file(value: Any) -> Any:
    if isinstance(value, str | Path):
        path = Path(value).expanduser()
        if not path.is_file():
            raise SettingsError(f"MODELS_CONFIG={str(value)!r} is not a file")
        return path
    return value


def _flag(value: Any) -> Any:
    """HALF_PRECISION: 0, 1, false or true (any case)."""
    if isinstance(value, str):
        text = value.lower()
        if text not in ("0", "1", "false", "true"):
            raise SettingsError(f"HALF_PRECISION={text!r} must be one of 0, 1, false, true")
        return text in ("1", "true")
    return value


class Models(Group):
    """Which models serve, on which device and backend, and how misses share the model."""

    heading = "Models"

    # A YAML file listing the served models (engine.models.config); None: the two built-ins.
    models_config: Annotated[Path | None, BeforeValidator(_existing_file)] = var(
        "MODELS_CONFIG", None, shown="unset (the two built-in models)",
        description="A YAML file listing the served models, one per task (see "
        "[MODELS.md](MODELS.md#your-own-model)); a bad entry stops the start with a message naming it.",
    )  # fmt: skip
    device: Annotated[Literal["auto", "cpu", "cuda"], Lower] = var(
        "DEVICE", "auto", shown="`auto`", description="`auto` (CUDA when available), `cpu` or `cuda`."
    )
    # The forward pass (engine.models.onnx_backend): auto = onnxruntime on the CPU, torch on CUDA.
    inference_backend: Annotated[Literal["auto", "torch", "onnxruntime"], Lower] = var(
        "INFERENCE_BACKEND", "auto", shown="`auto`",
        description="What runs a miss's forward pass: `auto` (ONNX Runtime on the CPU, torch on CUDA), "
        "`torch` or `onnxruntime`; a `MODELS_CONFIG` entry's `backend:` overrides it. A model stays on "
        "torch, with the reason in `/readyz` and the console, when its export or its exactness probe fails "
        "(see [MODELS.md](MODELS.md#a-miss-on-the-cpu-onnx-runtime-the-same-answers)).",
    )  # fmt: skip
    # Where ONNX exports are kept, one file per model version (None: DATA_DIR/onnx).
    onnx_export_dir: Path | None = var(
        "ONNX_EXPORT_DIR", None, shown="`DATA_DIR/onnx`",
        description="Where each model version's ONNX export is kept and reused.",
    )  # fmt: skip
    # CUDA only: run the image model in float16. Part of the model version.
    half_precision: Annotated[bool, BeforeValidator(_flag)] = var(
        "HALF_PRECISION", False, shown="`0`",
        description="CUDA only: the image model in float16 (part of its version).",
    )  # fmt: skip
    # Concurrent misses of a model that batches (the text model) share one forward pass of
    # at most this many inputs; 1 turns batching off.
    batch_max_size: Int = var(
        "BATCH_MAX_SIZE", 8, ge=1, shown="`8`",
        description="Most text misses in one shared forward pass; `1`: no batching.",
    )  # fmt: skip
    # How many misses of one model run at once (a batching model admits at least a full batch; on
    # torch it runs one pass at a time), by the device the model is on.
    miss_concurrency_cpu: Int = var(
        "MISS_CONCURRENCY_CPU", default_factory=lambda: min(4, usable_cores()), ge=1,
        shown="cores (at most 4)",
        description="Concurrent forward passes of a model on the CPU (on onnxruntime a batching model's "
        "batches too; on torch it runs one pass at a time and admits at least `BATCH_MAX_SIZE` misses to "
        "share it). Each ONNX session gets the cores divided by it: `1` gives one pass every core (a lone "
        "long input answers sooner, concurrent ones cost more CPU).",
    )  # fmt: skip
    miss_concurrency_cuda: Int = var(
        "MISS_CONCURRENCY_CUDA", MISS_CONCURRENCY_CUDA, ge=1, shown="`4`",
        description="The same, for a model on CUDA.",
    )  # fmt: skip

    def miss_concurrency_for(self, device: str) -> int:
        """The miss limit for a model on `device` ("cpu", "cuda:0", ...)."""
        return self.miss_concurrency_cuda if device.startswith("cuda") else self.miss_concurrency_cpu


def _signing_keys(data: Any) -> Any:
    """CACHE_SIGNING_KEYS=new,old (rotation) or CACHE_SIGNING_KEY=one, as a tuple, newest first."""
    if isinstance(data, dict):
        if isinstance(one := data.get("CACHE_SIGNING_KEY"), str):
            data = {**data, "CACHE_SIGNING_KEY": (one,)}
        if isinstance(many := data.get("CACHE_SIGNING_KEYS"), str):
            data = {**data, "CACHE_SIGNING_KEYS": tuple(k.strip() for k in many.split(","))}
    return data


class Cache(Group):
    """The two tiers (L1 in process memory, L2 in Redis): their keys, sizes and lifetimes, and the
    signature of what L2 holds."""

    heading = "Cache"

    prefix: str = var(
        "CACHE_PREFIX", "infcache", shown="`infcache`", description="Namespace of every Redis key."
    )
    l1_max_bytes: Int = var(
        "CACHE_L1_MAX_BYTES", 256 * MIB, ge=0, shown="256 MiB", description="L1 (process memory) byte budget."
    )
    l1_ttl_s: Float = var(
        "CACHE_L1_TTL_S", 3600.0, ge=0.001, shown="`3600`", description="L1 entry lifetime, in seconds."
    )
    ttl_s: Int = var(
        "CACHE_TTL_S", 86400, ge=1, shown="`86400`",
        description="L2 (Redis) entry lifetime, in seconds; every write has one.",
    )  # fmt: skip
    negative_ttl_s: Int = var(
        "CACHE_NEGATIVE_TTL_S", 60, ge=1, shown="`60`",
        description="How long a rejected input is remembered, in seconds.",
    )  # fmt: skip
    # HMAC keys for L2 values, newest first (empty: an unsigned checksum). Never in repr.
    signing_keys: tuple[str, ...] = var(
        "CACHE_SIGNING_KEY", (), repr=False, shown="unset",
        description="HMAC key (≥ 32 bytes) signing every L2 value; values it did not sign are refused, "
        "deleted, counted (`infcache_l2_forged_values`) and recomputed.",
        also=("CACHE_SIGNING_KEYS", "unset", "Rotation instead of `CACHE_SIGNING_KEY`: `new,old` signs with "
              "`new` and accepts both; drop `old` once every replica runs `new`. Set one of the two, not "
              "both."),
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _one_or_several_keys(cls, data: Any) -> Any:
        return _signing_keys(data)

    @field_validator("signing_keys")
    @classmethod
    def _strong_enough(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for number, key in enumerate(keys, start=1):
            # The value itself never goes into a message: this is a secret.
            if len(key.encode()) < MIN_SIGNING_KEY_BYTES:
                raise SettingsError(
                    f"cache signing key #{number} must be at least {MIN_SIGNING_KEY_BYTES} bytes"
                )
        return keys


def _redis_url(value: Any) -> Any:
    if isinstance(value, str):
        if value.lower() == "off":
            return "off"
        parse_redis_url(value)  # refused now, at start-up, rather than at the first request
    return value


class Redis(Group):
    """How Redis (L2) is reached, and what happens when it is slow or away."""

    heading = "Redis"

    # None: start a private redis-server when installed; "off": no L2; else a URL of
    # REDIS_URL_FORMS (one node, a cluster, or a Sentinel-managed primary).
    url: Annotated[str | None, BeforeValidator(_redis_url)] = var(
        "REDIS_URL", None, shown="unset (a private `redis-server`)",
        description="Unset: start a private `redis-server` on a unix socket under `DATA_DIR` (L1-only with a "
        "notice when it is not installed); `off`: no L2; one node: "
        "`redis://[[user]:password@]host[:port][/db]`, `rediss://…` (TLS), `unix:///path/redis.sock`; a "
        "Redis Cluster: `redis+cluster://[[user]:password@]host:port[,host:port…]` (any of its nodes; "
        "`rediss+cluster://` for TLS); the primary that Sentinels name: "
        "`redis+sentinel://[[user]:password@]host:port[,host:port…]/<service_name>[/db]` (the password is "
        "the data nodes'; `rediss+sentinel://` for TLS). A malformed URL stops the start with a message "
        "listing these forms.",
    )  # fmt: skip
    socket_timeout_s: Float = var(
        "REDIS_SOCKET_TIMEOUT_S", 0.25, ge=0.01, shown="`0.25`",
        description="Timeout of each Redis call, in seconds.",
    )  # fmt: skip
    maxmemory_mb: Int = var(
        "REDIS_MAXMEMORY_MB", 256, ge=1, shown="`256`",
        description="The private Redis's `maxmemory` (`allkeys-lru`).",
    )  # fmt: skip
    # One failed Redis call opens the breaker: a hit is first tried by Gradio's queue
    # probe and then by the queued call, and each would otherwise pay the socket timeout.
    breaker_failure_threshold: Int = var(
        "BREAKER_FAILURE_THRESHOLD", 1, ge=1, shown="`1`",
        description="Circuit breaker: failed Redis calls before Redis is skipped.",
    )  # fmt: skip
    breaker_reset_s: Float = var(
        "BREAKER_RESET_S", 2.0, ge=0.01, shown="`2.0`",
        description="Circuit breaker: delay before Redis is probed again (jittered, doubling up to 5 s).",
    )  # fmt: skip

    @property
    def l2_disabled(self) -> bool:
        return self.url == "off"


class Log(Group):
    """The request and audit log behind the operator console."""

    heading = "Log database"

    database_url: str | None = var(
        "DATABASE_URL", None, shown="SQLite under `DATA_DIR`",
        description="Request and audit log database: `sqlite:///path` or "
        "`postgresql+psycopg://user:pass@host:5432/db` (one database shared by a fleet; schema migrated at "
        "start-up with Alembic).",
    )  # fmt: skip
    retention_days: Float = var(
        "LOG_RETENTION_DAYS", 30.0, ge=0.001, shown="`30`",
        description="Request-log rows older than this are pruned.",
    )  # fmt: skip
    max_rows: Int = var(
        "LOG_MAX_ROWS", 1_000_000, ge=100, shown="`1000000`",
        description="The request log keeps at most this many rows.",
    )  # fmt: skip


class Limits(Group):
    """The bounds on every request (see [API.md](API.md#limits-on-every-request))."""

    heading = "Limits"

    max_upload_bytes: Int = var(
        "MAX_UPLOAD_BYTES", 20 * MIB, ge=1, shown="20 MiB",
        description="Largest uploaded image (413 at the upload; the browser refuses it before sending).",
    )  # fmt: skip
    max_image_pixels: Int = var(
        "MAX_IMAGE_PIXELS", 40_000_000, ge=1, shown="`40000000`",
        description="Most pixels of an image (at most what Pillow decodes, 178,956,970).",
    )  # fmt: skip
    max_text_chars: Int = var("MAX_TEXT_CHARS", 2000, ge=1, shown="`2000`", description="Longest message.")
    # Request heads (ui.limits): the URL and headers together, the URL alone, how many headers.
    max_header_bytes: Int = var(
        "MAX_HEADER_BYTES", 32 * 1024, ge=4096, shown="32 KiB",
        description="A request's URL and headers together, on the app's own server (431; a head still "
        "incomplete after 30 s: 408). At least 4 KiB.",
    )  # fmt: skip
    max_url_bytes: Int = var(
        "MAX_URL_BYTES", 8 * 1024, ge=1024, shown="8 KiB",
        description="A request's URL alone (414). At least 1 KiB.",
    )  # fmt: skip
    max_header_count: Int = var(
        "MAX_HEADER_COUNT", 100, ge=20, shown="`100`",
        description="How many headers a request may have (431). At least 20.",
    )  # fmt: skip
    # Bodies of Gradio's call, queue and component routes (uploads have MAX_UPLOAD_BYTES).
    max_gradio_body_bytes: Int = var(
        "MAX_GRADIO_BODY_BYTES", MIB, ge=64 * 1024, shown="1 MiB",
        description="Body of Gradio's call, queue and component routes (413); uploads take "
        "`MAX_UPLOAD_BYTES` + 64 KiB.",
    )  # fmt: skip

    @field_validator("max_image_pixels")
    @classmethod
    def _decodable(cls, value: int) -> int:
        if value > PILLOW_PIXEL_CEILING:
            raise SettingsError(
                f"MAX_IMAGE_PIXELS={value} exceeds what Pillow decodes ({PILLOW_PIXEL_CEILING})"
            )
        return value


class Fairness(Group):
    """The per-client miss budget, and how clients are told apart behind proxies."""

    heading = "Fairness and trust"

    # Fairness (engine.capacity.fairness): misses each client may start per second, and how many at
    # once after a pause (a token bucket shared by the fleet through Redis); 0: no budget.
    client_miss_rate: Float = var(
        "CLIENT_MISS_RATE", CLIENT_MISS_RATE, ge=0.0, shown="`0.5`",
        description="Tokens per second of each client's miss budget, once its burst is spent. The budget is "
        "work-conserving: alone on a replica's model a client is served as fast as the model goes, however "
        "many new inputs it sends at once (spending tokens while it has them); while other clients want the "
        "same model (a miss in flight, or one started in the last 2 s), a client's one waiting miss is its "
        "round-robin turn and needs no token, each further one at once needs a token, and without one it is "
        "refused. A client that sends one new input at a time is never refused. Hits, coalesced answers and "
        "remembered rejections never count and are never refused. A refusal is a 429 with `Retry-After` "
        "(when its next token is there) or Gradio's error \"Too many new inputs from your address at once "
        "while others wait for the model…\"; `0` turns the budget off.",
    )  # fmt: skip
    client_miss_burst: Int = var(
        "CLIENT_MISS_BURST", CLIENT_MISS_BURST, ge=1, shown="`20`",
        description="Tokens a client has after a pause (the bucket's size, at least 1); one bucket per "
        "client for the whole fleet, in Redis (each replica keeps its own while Redis is away).",
    )  # fmt: skip
    # Peers whose X-Forwarded-For names the client (uvicorn's setting and default); "*": any.
    forwarded_allow_ips: str = var(
        "FORWARDED_ALLOW_IPS", FORWARDED_ALLOW_IPS, shown="`127.0.0.1,::1` (uvicorn's)",
        description="Proxies, by address (comma-separated addresses or networks, `*` for any), whose "
        "`X-Forwarded-For` names the client: the right-most address in it that is not itself such a proxy. "
        "A direct caller cannot choose its identity. An IPv6 client is its /64.",
    )  # fmt: skip
    # Proxies in front that append the client's address to X-Forwarded-For, whatever their
    # address (engine.capacity.forwarding): the client is the entry this many from the right. 0: none;
    # on a Space (SPACE_ID set) 1, the platform's front.
    forwarded_trusted_hops: Int = var(
        "FORWARDED_TRUSTED_HOPS", 0, ge=0, shown="`0`; **`1` on a Space** (`SPACE_ID` set)",
        description="Proxies in front that append the client's address to `X-Forwarded-For`, trusted "
        "whatever their address: the client is the entry this many from the right (what the last proxy "
        "wrote; a caller can only prepend). Set 1 behind one load balancer or ingress at an address you "
        "cannot list; 0 where callers can reach the app directly. One untrusted peer forwarding several "
        "clients is logged once and shown in the console, since every visitor behind it would share one "
        "client's budget.",
    )  # fmt: skip
    # Hugging Face Spaces set SPACE_ID in every Space's environment.
    space_id: str | None = var(
        "SPACE_ID", None, shown="unset (set by Hugging Face on a Space)",
        description="Not for you to set: Hugging Face Spaces set it in every Space. When present, "
        "`FORWARDED_TRUSTED_HOPS` defaults to 1, so each visitor of a Space has a miss budget of their own.",
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _one_hop_on_a_space(cls, data: Any) -> Any:
        hops = _given(data, "FORWARDED_TRUSTED_HOPS", "forwarded_trusted_hops")
        if isinstance(data, dict) and hops is None:
            data = {**data, "forwarded_trusted_hops": int(bool(_given(data, "SPACE_ID", "space_id")))}
        return data


class Fleet(Group):
    """Several replicas sharing one Redis (see [DEPLOYMENT.md](DEPLOYMENT.md#running-several-replicas))."""

    heading = "Fleet"

    generation_refresh_s: Float = var(
        "GENERATION_REFRESH_S", 0.5, ge=0.01, shown="`0.5`",
        description="How often a replica re-reads the generation (and the fleet's operation epoch).",
    )  # fmt: skip
    # The fleet (engine/fleet/member.py): how long a replica serves L1 without confirming the shared
    # generation (then L1 reads are bypassed); under two refresh periods, one late poll would
    # switch L1 off on a healthy replica.
    generation_confirm_s: Float = var(
        "GENERATION_CONFIRM_S", 2.0, ge=0.01, shown="`2.0` (at least 2 × `GENERATION_REFRESH_S`)",
        description="With Redis: how long a replica serves its L1 after it last confirmed the shared "
        "generation; past that, L1 reads are bypassed until it confirms again.",
    )  # fmt: skip
    # Registry heartbeat (a record outlives 3 missed beats), and how long a flush/bump/evict
    # waits for every live replica's acknowledgement.
    heartbeat_s: Float = var(
        "FLEET_HEARTBEAT_S", 1.0, ge=0.05, shown="`1.0`",
        description="Replica registry heartbeat; a replica missing 3 in a row is listed as lost.",
    )  # fmt: skip
    ack_timeout_s: Float = var(
        "FLEET_ACK_TIMEOUT_S", 5.0, ge=0.1, shown="`5.0`",
        description="How long a flush, bump or evict waits for every live replica's acknowledgement before "
        "answering (HTTP 202) with the ones that did not confirm.",
    )  # fmt: skip
    # Single flight across replicas: the longest a miss waits on another replica's lease.
    flight_lease_max_s: Float = var(
        "FLIGHT_LEASE_MAX_S", 5.0, ge=0.1, shown="`5.0`",
        description="Single flight across replicas: the longest a miss waits on another replica's lease (and "
        "the lease of a task with no timing yet).",
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _confirm_after_two_refreshes(cls, data: Any) -> Any:
        if isinstance(data, dict) and _given(data, "GENERATION_CONFIRM_S", "generation_confirm_s") is None:
            refresh = _given(data, "GENERATION_REFRESH_S", "generation_refresh_s")
            try:
                refresh = 0.5 if refresh is None else float(refresh)
            except (TypeError, ValueError):
                return data  # refused by the field itself
            data = {**data, "generation_confirm_s": max(2.0, 2 * refresh)}
        return data

    @model_validator(mode="after")
    def _confirm_bound(self) -> Fleet:
        if self.generation_confirm_s < 2 * self.generation_refresh_s:
            raise SettingsError(
                f"GENERATION_CONFIRM_S={self.generation_confirm_s} must be at least 2 x GENERATION_REFRESH_S "
                f"({self.generation_refresh_s})"
            )
        return self


def _rate(name: str, default: float, *, shown: str, description: str) -> Any:
    """A share, 0 to 1."""
    return var(name, default, ge=0.0, le=1.0, shown=shown, description=description)


class Quality(Group):
    """Checking answers after the fact: shadow verification of cache hits, and hard examples, the
    inputs the model was unsure of, kept in Redis on purpose (off by default; see
    [CONSOLE.md](CONSOLE.md#hard-examples))."""

    heading = "Shadow verification and hard examples"

    # Chance that a cache hit draws its entry for a recomputation off the request path, while the
    # model is idle; each entry (key and answer) is checked once, not at every draw (0: off).
    shadow_sample_rate: Float = _rate(
        "SHADOW_SAMPLE_RATE", 0.01, shown="`0.01`",
        description="Chance that a cache hit has its entry recomputed off the request path while the model "
        "is idle and compared (tolerance 1e-5); each entry (key and answer) is checked once, so a hot key "
        "is checked after about 1/rate of its hits and not again while its answer is unchanged; a mismatch "
        "evicts the entry everywhere; `0` turns it off.",
    )  # fmt: skip
    # Hard examples (engine.quality.hard_examples): inputs per task the model was unsure of (top score
    # below HARD_EXAMPLE_MAX_SCORE or top-two margin below HARD_EXAMPLE_MIN_MARGIN, or shadow
    # verification disagreed), kept in Redis for HARD_EXAMPLES_TTL_S to be labelled; 0: off.
    hard_examples_size: Int = var(
        "HARD_EXAMPLES_SIZE", 0, ge=0, shown="`0` (off)",
        description="Keep this many inputs per task that the model was unsure of, for an operator to label "
        "and export (these are users' inputs).",
    )  # fmt: skip
    hard_example_max_score: Float = _rate(
        "HARD_EXAMPLE_MAX_SCORE", 0.5, shown="`0.5`",
        description="A computed answer whose top score is below this is a hard example.",
    )  # fmt: skip
    hard_example_min_margin: Float = _rate(
        "HARD_EXAMPLE_MIN_MARGIN", 0.1, shown="`0.1`",
        description="… and one whose first two classes are closer than this.",
    )  # fmt: skip
    hard_examples_ttl_s: Int = var(
        "HARD_EXAMPLES_TTL_S", 7 * 86_400, ge=1, shown="`604800` (7 days)",
        description="Lifetime of the kept examples and their labels, refreshed at every addition.",
    )  # fmt: skip
    # The most the collection may spend, as a share of the model's forward time on misses.
    hard_examples_cpu_share: Float = _rate(
        "HARD_EXAMPLES_CPU_SHARE", 0.01, shown="`0.01`",
        description="The most the collection may spend (storing PNGs, Redis writes), as a share of the "
        "misses' forward-pass time, after a 1 s burst at start; hard answers beyond it are counted, not "
        "kept.",
    )  # fmt: skip


class Warmup(Group):
    """Recomputing the hottest keys after a model reload or a generation bump, from their inputs:
    users' inputs kept in Redis on purpose (off by default; see [CONSOLE.md](CONSOLE.md#warm-up))."""

    heading = "Warm-up"

    # Inputs of the hottest keys per task kept in Redis (with WARM_SET_TTL_S) to recompute
    # after a model swap or a generation bump (engine.lifecycle.warmup); 0: off, nothing kept.
    size: Int = var(
        "WARM_SET_SIZE", 0, ge=0, shown="`0` (off)",
        description="Keep the inputs of this many hottest keys per task in Redis and recompute them in the "
        "background after a reload or a bump (these are users' inputs).",
    )  # fmt: skip
    ttl_s: Int = var(
        "WARM_SET_TTL_S", 86_400, ge=1, shown="`86400`",
        description="Lifetime of the kept inputs, refreshed while the task gets requests.",
    )  # fmt: skip


class Console(Group):
    """The console's answers: what caching is worth and how big the tiers should be."""

    heading = "Operator console"

    # What an hour of model time costs (any currency): the console prices the time the cache
    # saved with it; 0 leaves money out.
    model_cost_per_hour: Float = var(
        "MODEL_COST_PER_HOUR", 0.0, ge=0.0, shown="`0` (not shown)",
        description="What an hour of model time costs, in any currency: the console and `/admin/api/worth` "
        "price the model time the cache saved with it.",
    )  # fmt: skip
    # Keys each sizing profile tracks (engine.sizing.key_sampler): bounds its memory (~300 B a key)
    # and CPU; 0 turns the sizing curves off.
    sizing_max_keys: Int = var(
        "SIZING_MAX_KEYS", 4096, ge=0, shown="`4096`",
        description="Cache keys each sizing profile tracks (per task, and all tasks together): bounds the "
        "sampler's memory (about 1 MiB per 1,000 keys, both profiles) and CPU; `0` turns the sizing curves "
        "off.",
    )  # fmt: skip
    # Share of one core the sizing sampler's background updates may take (engine.sizing.key_sampler's
    # CpuBudget): past it the sampling rate falls, so a hit's cost stays bounded at any request
    # rate; 0: no CPU bound (SIZING_MAX_KEYS alone bounds it).
    sizing_cpu_share: Float = _rate(
        "SIZING_CPU_SHARE", 0.02, shown="`0.02`",
        description="Share of one core the sizing sampler's background thread may use: above it the sampling "
        "rate falls (spatially, as SHARDS does), so a cache hit's added cost stays bounded at any request "
        "rate; `0`: no CPU bound (`SIZING_MAX_KEYS` alone bounds it).",
    )  # fmt: skip
