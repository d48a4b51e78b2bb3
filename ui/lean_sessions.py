"""Session state that costs what a call uses, not what the page holds.

Gradio builds a `SessionState` for every session it sees, and its constructor renders
the config of every component on the page (`BlocksConfig.config_for_block`); every call
then renders its input and output components again to record their values. A call
through `/gradio_api/call/<api>` that brings no `session_hash` (curl, the "Use via API"
page, every new browser visitor's first call) is its own session, keyed by its event id:
each one paid for the whole page (about half the server CPU of a cached answer, Gradio
6.31) and stayed in memory (about 120 KB each, up to 10,000 sessions). On top of that,
Gradio never forgets the bookkeeping of a call answered by its cache probe
(`event_ids_to_events`, `pending_event_ids_session`).

- `LeanSessionState` renders a component's config only when a deep link asks for the
  page; until then a call's values are kept as plain values.
- `LeanStateHolder` keeps one-shot sessions (keyed by their own event id) in a bounded
  table of their own, so API load never evicts a browser's session, and once such a
  call's answer has been delivered it drops the session and Gradio's bookkeeping of it
  (remembering, in `DeliveredIds`, that it was answered: a second GET of it gets what
  Gradio gives, see ui/cached_calls.py).
- `SessionQueues` replaces Gradio's table of per-session message queues (an LRU of 2,000
  that evicts the oldest, so 2,000 calls nobody fetched ended the session of a browser tab
  opened before them): when full, it evicts the oldest queue of a session without state
  (a one-shot call's) before any session a browser or gradio_client is using.

Both lean on Gradio internals pinned at gradio==6.31.0; `tests/test_lean_sessions.py`
checks the attributes and behaviour they rely on, so an upgrade that changes them fails
there first.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from copy import copy
from typing import TYPE_CHECKING, Any

from cachetools import LRUCache
from gradio.state_holder import SessionState, StateHolder
from gradio.utils import LRUCache as GradioLRUCache

from ui.queue_shares import client_of

if TYPE_CHECKING:
    from gradio.blocks import Blocks

# One-shot sessions are dropped once their answer is delivered; these bound the rest
# (a client that never fetches its answer): at most this many (Gradio's own bound on
# pending message queues), for at most this long.
ONE_SHOT_CAPACITY = 2000
ONE_SHOT_MAX_AGE_S = 300.0
# Per client (engine.capacity.fairness.client_id of the call's address): one address's abandoned calls
# push out its own oldest, never another client's. A session (a browser tab, a gradio_client)
# costs more than a one-shot call, and one address rarely has more tabs open at once.
ONE_SHOT_PER_CLIENT = 64
SESSIONS_PER_CLIENT = 256
# Abandoned one-shot calls expire within this long of ONE_SHOT_MAX_AGE_S even with no new call.
SWEEP_EVERY_S = 30.0
# Every this many calls, forget answered events of any session (see _forget_answered_events).
EVENT_SWEEP_EVERY = 256
# Answered one-shot calls remembered for a second GET: as many as Gradio keeps sessions' queues.
DELIVERED_CAPACITY = 2000


class DeliveredIds:
    """The event ids of the latest one-shot calls whose answer was delivered (bounded):
    Gradio keeps such a call's session, so a second GET of it waits with heartbeats
    instead of finding no session, until a GET's client leaves (Gradio then drops it)."""

    def __init__(self, capacity: int = DELIVERED_CAPACITY) -> None:
        self._ids: LRUCache[str, bool] = LRUCache(maxsize=capacity)
        self._lock = threading.Lock()  # as Gradio's StateHolder locks its tables: callers on any thread

    def add(self, event_id: str) -> None:
        with self._lock:
            self._ids[event_id] = True

    def discard(self, event_id: str) -> None:
        with self._lock:
            self._ids.pop(event_id, None)

    def __contains__(self, event_id: object) -> bool:
        with self._lock:
            return event_id in self._ids


