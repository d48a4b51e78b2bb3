"""A complete, plain HTTP/1.1 request read in one pass, for the server's hit path (ui.limits).

A cached answer costs the server less than uvicorn's parser callbacks: one Python call per
header, a scope built field by field, a request/response cycle with its asyncio.Event, a
keep-alive timer cancelled and armed again. When one read holds exactly one whole request of
the kinds the protocol may answer at once (a small POST to /v2/ or a Gradio call, the GET of a
call's result), `read_simple_request` takes its head apart with a few bytes operations and two
compiled patterns. It accepts only a strict subset of what the parser accepts, and reads it the
same way (lower-case names, values without the surrounding whitespace): anything else (another
method or path, a query or an escape in the path, HTTP/1.0, obs-fold, non-ASCII or control
bytes, Transfer-Encoding, Expect, Upgrade, a Connection other than keep-alive, a Content-Length
missing, repeated or not the body's length, more than one request in the read, a head over the
server's limits) gives None, and the read goes to the parser as before, which answers or
refuses it as it always has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Targets answered at once; a query (`?`), an escape (`%`) or any byte outside these goes to the parser.
_TARGET = re.compile(rb"/(?:v2/models|gradio_api/call)/[A-Za-z0-9_.\-/]+")
# The header lines, each a token, a colon and a value of visible ASCII, spaces and tabs, all
# checked by one match; each line is then split at its first colon.
_HEADERS = re.compile(rb"(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\x20-\x7e\t]*)*")
_REFUSED_HEADERS = frozenset((b"transfer-encoding", b"expect", b"upgrade"))


@dataclass(frozen=True, slots=True)
class SimpleRequest:
    method: str  # "POST" or "GET"
    path: str  # the target as sent (no query, no escapes)
    headers: list[tuple[bytes, bytes]]  # lower-case names, as uvicorn's scope holds them
    body: bytes


def read_simple_request(
    data: bytes, *, max_head_bytes: int, max_url_bytes: int, max_headers: int, max_body_bytes: int
) -> SimpleRequest | None:
    """The request that `data` holds whole and alone, when it is simple (see the module); else None."""
    reader = SimpleRequestReader(max_head_bytes=max_head_bytes, max_url_bytes=max_url_bytes,
                                 max_headers=max_headers, max_body_bytes=max_body_bytes)  # fmt: skip
    return reader.read(data)


# A head kept by a connection is at most this long (a machine client's is a few hundred bytes):
# idle connections with heads up to the server's limit (32 KiB) must not each hold one.
KEPT_HEAD_BYTES = 2048


class SimpleRequestReader:
    """`read_simple_request` for one connection, with its limits: a client that repeats a
    request (the cached hits of a machine client) sends the same head each time, which is
    taken apart once (up to KEPT_HEAD_BYTES); the body is checked against it every time."""

    __slots__ = ("_head", "_limits", "_taken")

    def __init__(
        self, *, max_head_bytes: int, max_url_bytes: int, max_headers: int, max_body_bytes: int
    ) -> None:
        self._limits = (max_head_bytes, max_url_bytes, max_headers, max_body_bytes)
        self._head = b""  # the last simple head read, and what it holds
        self._taken: _Head | None = None

    def read(self, data: bytes) -> SimpleRequest | None:
        max_head_bytes, max_url_bytes, max_headers, max_body_bytes = self._limits
        end = data.find(b"\r\n\r\n")
        if end < 0 or end > max_head_bytes:
            return None
        taken = self._taken
        if taken is None or end != len(self._head) or not data.startswith(self._head):
            taken = _read_head(data, end, max_url_bytes=max_url_bytes, max_headers=max_headers)
            if taken is None:
                return None
            if end <= KEPT_HEAD_BYTES:
                self._head, self._taken = data[:end], taken
        return taken.request(data[end + 4 :], max_body_bytes)


@dataclass(frozen=True, slots=True)
class _Head:
    method: bytes
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    length: int | None  # Content-Length

    def request(self, body: bytes, max_body_bytes: int) -> SimpleRequest | None:
        if self.method == b"GET":
            if body or self.length:  # a GET with a body, or data after it: the parser's
                return None
        elif self.length is None or self.length != len(body) or self.length > max_body_bytes:
            return None
        # A list of its own for each request, as uvicorn's scope has.
        return SimpleRequest(self.method.decode(), self.path, list(self.headers), body)


def _read_head(data: bytes, end: int, *, max_url_bytes: int, max_headers: int) -> _Head | None:
    first = data.find(b"\r\n", 0, end + 2)
    method, _, rest = data[:first].partition(b" ")
    target, _, version = rest.partition(b" ")
    if version != b"HTTP/1.1" or method not in (b"POST", b"GET") or len(target) > max_url_bytes:
        return None
    if not _TARGET.fullmatch(target) or not _HEADERS.fullmatch(data, first, end):
        return None
    lines = data[first + 2 : end].split(b"\r\n") if end > first else []
    if len(lines) > max_headers:
        return None
    headers: list[tuple[bytes, bytes]] = []
    length = None
    for line in lines:
        name, _, value = line.partition(b":")
        name, value = name.lower(), value.strip(b" \t")
        if name == b"content-length":
            if length is not None or not value.isdigit() or len(value) > 7:
                return None
            length = int(value)
        elif name in _REFUSED_HEADERS or (name == b"connection" and value.lower() != b"keep-alive"):
            return None
        headers.append((name, value))
    return _Head(method, target.decode(), tuple(headers), length)
