"""Places in Gradio's queue shared out per client, so one address cannot fill it for others.

Gradio's queue takes calls until `max_size` are waiting, whoever sends them; past that every
call is refused with 503 (`queue_full`), a cached one too (Gradio checks the size before its
cache probe). A flood of calls from one address, fetched or not, filled it and refused
everybody else.

`QueueShares` wraps `Queue.push`: a client may have waiting at most its share of the places,
`max_size // (other clients waiting + 2)`. Alone, a client (a script submitting a hundred
jobs) gets half the queue; with `n` clients waiting, each holds under `max_size / (n + 1)`,
so the places taken sum to less than `max_size` and a client with nothing waiting always
finds one. Past its share a client's call gets Gradio's own `queue_full` answer (503 on the
HTTP API, an error event in the browser) with a message saying why; the others are untouched.
Calls already running hold no place (as in Gradio's own count).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from engine.capacity.fairness import client_id
from ui.call_protocol import RefusalLog

if TYPE_CHECKING:
    from ui.lean_sessions import LeanStateHolder

log = logging.getLogger(__name__)

FULL_MESSAGE = (
    "Too many of your calls are waiting for the model while others wait too; "
    "answers come in turn, so send the next one when one is answered."
)


def share_of_places(max_size: int, others_waiting: int) -> int:
    """How many places a client may hold while `others_waiting` other clients hold some."""
    return max(1, max_size // (others_waiting + 2))


def waiting_per_client(queue: Any) -> Counter[str]:
    """The calls waiting in `queue` (not yet running), counted per client."""
    counts: Counter[str] = Counter()
    for event_queue in list(queue.event_queue_per_concurrency_id.values()):
        for event in list(event_queue.queue):
            counts[client_of(event.request)] += 1
    return counts


def client_of(request: Any) -> str:
    """The client (engine.capacity.fairness.client_id) of a Gradio call's request."""
    client = getattr(request, "client", None)
    return client_id(client.host if client is not None else None)


class QueueShares:
    """Wraps a Gradio queue's `push` once `install()`ed (see the module docstring)."""

    def __init__(self, queue: Any, holder: LeanStateHolder | None = None) -> None:
        self._queue = queue
        self._holder = holder  # told whose each new session is (its per-client bound)
        self._push = queue.push
        self._refusals = RefusalLog(log)
        self.refused = 0  # calls refused for holding their share (for tests and the curious)

    def install(self) -> None:
        self._queue.push = self.push

    async def push(self, body: Any, request: Any, username: str | None) -> tuple[bool, Any, str]:
        max_size = self._queue.max_size
        client = client_of(request)
        if max_size is not None:
            waiting = waiting_per_client(self._queue)
            others = sum(1 for other in waiting if other != client)
            if waiting[client] >= share_of_places(max_size, others):
                self.refused += 1
                self._refusals.refused(
                    client, f"a queued call: {waiting[client]} already waiting, {others} other clients"
                )
                return False, FULL_MESSAGE, "queue_full"
        if self._holder is not None and isinstance(getattr(body, "session_hash", None), str):
            self._holder.expect(body.session_hash, client)
        return await self._push(body, request, username)