class SessionQueues(GradioLRUCache):
    """Gradio's `Queue.pending_messages_per_session` (an LRU of message queues per session)
    that, when full, evicts the oldest queue of a session the state holder has no state for
    (a one-shot call, or one not yet probed) before touching a session in use. Gradio never
    moves a session to the end once its queue exists, so plain eviction takes the oldest
    browser tab first."""

    def __init__(self, queue: Any, holder: LeanStateHolder) -> None:
        table = queue.pending_messages_per_session
        super().__init__(table.max_size)
        self._queue = queue
        self._holder = holder
        for key, value in table.items():
            super().__setitem__(key, value)

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self and len(self) >= self.max_size:
            self.evict(self._victim())
        super().__setitem__(key, value)

    def _victim(self) -> Any:
        """A queue of the client holding the most queues here (a crowd of sessions from one
        client, or from many addresses each holding a few, pushes out its own, not a
        visitor's call being answered): its oldest one-shot call's, else its oldest session's
        (a tab with state goes last). With no client known, the oldest queue of a session
        without state, then the oldest."""
        holder = self._holder
        oldest = next(iter(self))
        try:
            # Only when the table is full (2,000 queues by default): a scan of it is cheap then.
            owners = Counter(client for key in self if (client := holder.client_of(key)) is not None)
            if owners:
                largest = max(owners, key=owners.__getitem__)  # on a tie, the oldest queue's
                owned = [key for key in self if holder.client_of(key) == largest]
                return next((key for key in owned if key not in holder.session_data), owned[0])
            # Sessions in use are few and old: the scan passes them and stops at the first other.
            return next((key for key in self if key not in holder.session_data), oldest)
        except RuntimeError:  # the holder's table changed on another thread: as Gradio does
            return oldest

    def evict(self, session: Any) -> None:
        """Drop a session's message queue as a full table does. Its calls still to run or
        running are marked dead first: Gradio would post their messages into the queue
        that is gone (a KeyError in its queue worker)."""
        for event_id in {session, *self._queue.pending_event_ids_session.get(session, ())}:
            event = self._queue.event_ids_to_events.get(event_id)
            if event is not None:
                event.alive = False
        self.pop(session, None)
        # Its calls' ids go too: nothing can deliver them now (Gradio would keep them forever).
        self._queue.pending_event_ids_session.pop(session, None)


class LeanSessionState(SessionState):
    """A `SessionState` that renders component configs only when they are read."""

    def __init__(self, blocks: Blocks) -> None:
        # The attributes of SessionState.__init__, without rendering every block up front.
        self.blocks_config = copy(blocks.default_config)
        self._page_blocks = blocks.blocks
        self.config_values: dict[int, Any] = {}
        self.state_data: dict[int, Any] = {}
        self._state_ttl: dict[int, Any] = {}
        self.is_closed = False
        self.STATE_TTL_WHEN_CLOSED = 1 if os.getenv("GRADIO_IS_E2E_TEST", None) else 3600
        self._values: dict[int, Any] = {}  # a block's latest value, not yet in its config
        self.created = time.monotonic()

    def __setitem__(self, key: int, value: Any) -> None:
        self._values.pop(key, None)  # the new block's config supersedes an older value
        super().__setitem__(key, value)

    def _update_config(self, key: int) -> None:
        self._values.pop(key, None)
        super()._update_config(key)

    def _update_value_in_config(self, key: int, value: Any) -> None:
        if key in self.config_values:
            super()._update_value_in_config(key, value)
        else:
            self._values[key] = value

    @property
    def components(self) -> Iterator[dict]:
        """Every component's config with this session's values, as SessionState gives it."""
        for key, block in self.blocks_config.blocks.items():
            if key in self._page_blocks and key not in self.config_values:
                self.config_values[key] = self.blocks_config.config_for_block(key, [], block)
        for key, value in list(self._values.items()):
            super()._update_value_in_config(key, value)
        self._values.clear()
        # In page order, as SessionState renders them (a block set earlier came first).
        order = [key for key in self.blocks_config.blocks if key in self.config_values]
        self.config_values = {key: self.config_values[key] for key in order} | self.config_values
        return SessionState.components.fget(self)  # type: ignore[attr-defined]


