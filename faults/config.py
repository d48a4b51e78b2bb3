"""The suite's settings: what each app is given, and the sizes of a run (full, quick, CI)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
PREFIX = "infcache"  # the app's default CACHE_PREFIX
TOKEN = "faults-suite-operator-token"
SOCKET_TIMEOUT_S = 0.25  # REDIS_SOCKET_TIMEOUT_S given to the apps (the default)
REFRESH_S = 0.5  # GENERATION_REFRESH_S given to the apps (the default)
REDIS_MAXMEMORY_MB = 256
# An input error worded like this is a server fault reaching the user, not a verdict on the input.
SERVER_FAULT_WORDS = ("Traceback", "Something went wrong", "model failed", "Internal Server Error")
# The settings each app gets from us; inherited values of these are dropped.
APP_SETTINGS = (
    "PORT",
    "HOST",
    "DEVICE",
    "HALF_PRECISION",
    "REDIS_URL",
    "DATA_DIR",
    "DATABASE_URL",
    "ADMIN_TOKEN",
    "CACHE_PREFIX",
    "CACHE_L1_MAX_BYTES",
    "CACHE_L1_TTL_S",
    "CACHE_TTL_S",
    "CACHE_NEGATIVE_TTL_S",
    "REDIS_SOCKET_TIMEOUT_S",
    "REDIS_MAXMEMORY_MB",
    "BREAKER_FAILURE_THRESHOLD",
    "BREAKER_RESET_S",
    "GENERATION_REFRESH_S",
    "GENERATION_CONFIRM_S",
    "FLEET_HEARTBEAT_S",
    "FLEET_ACK_TIMEOUT_S",
    "FLIGHT_LEASE_MAX_S",
    "MAX_UPLOAD_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_TEXT_CHARS",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_COUNT",
    "MAX_URL_BYTES",
    "MAX_GRADIO_BODY_BYTES",
    "LOG_RETENTION_DAYS",
    "LOG_MAX_ROWS",
    "GRADIO_TEMP_DIR",
)


@dataclass(frozen=True)
class Sizes:
    label: str
    images: int = 40  # distinct image inputs in the load pool
    texts: int = 160  # distinct text inputs in the load pool
    threads: int = 4  # concurrent clients
    phase_s: float = 4.0  # load before and after a fault
    outage_s: float = 4.0  # Redis down
    pause_s: float = 5.0  # CLIENT PAUSE
    lock_s: float = 8.0  # SQLite held by another writer
    bumps: int = 5
    corrupt_inputs: int = 48
    malformed_images: int = 2400
    hostile_texts: int = 400
    brute_attempts: int = 60
    flight_callers: int = 200  # in one engine
    flight_http_callers: int = 200  # over HTTP, to one app
    edge_photos: int = 4  # photos behind the valid edge-case files (x14 formats)
    gradio_client_cases: int = 200  # of the malformed inputs, also sent through gradio_client
    attack_s: float = 8.0  # each hostile-HTTP attack (scenarios_hostile)
    attackers: int = 3  # concurrent attackers
    huge_body_mb: int = 400  # each huge Gradio body, streamed (refused long before its end)
    request_timeout_s: float = 60.0
    recovery_limit_s: float = 10.0  # L2 back in use after Redis returns
    restart_between: bool = True  # restart a stopped app when more scenarios follow


FULL = Sizes("full")
QUICK = Sizes(
    "quick",
    images=16,
    texts=60,
    phase_s=2.0,
    outage_s=2.0,
    pause_s=3.0,
    lock_s=4.0,
    bumps=2,
    corrupt_inputs=24,
    malformed_images=300,
    hostile_texts=80,
    gradio_client_cases=60,
    brute_attempts=30,
    attack_s=3.0,
    huge_body_mb=200,
)
CI = Sizes(
    "ci",
    images=8,
    texts=24,
    threads=3,
    phase_s=1.5,
    outage_s=1.5,
    pause_s=2.5,
    lock_s=3.5,
    bumps=1,
    corrupt_inputs=18,
    malformed_images=150,
    hostile_texts=50,
    brute_attempts=20,
    flight_http_callers=50,
    edge_photos=1,
    gradio_client_cases=20,
    attack_s=2.0,
    huge_body_mb=100,
    restart_between=False,
)
