"""What the REST door remembers of repeated requests, owned by the door (one per server):
parsed small bodies, encoded answers of one element, and client labels by address.

A machine client sends the same small body again and again; parsing it, encoding the same
answer and parsing its address again are most of a cached hit's cost after the HTTP layer.
Every table is a small LRU, bounded by entries; a refusal is raised, never kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from engine.capacity.fairness import client_id

# Bodies up to this size are kept parsed (a repeated text request; an image's is larger).
REPEAT_BODY_BYTES = 4 * 1024
REPEAT_ENTRIES = 1024
CLIENT_ENTRIES = 4096


class Lru:
    """A small LRU, safe across threads (each server's loop, the FastAPI routes' threads)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            if len(self._items) > self._size:
                self._items.popitem(last=False)

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        value = self.get(key)
        if value is None:
            value = make()  # a refusal is raised, never kept
            self.put(key, value)
        return value

    def __len__(self) -> int:
        return len(self._items)


class Repeats:
    """The door's memory of repeated requests. A repeated small body (a client asking the same
    again: what makes a cached hit) is parsed once: the parsed request (immutable) is kept by its
    bytes, for the last `entries` bodies up to REPEAT_BODY_BYTES each (at most 4 MiB). So are the
    encoded outputs of a one-element answer, by (result key, requested outputs): an entry's
    answer never changes under its key (checked: a recomputed answer is encoded anew), only
    `cache_info` differs between answers."""

    def __init__(self, entries: int = REPEAT_ENTRIES, clients: int = CLIENT_ENTRIES) -> None:
        self.parsed = Lru(entries)  # (body, header length, max batch) -> InferRequest
        self.encoded = Lru(entries)  # (key, outputs, binary) -> (Prediction, EncodedOutputs)
        self._clients = Lru(clients)

    def client(self, address: str) -> str:
        """engine.capacity.fairness.client_id of `address`: it parses the address with
        `ipaddress` (about 7 µs, 2 to 3 % of a cached hit's server CPU), and a client sends
        many requests from one address."""
        label = self._clients.get(address)
        if label is None:
            label = client_id(address)
            self._clients.put(address, label)
        return label  # type: ignore[no-any-return]
