"""The few ASGI types and the one plain response the serving layer writes by hand."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def respond(
    send: Send,
    status: int,
    body: Any,
    *,
    content_type: str = "application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """One complete response: `body` is bytes as given, anything else as JSON."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = [(b"content-type", content_type.encode()), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": start + (headers or [])})
    await send({"type": "http.response.body", "body": payload})


def replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that first hands back `messages` (a body already read), then `receive`'s."""
    queued = list(messages)

    async def replayed() -> Message:
        return queued.pop(0) if queued else await receive()

    return replayed


TOO_LARGE = object()  # read_body's answer for a body past its limit


async def read_body(receive: Receive, limit: int) -> tuple[list[Message], bytes | object | None]:
    """The body's messages as read (to replay them), and the body: None when the client left
    before its end, TOO_LARGE past `limit` bytes (the rest is left unread)."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, None
        size += len(message.get("body", b""))
        if size > limit:
            return messages, TOO_LARGE
        if not message.get("more_body", False):
            return messages, b"".join(m.get("body", b"") for m in messages)
