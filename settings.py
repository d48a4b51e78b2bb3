"""One settings object, read from the environment once at start-up and passed down.

Libraries below (engine/, storage/, admin/) take plain arguments and never read
the environment themselves.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

MIB = 1024 * 1024
# Pillow refuses larger headers itself (2 x its MAX_IMAGE_PIXELS); ours must stay below.
PILLOW_PIXEL_CEILING = 178_956_970

N = TypeVar("N", int, float)


class SettingsError(ValueError):
    """An environment variable holds a value the app cannot run with."""


def _number(
    env: Mapping[str, str], name: str, default: N, *, minimum: N, parse: Callable[[str], N], kind: str
) -> N:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not {kind}") from None
    if value < minimum:
        raise SettingsError(f"{name}={value} must be >= {minimum}")
    return value


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0) -> int:
    return _number(env, name, default, minimum=minimum, parse=int, kind="an integer")


def _float(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    return _number(env, name, default, minimum=minimum, parse=float, kind="a number")


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env.get(name, "").strip().lower() or default
    if value not in choices:
        raise SettingsError(f"{name}={value!r} must be one of {', '.join(choices)}")
    return value


def _bounded_pixels(env: Mapping[str, str]) -> int:
    value = _int(env, "MAX_IMAGE_PIXELS", 40_000_000, minimum=1)
    if value > PILLOW_PIXEL_CEILING:
        raise SettingsError(f"MAX_IMAGE_PIXELS={value} exceeds what Pillow decodes ({PILLOW_PIXEL_CEILING})")
    return value


def _models_config(env: Mapping[str, str]) -> Path | None:
    raw = env.get("MODELS_CONFIG", "").strip()
    if not raw:
        return None
    path = Path(raw).expanduser()
    if not path.is_file():
        raise SettingsError(f"MODELS_CONFIG={raw!r} is not a file")
    return path


def _admin_token(env: Mapping[str, str]) -> str | None:
    token = env.get("ADMIN_TOKEN", "").strip() or None
    if token is not None and len(token) < 8:
        raise SettingsError("ADMIN_TOKEN must be at least 8 characters (or unset to generate one)")
    return token


# REDIS_URL's accepted forms, shown whole in every refusal so the fix is in the message.
REDIS_URL_FORMS = (
    "redis://[[user]:password@]host[:port][/db] or rediss://... (TLS): one node; "
    "unix:///path/to/redis.sock[?db=N]; "
    "redis+cluster://[[user]:password@]host:port[,host:port...] or rediss+cluster://...: a Redis Cluster "
    "(any of its nodes); "
    "redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db] or rediss+sentinel://...: "
    "the primary that these Sentinels name; "
    "off: no L2"
)
_NODE_SCHEMES = ("redis://", "rediss://", "unix://")
_MULTI_SCHEMES = {
    "redis+cluster": ("cluster", False), "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False), "rediss+sentinel": ("sentinel", True),
}  # fmt: skip
_DEFAULT_PORTS = {"cluster": 6379, "sentinel": 26379}


@dataclass(frozen=True)
class RedisTarget:
    """A parsed REDIS_URL. `kind` "node": `url` goes to redis-py as it is; "cluster" and
    "sentinel": the seed `nodes` (Sentinels for "sentinel"), the `service` name and `db`."""

    kind: str  # "node" | "cluster" | "sentinel"
    url: str = field(repr=False)
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False


def redact_url(url: str) -> str:
    """The URL with any credentials replaced by ***, for messages and logs."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # [v6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or (port and not port.isdigit()) or not 0 < int(port or default_port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port or default_port)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse REDIS_URL (any form of REDIS_URL_FORMS but "off"); SettingsError when malformed."""
    from urllib.parse import unquote

    def refuse(why: str) -> SettingsError:
        return SettingsError(f"REDIS_URL={redact_url(url)!r}: {why}. Accepted forms: {REDIS_URL_FORMS}")

    scheme, sep, rest = url.partition("://")
    if url.startswith(_NODE_SCHEMES):
        if scheme != "unix":
            netloc, _, path = rest.partition("/")
            try:
                _host_port(netloc.rpartition("@")[2] or "localhost", 6379)
            except ValueError as exc:
                raise refuse(str(exc)) from None
            if path.split("?")[0] and not path.split("?")[0].isdigit():
                raise refuse(f"the database {path!r} is not a number")
        elif not rest.strip("/"):
            raise refuse("a unix:// URL needs the socket's path")
        return RedisTarget(kind="node", url=url)
    if not sep or scheme.lower() not in _MULTI_SCHEMES:
        raise refuse(f"unknown scheme {scheme + sep if sep else url!r}")
    kind, tls = _MULTI_SCHEMES[scheme.lower()]
    credentials, _, hosts_and_path = rest.rpartition("@")
    username, password = None, None
    if credentials:
        user, colon, secret = credentials.partition(":")
        username, password = (unquote(user) or None, unquote(secret)) if colon else (None, unquote(user))
    hosts, _, path = hosts_and_path.partition("/")
    try:
        nodes = tuple(_host_port(h.strip(), _DEFAULT_PORTS[kind]) for h in hosts.split(","))
    except ValueError as exc:
        raise refuse(str(exc)) from None
    parts = [p for p in path.split("/") if p]
    if kind == "cluster":
        if parts and parts != ["0"]:
            raise refuse("a cluster has one database (0) and takes no path")
        return RedisTarget(kind, url, nodes, None, 0, username, password, tls)
    if not parts or len(parts) > 2:
        raise refuse("a sentinel URL ends in /service_name or /service_name/db")
    if len(parts) == 2 and not parts[1].isdigit():
        raise refuse(f"the database {parts[1]!r} is not a number")
    db = int(parts[1]) if len(parts) == 2 else 0
    return RedisTarget(kind, url, nodes, unquote(parts[0]), db, username, password, tls)


