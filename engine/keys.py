"""Cache keys: `{prefix}:{task}:{model_version}:{generation}:{digest}`.

The digest is xxh3-128 of the canonical input. A second, cheaper key on the raw
upload (`{task}-raw`) maps an identical re-upload to its canonical digest, or to
the validation error it got, without decoding it again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import xxhash


def digest_parts(parts: Iterable[bytes | memoryview]) -> str:
    hasher = xxhash.xxh3_128()
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


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
