"""The stored value format: a msgpack map with a schema tag, then a trailer that
binds the map to its key. Never pickle.

Without signing keys the trailer is an 8-byte xxh3-64 checksum of (key + map): a
flipped bit that still parses, or a valid value copied under another key, fails the
check. It is not a signature: whoever can write to Redis can compute it.

With signing keys (`CACHE_SIGNING_KEY(S)`) the trailer is a 16-byte HMAC-SHA256 of
(key + map) under the first key; any of the keys verifies (rotation: `new,old`). A
value whose tag no key verifies (unsigned, signed with another secret, moved from
another key, or damaged) raises `ForgedValue`. Anything else that fails to decode
or carries an unknown schema raises `UndecodableValue`; the cache deletes it and
treats it as a miss.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
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


class ForgedValue(UndecodableValue):
    """A signed cache read a value whose signature is missing or wrong."""


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
SIGNATURE_BYTES = 16  # HMAC-SHA256 truncated to 128 bits (NIST SP 800-107 allows >= 64)
MIN_SIGNING_KEY_BYTES = 32
# Domain separation: a tag made for these values is never valid for anything else.
_SIGNING_CONTEXT = b"infcache-l2-value/1\0"


def _checksum(key: str, payload: bytes) -> bytes:
    return xxhash.xxh3_64_digest(key.encode() + b"\0" + payload)


def _to_doc(value: CachedValue) -> dict[str, Any]:
    if isinstance(value, CachedResult):
        return {
            "s": RESULT_SCHEMA,
            "p": value.prediction.to_plain(),
            "v": value.model_version,
            "t": value.created_at,
        }
    if isinstance(value, CachedAlias):
        return {"s": ALIAS_SCHEMA, "d": value.digest}
    if isinstance(value, CachedRejection):
        return {"s": NEGATIVE_SCHEMA, "c": value.code, "m": value.message, "t": value.created_at}
    raise TypeError(f"cannot encode {type(value).__name__}")  # pragma: no cover - closed union


class ValueCodec:
    """Encodes and decodes L2 values; with `signing_keys`, signs every value and refuses
    any value none of the keys signed. Immutable and thread-safe; one per engine."""

    def __init__(self, signing_keys: Sequence[bytes] = ()) -> None:
        for secret in signing_keys:
            if len(secret) < MIN_SIGNING_KEY_BYTES:
                raise ValueError(f"a signing key must be at least {MIN_SIGNING_KEY_BYTES} bytes")
        self._keys = tuple(signing_keys)

    @property
    def signed(self) -> bool:
        return bool(self._keys)

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Short public fingerprints of the signing keys, newest first (safe to show)."""
        return tuple(hashlib.sha256(b"infcache-key-id\0" + k).hexdigest()[:8] for k in self._keys)

    def _tag(self, secret: bytes, key: str, payload: bytes) -> bytes:
        message = _SIGNING_CONTEXT + key.encode() + b"\0" + payload
        return hmac.digest(secret, message, "sha256")[:SIGNATURE_BYTES]

    def seal(self, key: str, payload: bytes) -> bytes:
        """The payload with its trailer (signature or checksum) appended."""
        if self._keys:
            return payload + self._tag(self._keys[0], key, payload)
        return payload + _checksum(key, payload)

    def unseal(self, raw: bytes, *, key: str) -> bytes:
        """The payload, once its trailer verifies; raises ForgedValue / UndecodableValue."""
        if not isinstance(raw, bytes | bytearray | memoryview):
            # A reply of another type (an integer, a list) is never a value of ours: a
            # connection that read another command's reply, say. Refused, not a crash.
            raise UndecodableValue(f"not bytes: a {type(raw).__name__} reply")
        raw = bytes(raw)
        if not self._keys:
            payload, checksum = raw[:-CHECKSUM_BYTES], raw[-CHECKSUM_BYTES:]
            if len(raw) <= CHECKSUM_BYTES or _checksum(key, payload) != checksum:
                raise UndecodableValue("checksum mismatch: corrupt, truncated or moved from another key")
            return payload
        payload, tag = raw[:-SIGNATURE_BYTES], raw[-SIGNATURE_BYTES:]
        if len(raw) > SIGNATURE_BYTES:
            for secret in self._keys:
                if hmac.compare_digest(self._tag(secret, key, payload), tag):
                    return payload
        # Only on the refusal path: say whether it was an unsigned value or a bad signature.
        body, trailer = raw[:-CHECKSUM_BYTES], raw[-CHECKSUM_BYTES:]
        unsigned = len(raw) > CHECKSUM_BYTES and _checksum(key, body) == trailer
        raise ForgedValue(
            "signature missing (an unsigned value)"
            if unsigned
            else "signature wrong: forged, signed with another key, moved from another key or damaged"
        )

    def encode(self, value: CachedValue, *, key: str) -> bytes:
        return self.seal(key, msgpack.packb(_to_doc(value), use_bin_type=True))

    def decode(self, raw: bytes, *, key: str) -> CachedValue:
        return _from_payload(self.unseal(raw, key=key))


# Stateless and immutable: the unsigned codec, for callers without keys (tests, tools).
CHECKSUM_CODEC = ValueCodec()


def encode(value: CachedValue, *, key: str) -> bytes:
    return CHECKSUM_CODEC.encode(value, key=key)


def decode(raw: bytes, *, key: str) -> CachedValue:
    return CHECKSUM_CODEC.decode(raw, key=key)


def _from_payload(payload: bytes) -> CachedValue:
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