def _redis_url(env: Mapping[str, str]) -> str | None:
    value = env.get("REDIS_URL", "").strip() or None
    if value is None or value.lower() == "off":
        return None if value is None else "off"
    parse_redis_url(value)  # refused now, at start-up, rather than at the first request
    return value


# A replica id names a process in the request log, the audit log and the replica registry:
# short and printable, so it can sit in a Redis key and a SQL column (String(64)).
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def default_replica_id() -> str:
    """`<hostname>-<pid>`: unique per process on a host, readable in the console."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:48].strip("-.") or "host"
    return f"{host}-{os.getpid()}"


def _replica_id(env: Mapping[str, str]) -> str:
    value = env.get("REPLICA_ID", "").strip()
    if not value:
        return default_replica_id()
    if not _REPLICA_ID.fullmatch(value):
        raise SettingsError(
            f"REPLICA_ID={value!r} must be 1-64 characters of letters, digits, '.', '_', ':' or '-'"
        )
    return value


def _signing_keys(env: Mapping[str, str]) -> tuple[str, ...]:
    """CACHE_SIGNING_KEYS=new,old (rotation) or CACHE_SIGNING_KEY=one; newest first."""
    many = env.get("CACHE_SIGNING_KEYS", "").strip()
    one = env.get("CACHE_SIGNING_KEY", "").strip()
    if many and one:
        raise SettingsError("set CACHE_SIGNING_KEY or CACHE_SIGNING_KEYS, not both")
    keys = tuple(k.strip() for k in many.split(",")) if many else ((one,) if one else ())
    for number, key in enumerate(keys, start=1):
        # The value itself never goes into a message: this is a secret.
        if len(key.encode()) < MIN_SIGNING_KEY_BYTES:
            raise SettingsError(f"cache signing key #{number} must be at least {MIN_SIGNING_KEY_BYTES} bytes")
    return keys


def _rate(env: Mapping[str, str], name: str, default: float) -> float:
    value = _float(env, name, default, minimum=0.0)
    if value > 1.0:
        raise SettingsError(f"{name}={value} must be between 0 and 1")
    return value


def _confirm_bound(env: Mapping[str, str]) -> float:
    # Under two refresh periods, one late poll would switch L1 off on a healthy replica.
    refresh = _float(env, "GENERATION_REFRESH_S", 0.5, minimum=0.01)
    value = _float(env, "GENERATION_CONFIRM_S", max(2.0, 2 * refresh), minimum=0.01)
    if value < 2 * refresh:
        raise SettingsError(
            f"GENERATION_CONFIRM_S={value} must be at least 2 x GENERATION_REFRESH_S ({refresh})"
        )
    return value


def _on_a_space(env: Mapping[str, str]) -> bool:
    """Hugging Face Spaces set SPACE_ID in every Space's environment."""
    return bool(env.get("SPACE_ID", "").strip())


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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


