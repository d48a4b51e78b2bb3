"""Gradio's queue loop, woken when there is work instead of polling every millisecond.

Gradio's `Queue.start_processing` looks for an event it can start, and when there is none
(an empty queue, every worker busy, every event's concurrency limit reached) sleeps 1 ms and
looks again: a thousand wake-ups a second for as long as the app runs, idle or serving hits
that never enter the queue (measured here: 30 ms of CPU a second on a loaded 2-core machine,
about a tenth of a cached call's own cost at the workload's rate). `WokenQueue` runs the same
loop, but in place of the 1 ms sleep it waits until something that can let an event start has
happened: an event pushed (`Queue.push`) or an event's processing ended (`process_events`: a
worker and a concurrency place freed). A wait also ends after MAX_WAIT_S, so a change made
any other way is seen as late as that, never lost.

Pinned to gradio==6.31.0 like ui.lean_sessions: `tests/test_queue_wake.py` checks that
Gradio's loop is still the one copied here, so an upgrade that changes it fails there first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from gradio.utils import run_coro_in_background, set_task_name

# The longest the loop sleeps without being woken (Gradio's own sleep: 1 ms).
MAX_WAIT_S = 0.05


class WokenQueue:
    """Installs the woken loop on a Gradio queue before it starts (see the module)."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self._push = queue.push
        self._process_events = queue.process_events
        self._wake: asyncio.Event | None = None  # made on the loop that runs the queue
        self.wakeups = 0  # times the loop looked for work (for tests and the curious)

    def install(self) -> None:
        queue = self._queue
        queue.push = self.push
        queue.process_events = self.process_events
        queue.start_processing = self.start_processing  # Queue.start runs it as a task

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def push(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._push(*args, **kwargs)
        finally:
            self.wake()

    async def process_events(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._process_events(*args, **kwargs)
        finally:
            self.wake()

    async def _idle(self) -> None:
        wake = self._wake
        assert wake is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), MAX_WAIT_S)
        wake.clear()

    async def start_processing(self) -> None:
        """gradio.queueing.Queue.start_processing (6.31.0), its `asyncio.sleep(sleep_when_free)`
        replaced by waiting to be woken."""
        self._wake = asyncio.Event()
        q = self._queue
        try:
            while not q.stopped:
                self.wakeups += 1
                self._wake.clear()  # what happens from here on wakes the next wait
                if len(q) == 0:
                    await self._idle()
                    continue

                if None not in q.active_jobs:
                    await self._idle()
                    continue

                # Using mutex to avoid editing a list in use
                async with q.delete_lock:
                    event_batch = q.get_events()

                if event_batch:
                    events, batch, concurrency_id = event_batch
                    q.active_jobs[q.active_jobs.index(None)] = events
                    event_queue = q.event_queue_per_concurrency_id[concurrency_id]
                    event_queue.current_concurrency += 1
                    start_time = time.time()
                    fn = events[0].fn
                    event_queue.start_times_per_fn[fn].add(start_time)
                    for event in events:
                        if (a := q.event_analytics.get(event._id)) is not None:
                            a["status"] = "processing"
                    process_event_task = run_coro_in_background(
                        q.process_events, events, batch, start_time, fn
                    )
                    set_task_name(process_event_task, events[0].session_hash, fn._id, events[0]._id, batch)

                    q._asyncio_tasks.add(process_event_task)
                    process_event_task.add_done_callback(q._asyncio_tasks.discard)
                    if q.live_updates:
                        q.broadcast_estimations(concurrency_id)
                else:
                    await self._idle()
        finally:
            q.stopped = True
            q._cancel_asyncio_tasks()
