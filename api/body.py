"""Reading a request body within a byte limit, before any of it is parsed.

The limit is checked twice: against `Content-Length` before a byte is read, and while
streaming (chunked bodies declare no length), stopping at the first chunk past it. A
compressed body (`Content-Encoding: gzip` or `deflate`, which tritonclient can send) is
inflated under the same limit, so a small bomb cannot become a large buffer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect

from api.errors import RequestRefused

# The ASGI `receive` callable the body is pulled from.
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

# Room for the JSON around the tensor data: field names, shape, parameters, and the
# 4-byte length prefix of each element of a binary batch.
HEADER_ALLOWANCE_BYTES = 64 * 1024
# zlib's window bits with +32: accept both the gzip and the zlib (HTTP "deflate") wrapper.
_AUTO_HEADER_WBITS = 32 + zlib.MAX_WBITS


def oip_body_limit(max_upload_bytes: int) -> int:
    """The largest request body: one file at the upload limit, base64-encoded (4 bytes for
    every 3), plus the header allowance. It fits in either encoding; a batch shares it."""
    return 4 * math.ceil(max_upload_bytes / 3) + HEADER_ALLOWANCE_BYTES


# Digits of a byte-count header: 18 cover an exabyte and stay clear of int()'s cost on long
# strings and of Python's 4,300-digit limit, which raises ValueError.
_MAX_COUNT_DIGITS = 18


def byte_count(value: str) -> int | None:
    """A header's decimal byte count, or None. ASCII digits only: headers are read as Latin-1,
    and str.isdigit() also takes digits such as '²' that int() refuses."""
    value = value.strip()
    if not (value.isascii() and value.isdigit()):
        return None
    digits = value.lstrip("0") or "0"
    return int(digits) if len(digits) <= _MAX_COUNT_DIGITS else None


def _too_large(limit: int) -> RequestRefused:
    return RequestRefused(413, f"The request body is larger than the limit of {limit:,} bytes.")


async def read_body(headers: Mapping[str, str], receive: Receive, *, limit: int) -> bytes:
    """The whole body, inflated when compressed; RequestRefused(413) past `limit` bytes.
    `headers`: the request's headers by lower-case name; `receive`: its ASGI receive."""
    declared = byte_count(headers.get("content-length") or "")
    if declared is not None and declared > limit:
        raise _too_large(limit)  # refused before a byte of it is read
    chunks: list[bytes] = []
    received = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > limit:
            raise _too_large(limit)  # the rest is never read; the server closes the connection
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "deflate"):
        return _inflate(body, limit=limit, encoding=encoding)
    raise RequestRefused(415, f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none.")


def _inflate(data: bytes, *, limit: int, encoding: str) -> bytes:
    inflater = zlib.decompressobj(_AUTO_HEADER_WBITS)
    out = bytearray()
    pending = data
    try:
        while pending and not inflater.eof:
            # max_length caps what one call may produce: never more than one byte past the limit.
            out += inflater.decompress(pending, limit + 1 - len(out))
            if len(out) > limit:
                raise _too_large(limit)
            pending = inflater.unconsumed_tail
    except zlib.error:
        raise RequestRefused(400, f"The request body is not valid {encoding} data.") from None
    if not inflater.eof or inflater.unused_data:
        raise RequestRefused(400, f"The request body is not one complete {encoding} stream.")
    return bytes(out)