class LeanStateHolder(StateHolder):
    """A `StateHolder` that makes `LeanSessionState`s and keeps one-shot ones apart."""

    def __init__(
        self,
        *,
        one_shot_capacity: int = ONE_SHOT_CAPACITY,
        one_shot_max_age_s: float = ONE_SHOT_MAX_AGE_S,
        one_shot_per_client: int = ONE_SHOT_PER_CLIENT,
        sessions_per_client: int = SESSIONS_PER_CLIENT,
    ) -> None:
        super().__init__()
        self.one_shot: OrderedDict[str, LeanSessionState] = OrderedDict()
        self.one_shot_capacity = one_shot_capacity
        self.one_shot_max_age_s = one_shot_max_age_s
        self.one_shot_per_client = one_shot_per_client
        self.sessions_per_client = sessions_per_client
        # Who made each session (when a queued call made it), and how many each client has.
        self._client_of: dict[str, str] = {}
        self._one_shots_of: Counter[str] = Counter()
        self._sessions_of: Counter[str] = Counter()
        self._expected: LRUCache[str, str] = LRUCache(maxsize=4096)  # see expect()
        self.delivered = DeliveredIds()
        self._calls = 0

    def __getitem__(self, session_id: str) -> SessionState:
        self._calls += 1
        if self._calls % EVENT_SWEEP_EVERY == 0:
            _forget_answered_events(self.blocks._queue)
        if session_id not in self.session_data:
            if session_id in self.one_shot or self._is_one_shot(session_id):
                return self._one_shot_state(session_id)
            self._new_session(session_id)
        self.update(session_id)
        self.time_last_used[session_id] = datetime.datetime.now()
        return self.session_data[session_id]

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.session_data or session_id in self.one_shot

    def update(self, session_id: str) -> None:
        with self.lock:
            if session_id in self.session_data:
                self.session_data.move_to_end(session_id)
            while len(self.session_data) > self.capacity:  # Gradio's bound, the oldest first
                self._drop_session(next(iter(self.session_data)))

    def expect(self, session_id: str, client: str) -> None:
        """A call of `client` naming `session_id` is about to be queued: Gradio makes the
        session (if new) before the call exists, so this is how it learns whose it is."""
        if session_id not in self:
            self._expected[session_id] = client

    def _new_session(self, session_id: str) -> None:
        client = self._expected.pop(session_id, None) or self._event_client(session_id)
        with self.lock:
            if client is not None:
                if self._sessions_of[client] >= self.sessions_per_client:
                    oldest = next(s for s in self.session_data if self._client_of.get(s) == client)
                    self._drop_session(oldest)
                    evict = getattr(self.blocks._queue.pending_messages_per_session, "evict", None)
                    if evict is not None:
                        evict(oldest)
                self._client_of[session_id] = client
                self._sessions_of[client] += 1
            self.session_data[session_id] = LeanSessionState(self.blocks)

    def client_of(self, session_id: str) -> str | None:
        """The client whose call made `session_id`, if known."""
        return self._client_of.get(session_id)

    def _drop_session(self, session_id: str) -> None:
        self.session_data.pop(session_id, None)
        self.time_last_used.pop(session_id, None)
        self._forget_client(session_id, self._sessions_of)

    def _forget_client(self, session_id: str, counts: Counter[str]) -> None:
        client = self._client_of.pop(session_id, None)
        if client is not None:
            counts[client] -= 1
            if counts[client] <= 0:
                del counts[client]

    def _event_client(self, session_id: str) -> str | None:
        """The client of the queued call that names `session_id`, if one does."""
        queue = getattr(self.blocks, "_queue", None)
        if queue is None:
            return None
        event = queue.event_ids_to_events.get(session_id)
        if event is None:
            events = queue.event_ids_to_events
            ids = queue.pending_event_ids_session.get(session_id) or ()
            event = next((events[i] for i in list(ids) if i in events), None)
        return None if event is None else client_of(event.request)

    def _is_one_shot(self, session_id: str) -> bool:
        # Gradio keys a call that brought no session hash by its own event id.
        queue = getattr(self.blocks, "_queue", None)
        event = queue.event_ids_to_events.get(session_id) if queue is not None else None
        return event is not None and event._id == event.session_hash

    def _one_shot_state(self, session_id: str) -> SessionState:
        with self.lock:
            state = self.one_shot.get(session_id)
            if state is None:
                self.sweep()
                client = self._event_client(session_id)
                if client is not None:
                    if self._one_shots_of[client] >= self.one_shot_per_client:
                        self._drop_oldest_one_shot_of(client)
                    self._client_of[session_id] = client
                    self._one_shots_of[client] += 1
                state = self.one_shot[session_id] = LeanSessionState(self.blocks)
            return state

    def _drop_oldest_one_shot_of(self, client: str) -> bool:
        """A client past its share of one-shot sessions: its oldest call not waiting in the
        queue goes (answered or not; one still waiting stays Gradio's to run). False when
        every call it has is still waiting."""
        queue = self.blocks._queue
        for session_id in list(self.one_shot):
            if self._client_of.get(session_id) != client:
                continue
            event = queue.event_ids_to_events.get(session_id)
            if event is None or not _queued(queue, event):
                self._drop_one_shot(session_id, delivered=not queue.pending_event_ids_session.get(session_id))
                return True
        return False

    def _drop_one_shot(self, session_id: str, *, delivered: bool) -> None:
        queue = self.blocks._queue
        del self.one_shot[session_id]
        self._forget_client(session_id, self._one_shots_of)
        # Gradio still holds a delivered call's session (until a GET of it is abandoned):
        # a second GET gets heartbeats, so this one must remember that it was answered.
        if delivered and session_id in queue.pending_messages_per_session:
            self.delivered.add(session_id)
        _forget_call(queue, session_id, delivered=delivered)

    def sweep(self) -> None:
        """Forget the oldest one-shot sessions whose answer was delivered or that are past
        their age (an answer nobody read). Calls end roughly in order, so this stops at the
        first one still running: amortised O(1) per call. Then, while the table is full,
        the client holding the most one-shot sessions gives up its oldest (a crowd of
        addresses filling the table pushes out its own calls, not a visitor's call that
        is being answered)."""
        queue = self.blocks._queue
        now = time.monotonic()
        while self.one_shot:
            session_id, state = next(iter(self.one_shot.items()))
            delivered = not queue.pending_event_ids_session.get(session_id)
            if not (delivered or now - state.created > self.one_shot_max_age_s):
                break
            self._drop_one_shot(session_id, delivered=delivered)
        while len(self.one_shot) >= self.one_shot_capacity:
            largest = max(self._one_shots_of, key=self._one_shots_of.__getitem__, default=None)
            if largest is None or not self._drop_oldest_one_shot_of(largest):
                oldest = next(iter(self.one_shot))  # no client known, or all its calls queued
                self._drop_one_shot(oldest, delivered=not queue.pending_event_ids_session.get(oldest))


