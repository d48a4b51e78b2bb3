"""One HTTP/1.1 request on a raw socket and its answer as sent, for tests that compare the
bytes a server writes (heads, chunk framing), which HTTP clients hide."""

from __future__ import annotations

import socket


def exchange(sock: socket.socket, request: bytes) -> tuple[list[bytes], bytes]:
    """Send `request` on a kept-alive connection; (the answer head's lines, its body as sent:
    a chunked body with its framing, read to its last chunk)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    lengths = [int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:")]
    while (len(body) < lengths[0]) if lengths else not body.endswith(b"0\r\n\r\n"):
        body += sock.recv(65536)
    return lines, body
