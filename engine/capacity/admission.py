"""Work-conserving miss admission: a miss is refused only when it would take the model from
someone else.

Every miss about to wait for a forward pass is admitted here first (hits, coalesced answers and
remembered rejections never get this far). Per task and per replica, a client is *active* while
it has a miss admitted and not yet through its forward pass; the task is *contended* for a client
when another client is active on it here, or was within the last CONTENDED_WINDOW_S. (A visitor's
misses are seconds apart: were only the misses waiting at this instant counted, a flood would
hold the model with full batches between them, and each of the visitor's misses would wait for
one.) The decision:

1. Where the task is not contended (nobody else wants the model here), the miss is admitted:
   the model would otherwise be idle, so a lone script is served as fast as the model goes,
   with as many misses at once as it sends. It spends a token of its budget when one is there
   (engine.capacity.fairness.MissBudget: CLIENT_MISS_RATE a second up to CLIENT_MISS_BURST, one bucket
   per client for the fleet, in Redis), so a client that had the model to itself meets the
   others with its burst spent (counted as `budget`, or `idle` past it).
2. Where it is contended, a client's only miss of the task here is admitted without a token:
   round robin serves each waiting client one miss per turn, so one waiting miss is never more
   than its share (`one_per_turn`). A further miss at once spends a token (`budget`): a visitor
   clicking through the examples is not refused.
3. Otherwise (contended, a miss of its own already waiting, no token) it is refused:
   OverBudgetError, 429 + Retry-After / Gradio's message. Retry-After is when its next token is
   there; a turn's miss spends none, so the token is there for the retry. A client that sends
   one miss at a time is never refused at all.

Contention is measured per replica because the model is: a replica whose model is idle serves
whoever asks, whatever another replica is doing. The client's history is the fleet's: its bucket
is shared through Redis, so a client that took every idle pass on one replica meets contention
on any other with its tokens spent.

`record_pass` also measures what fairness promises: over the passes formed while two or more
clients had misses waiting for them, each client's inputs against its fair share (each pass's
inputs divided among the clients waiting then).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from cachetools import LRUCache

from engine.capacity.fairness import MissBudget
from engine.errors import OverBudgetError

# How long a client's miss keeps a task contended for the others after it was admitted.
CONTENDED_WINDOW_S = 2.0
# Clients whose contended share is remembered (the least recent go first).
SHARE_CLIENTS = 10_000
DECISIONS = ("budget", "idle", "one_per_turn", "refused")


class ContendedShare(NamedTuple):
    """Over the passes formed while two or more clients had misses waiting for them."""

    inputs: int  # the client's inputs in those passes
    fair: float  # its fair share of them: each pass's inputs / the clients waiting then
    total: int  # every input of those passes


class MissAdmission:
    """Admits misses (see the module's docstring). Thread-safe; owned by the engine's passes."""

    def __init__(
        self, budget: MissBudget | None, *, window_s: float = CONTENDED_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self._budget = budget
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._active: dict[str, Counter[str]] = {}  # task -> client -> misses admitted, not through
        # task -> client -> when its last miss was admitted (oldest first; older than the window go)
        self._recent: dict[str, OrderedDict[str, float]] = {}
        self._decisions: Counter[tuple[str, str]] = Counter()  # (task, decision) -> misses
        self._inputs: LRUCache[str, int] = LRUCache(maxsize=SHARE_CLIENTS)
        self._fair: LRUCache[str, float] = LRUCache(maxsize=SHARE_CLIENTS)
        self._contended_inputs = 0

    @property
    def budget(self) -> MissBudget | None:
        return self._budget

    @contextmanager
    def admitted(self, task: str, client: str | None) -> Iterator[None]:
        """Holds one admitted miss of `client` on `task` until it leaves (its pass done or
        failed); raises OverBudgetError instead when it is refused. The app's own requests
        (None) are always admitted and contend with nobody."""
        if client is None:
            yield
            return
        with self._lock:
            active = self._active.setdefault(task, Counter())
            own = active[client]
            recent = self._others_recent(task, client)  # first: it notes this miss for the others
            contended = recent or len(active) > (1 if own else 0)
            active[client] += 1
        try:
            decision = self._decide(client, own, contended)
            with self._lock:
                self._decisions[task, decision] += 1
        except OverBudgetError:
            self._leave(task, client)
            with self._lock:
                self._decisions[task, "refused"] += 1
            raise
        try:
            yield
        finally:
            self._leave(task, client)

    def _decide(self, client: str, own: int, contended: bool) -> str:
        budget = self._budget
        if budget is None:
            return "budget"
        if not contended:  # spent when there, so that a lone flood has no burst left for later
            return "budget" if budget.spend(client) <= 0 else "idle"
        if not own:  # its turn: no token needed, none taken (one is there for its retry)
            return "one_per_turn"
        wait = budget.spend(client)
        if wait <= 0:
            return "budget"
        raise budget.refusal(client, wait)  # Retry-After: a token is there then

    def _others_recent(self, task: str, client: str) -> bool:
        """Whether another client's miss of `task` was admitted within the window; notes this
        one's (holding the lock)."""
        now = self._clock()
        recent = self._recent.setdefault(task, OrderedDict())
        while recent and next(iter(recent.values())) < now - self._window_s:
            recent.popitem(last=False)
        others = len(recent) > (1 if client in recent else 0)
        recent[client] = now
        recent.move_to_end(client)
        if len(recent) > SHARE_CLIENTS:  # a burst of that many clients within the window
            recent.popitem(last=False)
        return others

    def _leave(self, task: str, client: str) -> None:
        with self._lock:
            active = self._active[task]
            active[client] -= 1
            if active[client] <= 0:
                del active[client]

    def record_pass(self, task: str, clients: Sequence[str | None], competing: Sequence[str]) -> None:
        """A forward pass of `task` starts on these clients' inputs (None: the app's own), taken
        from the pass queue while `competing` clients had misses waiting in it ("": the app's)."""
        rivals = [c for c in dict.fromkeys(competing) if c]
        if len(rivals) < 2:
            return
        share = len(clients) / len(rivals)
        with self._lock:
            for client in rivals:
                self._fair[client] = self._fair.get(client, 0.0) + share
            for client in clients:
                if client:
                    self._inputs[client] = self._inputs.get(client, 0) + 1
            self._contended_inputs += len(clients)

    def contended_share(self, client: str) -> ContendedShare:
        with self._lock:
            inputs, fair = self._inputs.get(client, 0), self._fair.get(client, 0.0)
            return ContendedShare(inputs, fair, self._contended_inputs)

    def state(self) -> dict[tuple[str, str], int]:
        """Admitted and refused misses by (task, decision) (DECISIONS), for /metrics."""
        with self._lock:
            return dict(self._decisions)

    def contended(self, task: str) -> bool:
        """Whether two or more clients are active on `task` here now (misses in flight)."""
        with self._lock:
            return len(self._active.get(task, ())) >= 2