def _queued(queue: Any, event: Any) -> bool:
    return any(event in q.queue for q in queue.event_queue_per_concurrency_id.values())


def _forget_call(queue: Any, session_id: str, *, delivered: bool) -> None:
    """Gradio's own records of a one-shot call: its answer was read, or nobody read it
    in time (a read after that finds no session). A call still waiting in the queue
    stays Gradio's to run."""
    event = queue.event_ids_to_events.get(session_id)
    if event is not None:
        if _queued(queue, event):
            return
        if not delivered:
            event.alive = False  # a run still going must not post into the records dropped here
    queue.pending_event_ids_session.pop(session_id, None)
    queue.pending_messages_per_session.pop(session_id, None)
    # A call answered by the cache probe never leaves this table in Gradio 6.31.
    queue.event_ids_to_events.pop(session_id, None)


def _forget_answered_events(queue: Any) -> None:
    """Drop events whose answer has been delivered from `event_ids_to_events`: Gradio
    removes the ones it ran from its queue, but never one its cache probe answered,
    whatever the session (a gradio_client keeps one session for all its calls)."""
    try:
        queued = {event._id for q in queue.event_queue_per_concurrency_id.values() for event in q.queue}
        for event_id, event in list(queue.event_ids_to_events.items()):
            pending = queue.pending_event_ids_session.get(event.session_hash, ())
            if event_id not in pending and event_id not in queued:
                queue.event_ids_to_events.pop(event_id, None)
    except RuntimeError:  # changed under us by a call on another thread: the next sweep does it
        return


class SweepTimer:
    """Sweeps a holder's one-shot sessions every `every_s` on the server's event loop (where
    Gradio's queue runs), so abandoned calls expire while no new call comes to sweep them.
    Owned by the app: `start` on its startup, `stop` on its shutdown."""

    def __init__(self, holder: LeanStateHolder, every_s: float | None = None) -> None:
        self._holder = holder
        self._every_s = SWEEP_EVERY_S if every_s is None else every_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="one-shot-sweep")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            try:
                with self._holder.lock:
                    self._holder.sweep()
            except RuntimeError:  # a table changed on another thread meanwhile: the next round
                continue


class EventIdsPerSession(dict):
    """Gradio's `Queue.pending_event_ids_session`, where a session that is gone reads as one
    with no call pending. A session pushed out (its calls abandoned, or over a bound) may
    still have a result stream open: Gradio's stream reads the table after each message,
    and would fail with a KeyError and a traceback; now it ends the stream cleanly."""

    def __missing__(self, session_hash: str) -> frozenset[str]:
        return frozenset()


def install_lean_sessions(mounted_app: Any, blocks: Blocks) -> LeanStateHolder:
    """Give `blocks` one `LeanStateHolder`, shared by the mounted Gradio app
    (`gradio.routes.App`, which serves requests) and `blocks.app` (the one `queue()`
    built, through which the queue runs its cache probes), and its queue `SessionQueues`."""
    holder = LeanStateHolder()
    holder.set_blocks(blocks)
    for app in (mounted_app, blocks.app):
        app.state_holder = holder
    queue = blocks._queue
    queue.pending_messages_per_session = SessionQueues(queue, holder)
    queue.pending_event_ids_session = EventIdsPerSession(queue.pending_event_ids_session)
    return holder
