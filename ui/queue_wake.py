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

Gradio's second loop, `Queue.start_progress_updates`, sends a running event's progress every
10 ms, and with no event running sleeps 10 ms and looks again: a hundred wake-ups a second
(14 ms of CPU a second on this 2-core machine, idle or serving hits). Here, with no event
running, it waits until the first loop starts one (or PROGRESS_MAX_WAIT_S), and runs as
Gradio's while any is. A wait is a future and a timer, not `asyncio.wait_for`'s task.

Pinned to gradio==6.31.0 like ui.lean_sessions: `tests/test_queue_wake.py` checks that
Gradio's loop is still the one copied here, so an upgrade that changes it fails there first.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gradio.utils import run_coro_in_background, set_task_name

# The longest the loop sleeps without being woken (Gradio's own sleep: 1 ms).
MAX_WAIT_S = 0.05
# The longest the progress loop sleeps with no event running, unless one starts (Gradio: 10 ms).
PROGRESS_MAX_WAIT_S = 1.0


class Wakeup:
    """A wait that `set()` ends early, and that a `set()` made since the last `clear()` ends at
    once. Used on the event loop only."""

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self, timeout_s: float) -> None:
        """Until set() or `timeout_s`; then cleared."""
        if not self._set:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _resolve, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        self._set = False


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class WokenQueue:
    """Installs the woken loop on a Gradio queue before it starts (see the module)."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self._push = queue.push
        self._process_events = queue.process_events
        self._wake = Wakeup()
        self._job_started = Wakeup()  # wakes the progress loop
        self.wakeups = 0  # times the loop looked for work (for tests and the curious)
        self.progress_wakeups = 0  # times the progress loop looked for events

    def install(self) -> None:
        queue = self._queue
        queue.push = self.push
        queue.process_events = self.process_events
        queue.start_processing = self.start_processing  # Queue.start runs both as tasks
        queue.start_progress_updates = self.start_progress_updates

    def wake(self) -> None:
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
        await self._wake.wait(MAX_WAIT_S)

    async def start_processing(self) -> None:
        """gradio.queueing.Queue.start_processing (6.31.0), its `asyncio.sleep(sleep_when_free)`
        replaced by waiting to be woken."""
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
                    self._job_started.set()
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

    async def start_progress_updates(self) -> None:
        """gradio.queueing.Queue.start_progress_updates (6.31.0), its sleep with no event
        running replaced by waiting for one to start."""
        q = self._queue
        while not q.stopped:
            self.progress_wakeups += 1
            self._job_started.clear()  # a job started from here on ends the next wait
            events = [evt for job in q.active_jobs if job is not None for evt in job]

            if len(events) == 0:
                await self._job_started.wait(PROGRESS_MAX_WAIT_S)
                continue

            for event in events:
                if event.progress_pending and event.progress:
                    event.progress_pending = False
                    q.send_message(event, event.progress)

            await asyncio.sleep(q.progress_update_sleep_when_free)
