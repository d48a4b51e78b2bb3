"""One settings object, read from the environment once at start-up and passed down.

Libraries below (engine/, storage/, admin/) take plain arguments and never read
the environment themselves. The settings are grouped by concern (settings.groups), each
group a frozen pydantic-settings class whose fields name their variable and carry their
meaning, from which docs/CONFIGURATION.md is generated (settings.reference).
"""

from settings.errors import SettingsError
from settings.groups import (
    CLIENT_MISS_BURST,
    CLIENT_MISS_RATE,
    FORWARDED_ALLOW_IPS,
    MIB,
    MIN_SIGNING_KEY_BYTES,
    MISS_CONCURRENCY_CUDA,
    PILLOW_PIXEL_CEILING,
    Cache,
    Console,
    Fairness,
    Fleet,
    Limits,
    Log,
    Models,
    Quality,
    Redis,
    Server,
    Warmup,
    default_replica_id,
    usable_cores,
)
from settings.redis_url import REDIS_URL_FORMS, RedisTarget, parse_redis_url, redact_url
from settings.remote import Remote
from settings.root import Settings

__all__ = [
    "CLIENT_MISS_BURST",
    "CLIENT_MISS_RATE",
    "FORWARDED_ALLOW_IPS",
    "MIB",
    "MIN_SIGNING_KEY_BYTES",
    "MISS_CONCURRENCY_CUDA",
    "PILLOW_PIXEL_CEILING",
    "REDIS_URL_FORMS",
    "Cache",
    "Console",
    "Fairness",
    "Fleet",
    "Limits",
    "Log",
    "Models",
    "Quality",
    "Redis",
    "RedisTarget",
    "Remote",
    "Server",
    "Settings",
    "SettingsError",
    "Warmup",
    "default_replica_id",
    "parse_redis_url",
    "redact_url",
    "usable_cores",
]