@dataclass(frozen=True)
class Settings:
    port: int = 7860
    host: str = "0.0.0.0"
    device: str = "auto"  # auto | cpu | cuda
    # The forward pass (engine.models.onnx_backend): auto = onnxruntime on the CPU, torch on CUDA.
    inference_backend: str = "auto"
    # Where ONNX exports are kept, one file per model version (None: DATA_DIR/onnx).
    onnx_export_dir: Path | None = None
    # CUDA only: run the image model in float16. Part of the model version.
    half_precision: bool = False
    # None: start a private redis-server when installed; "off": no L2; else a URL of
    # REDIS_URL_FORMS (one node, a cluster, or a Sentinel-managed primary).
    redis_url: str | None = None
    data_dir: Path = field(default_factory=lambda: Path("data"))
    database_url: str | None = None
    # Names this process in the request and audit logs and in the replica registry.
    replica_id: str = field(default_factory=default_replica_id)
    admin_token: str | None = None
    cache_prefix: str = "infcache"
    cache_l1_max_bytes: int = 256 * MIB
    cache_l1_ttl_s: float = 3600.0
    cache_ttl_s: int = 86400
    cache_negative_ttl_s: int = 60
    redis_socket_timeout_s: float = 0.25
    redis_maxmemory_mb: int = 256
    # One failed Redis call opens the breaker: a hit is first tried by Gradio's queue
    # probe and then by the queued call, and each would otherwise pay the socket timeout.
    breaker_failure_threshold: int = 1
    breaker_reset_s: float = 2.0
    generation_refresh_s: float = 0.5
    # The fleet (engine/fleet/member.py): registry heartbeat (a record outlives 3 missed beats), how
    # long a flush/bump/evict waits for every live replica's acknowledgement, and how long a
    # replica serves L1 without confirming the shared generation (then L1 reads are bypassed).
    fleet_heartbeat_s: float = 1.0
    fleet_ack_timeout_s: float = 5.0
    generation_confirm_s: float = 2.0
    # Single flight across replicas: the longest a miss waits on another replica's lease.
    flight_lease_max_s: float = 5.0
    max_upload_bytes: int = 20 * MIB
    max_image_pixels: int = 40_000_000
    max_text_chars: int = 2000
    # Request heads (ui.limits): the URL and headers together, the URL alone, how many headers.
    max_header_bytes: int = 32 * 1024
    max_url_bytes: int = 8 * 1024
    max_header_count: int = 100
    # Bodies of Gradio's call, queue and component routes (uploads have MAX_UPLOAD_BYTES).
    max_gradio_body_bytes: int = MIB
    log_retention_days: float = 30.0
    log_max_rows: int = 1_000_000
    # Concurrent misses of a model that batches (the text model) share one forward pass of
    # at most this many inputs; 1 turns batching off.
    batch_max_size: int = 8
    # How many misses of one model run at once (models that batch run one pass at a time and
    # admit at least a full batch), by the device the model is on.
    miss_concurrency_cpu: int = field(default_factory=lambda: min(4, usable_cores()))
    miss_concurrency_cuda: int = MISS_CONCURRENCY_CUDA
    # At start-up, how long readiness waits for Redis before it declares the replica ready
    # without L2 (it keeps serving from L1 and the model; the breaker finds Redis later).
    ready_l2_wait_s: float = 10.0
    # HMAC keys for L2 values, newest first (empty: an unsigned checksum). Never in repr.
    cache_signing_keys: tuple[str, ...] = field(default=(), repr=False)
    # Share of cache hits recomputed off the request path, while the model is idle (0: off).
    shadow_sample_rate: float = 0.01
    # A YAML file listing the served models (engine.models.config); None: the two built-ins.
    models_config: Path | None = None
    # Inputs of the hottest keys per task kept in Redis (with WARM_SET_TTL_S) to recompute
    # after a model swap or a generation bump (engine.lifecycle.warmup); 0: off, nothing kept.
    warm_set_size: int = 0
    warm_set_ttl_s: int = 86_400
    # Fairness (engine.capacity.fairness): misses each client may start per second, and how many at
    # once after a pause (a token bucket shared by the fleet through Redis); 0: no budget.
    client_miss_rate: float = CLIENT_MISS_RATE
    client_miss_burst: int = CLIENT_MISS_BURST
    # Peers whose X-Forwarded-For names the client (uvicorn's setting and default); "*": any.
    forwarded_allow_ips: str = FORWARDED_ALLOW_IPS
    # Proxies in front that append the client's address to X-Forwarded-For, whatever their
    # address (engine.capacity.forwarding): the client is the entry this many from the right. 0: none;
    # on a Space (SPACE_ID set) 1, the platform's front.
    forwarded_trusted_hops: int = 0
    # Hard examples (engine.quality.hard_examples): inputs per task the model was unsure of (top score
    # below HARD_EXAMPLE_MAX_SCORE or top-two margin below HARD_EXAMPLE_MIN_MARGIN, or shadow
    # verification disagreed), kept in Redis for HARD_EXAMPLES_TTL_S to be labelled; 0: off.
    hard_examples_size: int = 0
    hard_examples_ttl_s: int = 7 * 86_400
    hard_example_max_score: float = 0.5
    hard_example_min_margin: float = 0.1
    # The most the collection may spend, as a share of the model's forward time on misses.
    hard_examples_cpu_share: float = 0.01
    # What an hour of model time costs (any currency): the console prices the time the cache
    # saved with it; 0 leaves money out.
    model_cost_per_hour: float = 0.0
    # Keys each sizing profile tracks (engine.sizing.key_sampler): bounds its memory (~300 B a key)
    # and CPU; 0 turns the sizing curves off.
    sizing_max_keys: int = 4096
    # Share of one core the sizing sampler's background updates may take (engine.sizing.key_sampler's
    # CpuBudget): past it the sampling rate falls, so a hit's cost stays bounded at any request
    # rate; 0: no CPU bound (SIZING_MAX_KEYS alone bounds it).
    sizing_cpu_share: float = 0.02

    def miss_concurrency_for(self, device: str) -> int:
        """The miss limit for a model on `device` ("cpu", "cuda:0", ...)."""
        return self.miss_concurrency_cuda if device.startswith("cuda") else self.miss_concurrency_cpu

    @property
    def export_dir(self) -> Path:
        return self.onnx_export_dir or self.data_dir / "onnx"

    @property
    def l2_disabled(self) -> bool:
        return self.redis_url == "off"

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "requests.sqlite3"

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.sqlite_path}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        redis_url = _redis_url(env)
        return cls(
            port=_int(env, "PORT", 7860, minimum=1),
            host=env.get("HOST", "0.0.0.0").strip() or "0.0.0.0",
            device=_choice(env, "DEVICE", "auto", ("auto", "cpu", "cuda")),
            inference_backend=_choice(env, "INFERENCE_BACKEND", "auto", ("auto", "torch", "onnxruntime")),
            onnx_export_dir=Path(d) if (d := env.get("ONNX_EXPORT_DIR", "").strip()) else None,
            half_precision=_choice(env, "HALF_PRECISION", "0", ("0", "1", "false", "true")) in ("1", "true"),
            redis_url=redis_url,
            data_dir=Path(env.get("DATA_DIR", "").strip() or "data"),
            database_url=env.get("DATABASE_URL", "").strip() or None,
            replica_id=_replica_id(env),
            admin_token=_admin_token(env),
            cache_prefix=env.get("CACHE_PREFIX", "").strip() or "infcache",
            cache_l1_max_bytes=_int(env, "CACHE_L1_MAX_BYTES", 256 * MIB, minimum=0),
            cache_l1_ttl_s=_float(env, "CACHE_L1_TTL_S", 3600.0, minimum=0.001),
            cache_ttl_s=_int(env, "CACHE_TTL_S", 86400, minimum=1),
            cache_negative_ttl_s=_int(env, "CACHE_NEGATIVE_TTL_S", 60, minimum=1),
            batch_max_size=_int(env, "BATCH_MAX_SIZE", 8, minimum=1),
            miss_concurrency_cpu=_int(env, "MISS_CONCURRENCY_CPU", min(4, usable_cores()), minimum=1),
            miss_concurrency_cuda=_int(env, "MISS_CONCURRENCY_CUDA", MISS_CONCURRENCY_CUDA, minimum=1),
            ready_l2_wait_s=_float(env, "READY_L2_WAIT_S", 10.0, minimum=0.0),
            redis_socket_timeout_s=_float(env, "REDIS_SOCKET_TIMEOUT_S", 0.25, minimum=0.01),
            redis_maxmemory_mb=_int(env, "REDIS_MAXMEMORY_MB", 256, minimum=1),
            breaker_failure_threshold=_int(env, "BREAKER_FAILURE_THRESHOLD", 1, minimum=1),
            breaker_reset_s=_float(env, "BREAKER_RESET_S", 2.0, minimum=0.01),
            generation_refresh_s=_float(env, "GENERATION_REFRESH_S", 0.5, minimum=0.01),
            fleet_heartbeat_s=_float(env, "FLEET_HEARTBEAT_S", 1.0, minimum=0.05),
            fleet_ack_timeout_s=_float(env, "FLEET_ACK_TIMEOUT_S", 5.0, minimum=0.1),
            generation_confirm_s=_confirm_bound(env),
            flight_lease_max_s=_float(env, "FLIGHT_LEASE_MAX_S", 5.0, minimum=0.1),
            max_upload_bytes=_int(env, "MAX_UPLOAD_BYTES", 20 * MIB, minimum=1),
            max_image_pixels=_bounded_pixels(env),
            max_text_chars=_int(env, "MAX_TEXT_CHARS", 2000, minimum=1),
            max_header_bytes=_int(env, "MAX_HEADER_BYTES", 32 * 1024, minimum=4096),
            max_url_bytes=_int(env, "MAX_URL_BYTES", 8 * 1024, minimum=1024),
            max_header_count=_int(env, "MAX_HEADER_COUNT", 100, minimum=20),
            max_gradio_body_bytes=_int(env, "MAX_GRADIO_BODY_BYTES", MIB, minimum=64 * 1024),
            log_retention_days=_float(env, "LOG_RETENTION_DAYS", 30.0, minimum=0.001),
            log_max_rows=_int(env, "LOG_MAX_ROWS", 1_000_000, minimum=100),
            cache_signing_keys=_signing_keys(env),
            shadow_sample_rate=_rate(env, "SHADOW_SAMPLE_RATE", 0.01),
            models_config=_models_config(env),
            warm_set_size=_int(env, "WARM_SET_SIZE", 0, minimum=0),
            warm_set_ttl_s=_int(env, "WARM_SET_TTL_S", 86_400, minimum=1),
            client_miss_rate=_float(env, "CLIENT_MISS_RATE", CLIENT_MISS_RATE, minimum=0.0),
            client_miss_burst=_int(env, "CLIENT_MISS_BURST", CLIENT_MISS_BURST, minimum=1),
            forwarded_allow_ips=env.get("FORWARDED_ALLOW_IPS", "").strip() or FORWARDED_ALLOW_IPS,
            forwarded_trusted_hops=_int(env, "FORWARDED_TRUSTED_HOPS", int(_on_a_space(env)), minimum=0),
            hard_examples_size=_int(env, "HARD_EXAMPLES_SIZE", 0, minimum=0),
            hard_examples_ttl_s=_int(env, "HARD_EXAMPLES_TTL_S", 7 * 86_400, minimum=1),
            hard_example_max_score=_rate(env, "HARD_EXAMPLE_MAX_SCORE", 0.5),
            hard_example_min_margin=_rate(env, "HARD_EXAMPLE_MIN_MARGIN", 0.1),
            hard_examples_cpu_share=_rate(env, "HARD_EXAMPLES_CPU_SHARE", 0.01),
            model_cost_per_hour=_float(env, "MODEL_COST_PER_HOUR", 0.0, minimum=0.0),
            sizing_max_keys=_int(env, "SIZING_MAX_KEYS", 4096, minimum=0),
            sizing_cpu_share=_rate(env, "SIZING_CPU_SHARE", 0.02),
        )
