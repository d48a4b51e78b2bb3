"""The stored value format: a msgpack map with a schema tag, then an 8-byte
xxh3-64 checksum of (key + map). Never pickle.

The checksum binds a value to its key: a flipped bit that still parses, or a
valid value copied under another key, fails the check. (It is not a signature:
whoever can write to Redis can compute it. Signing is planned.) Anything that
fails to decode, fails the check or carries an unknown schema raises
`UndecodableValue`; the cache deletes it and treats it as a miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from engine.models.base import Prediction

RESULT_SCHEMA = "infcache.result/1"
ALIAS_SCHEMA = "infcache.alias/1"
NEGATIVE_SCHEMA = "infcache.negative/1"


class UndecodableValue(ValueError):
    """A stored value is corrupt or of a schema this version does not know."""


@dataclass(frozen=True)
class CachedResult:
    prediction: Prediction
    model_version: str
    created_at: float  # unix seconds, for age_s


@dataclass(frozen=True)
class CachedAlias:
    """Raw-input key -> canonical digest."""

    digest: str


@dataclass(frozen=True)
class CachedRejection:
    """A raw input that failed validation, with the error it got."""

    code: str
    message: str
    created_at: float


CachedValue = CachedResult | CachedAlias | CachedRejection


CHECKSUM_BYTES = 8


def _checksum(key: str, payload: bytes) -> bytes:
    return xxhash.xxh3_64_digest(key.encode() + b"\0" + payload)


def encode(value: CachedValue, *, key: str) -> bytes:
    if isinstance(value, CachedResult):
        doc: dict[str, Any] = {
            "s": RESULT_SCHEMA,
            "p": value.prediction.to_plain(),
            "v": value.model_version,
            "t": value.created_at,
        }
    elif isinstance(value, CachedAlias):
        doc = {"s": ALIAS_SCHEMA, "d": value.digest}
    elif isinstance(value, CachedRejection):
        doc = {"s": NEGATIVE_SCHEMA, "c": value.code, "m": value.message, "t": value.created_at}
    else:  # pragma: no cover - the type union is closed
        raise TypeError(f"cannot encode {type(value).__name__}")
    payload = msgpack.packb(doc, use_bin_type=True)
    return payload + _checksum(key, payload)


def decode(raw: bytes, *, key: str) -> CachedValue:
    payload, checksum = raw[:-CHECKSUM_BYTES], raw[-CHECKSUM_BYTES:]
    if len(raw) <= CHECKSUM_BYTES or _checksum(key, payload) != checksum:
        raise UndecodableValue("checksum mismatch: corrupt, truncated or moved from another key")
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise UndecodableValue(f"not msgpack: {exc.__class__.__name__}") from None
    if not isinstance(doc, dict):
        raise UndecodableValue("not a map")
    schema = doc.get("s")
    try:
        if schema == RESULT_SCHEMA:
            created = doc["t"]
            version = doc["v"]
            if not isinstance(created, float) or not isinstance(version, str):
                raise UndecodableValue("bad result fields")
            return CachedResult(Prediction.from_plain(doc["p"]), version, created)
        if schema == ALIAS_SCHEMA:
            digest = doc["d"]
            if not isinstance(digest, str) or not digest.isalnum():
                raise UndecodableValue("bad alias")
            return CachedAlias(digest)
        if schema == NEGATIVE_SCHEMA:
            code, message, created = doc["c"], doc["m"], doc["t"]
            if not (isinstance(code, str) and isinstance(message, str) and isinstance(created, float)):
                raise UndecodableValue("bad negative entry")
            return CachedRejection(code, message, created)
    except (KeyError, TypeError, ValueError) as exc:
        raise UndecodableValue(f"malformed {schema}: {exc}") from None
    raise UndecodableValue(f"unknown schema {schema!r}")
