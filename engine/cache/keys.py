"""Cache keys: `{prefix}:{task}:{model_version}:{generation}:{digest}`.

The digest is BLAKE3 of the canonical input, 128 bits, written as `b3` and 32 hex digits.
The cache is shared by strangers, so the hash must be collision resistant: with a fast
non-cryptographic hash (xxh3, used before) two inputs with one digest can be built on
purpose, and whoever sends the first plants its answer on the second (tests/test_keys.py
builds such pairs). The `b3` tag is the key scheme's version: entries written under
another scheme are never read (bare 32-digit xxh3 digests are counted as old by the L2
clean-up) and the tag moves whenever the hash does.

A second, cheaper key on the raw upload (`{task}-raw`) maps an identical re-upload to its
canonical digest, or to the validation error it got, without decoding it again.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import blake3

KEY_SCHEME = "b3"
DIGEST_BYTES = 16  # 128 bits: collisions need ~2**64 work, preimages ~2**128
# A digest of this scheme, and one of the scheme before it (xxh3-128, no tag).
DIGEST_PATTERN = re.compile(rf"^{KEY_SCHEME}[0-9a-f]{{{2 * DIGEST_BYTES}}}$")
LEGACY_DIGEST_PATTERN = re.compile(r"^[0-9a-f]{32}$")


def digest_parts(parts: Iterable[bytes | memoryview]) -> str:
    """The digest of the concatenated parts (callers make the parts self-delimiting)."""
    hasher = blake3.blake3()
    for part in parts:
        hasher.update(part)
    return KEY_SCHEME + hasher.hexdigest(length=DIGEST_BYTES)


def raw_digest(raw: object) -> str:
    """Digest of an input exactly as received (bytes, or a str in UTF-8)."""
    if isinstance(raw, str):
        # surrogatepass: lone surrogates are still hashable input, refused later by validation.
        return digest_parts([b"str:", raw.encode("utf-8", "surrogatepass")])
    if isinstance(raw, bytes | bytearray | memoryview):
        return digest_parts([b"bytes:", raw])
    return digest_parts([b"other:", repr(type(raw)).encode()])


@dataclass(frozen=True)
class CacheKey:
    """A key is unique by (prefix, namespace, model_version, generation, digest).

    `namespace` is the task ("image", "text") for results, or "{task}-raw" for
    aliases and negative entries keyed on the raw input.
    """

    prefix: str
    namespace: str
    model_version: str
    generation: int
    digest: str

    def __str__(self) -> str:
        return f"{self.prefix}:{self.namespace}:{self.model_version}:{self.generation}:{self.digest}"
