"""Micro-batching: concurrent misses for one model share one forward pass.

For a model that opts in (`Classifier.batch_misses`), at most `passes` forward passes run at
a time (one, unless the model's backend takes several at once: below); misses that arrive
while they are all busy wait, and the first of them, when a pass ends, runs all that are
waiting (up to `max_batch`) as one `predict_batch` call. Alone, a miss runs at once: batching
never adds a wait to an idle model.

Why only some models: on the CPU the text model's per-call cost (Python dispatch of the
transformer under the GIL with torch; the weights read from memory with onnxruntime) is a
large part of a short message's pass, so inputs that share a pass cost less each; the image
model's cost is in its convolutions, so batching gains nothing there and its concurrent passes
use both cores better.

Why several passes for onnxruntime (engine.capacity.passes): its session runs passes at once
(it releases the GIL), and concurrent passes share its intra-op threads, each on the thread
that called it. Measured on 2 cores (bench.miss_cost, MiniLM, 4 clients): two passes of ~2
messages at once cost ~15 % less CPU a message than one pass of ~4 on two threads (whose
small matrix products spend a thread's time on handing work over), and answer sooner, while a
lone message still gets both threads. Torch keeps one pass: its own thread pool would be
oversubscribed.

With several passes, waiting misses are shared out among the free ones (eight waiting, two free:
two passes of four, not one of eight beside an idle core). And a miss that would start a pass
alone while another pass runs waits briefly for a companion (up to COMPANION_WAIT_S after a
pass of several inputs ended: that pass's other clients are sending their next misses), so
that passes stay shared instead of splitting into lone ones: on onnxruntime a message alone
costs a fifth more CPU than two to four to a pass (engine.models.text's packed rows). An idle
model, a lone client or a pass of one never waits. Measured with bench.miss_cost's text
messages, 4 clients, two passes: 4-5 % less CPU a miss and a shorter p90 (24-26 against 32-36
ms); 2 clients unchanged.

Waiting misses are taken round-robin across clients (engine.capacity.fairness.FairQueue): a
client's many waiting misses do not fill the next batch ahead of another client's one.

A batch that fails is retried item by item, so one bad input fails only itself (not when a
remote model's server is unavailable: that fails every input alike).
Scores computed in a batch may differ from one-at-a-time scores in the last bits
(below 1e-6 measured); labels and their order do not change.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from engine.capacity.fairness import FairQueue, QueueWaits
from engine.errors import RemoteUnavailableError
from engine.models.base import Classifier, Prediction

# How long after a pass of several inputs ended a miss that would run alone beside another pass
# waits for a companion: its clients' next misses arrive within about a millisecond in-process.
COMPANION_WAIT_S = 0.002


def batch_share(waiting: int, free_passes: int, max_batch: int) -> int:
    """How many of the waiting misses a pass takes when `free_passes` (itself included) are free:
    an even share, at most `max_batch`."""
    return min(max_batch, -(-waiting // max(1, free_passes)))


class BatchedPrediction(NamedTuple):
    prediction: Prediction
    batch_size: int  # how many inputs the forward pass that answered it had
    elapsed_s: float  # that forward pass's time


class _Waiter:
    __slots__ = ("answer", "arrived", "client", "depth", "done", "error", "item", "taken")

    def __init__(self, item: Any, client: str | None) -> None:
        self.item = item
        self.client = client
        self.arrived = time.perf_counter()
        self.depth = 0  # misses waiting or running when it arrived
        self.taken = False  # in a batch (running): it only waits for its answer
        self.done = False
        self.answer: BatchedPrediction | None = None
        self.error: BaseException | None = None


class MicroBatcher:
    """One model's queue of misses. Thread-safe; owned by the engine."""

    def __init__(
        self,
        model: Classifier,
        *,
        max_batch: int,
        passes: int = 1,
        on_pass: Callable[[list[str | None], list[str]], None] | None = None,
        waits: QueueWaits | None = None,
    ) -> None:
        if max_batch < 2:
            raise ValueError("max_batch must be >= 2 (1 means: do not batch)")
        if passes < 1:
            raise ValueError("passes must be >= 1")
        self._model = model
        self._passes = passes
        # Told each forward pass's clients (None: the app's own), one per input, and the clients
        # that were waiting when it was formed ("": the app's own): the batch-size histogram and
        # the contended shares (engine.capacity.admission).
        self._on_pass = on_pass
        self._max_batch = max_batch
        self._cond = threading.Condition()
        self._waiting: FairQueue[_Waiter] = FairQueue()
        self._waits = waits  # how long misses waited for their pass (/metrics)
        self._running = 0  # passes running now
        # The last pass to end: its inputs and when (a lone miss may wait for a companion then).
        self._last_pass_size = 0
        self._last_pass_end = 0.0
        self._awaiting_companion = False  # the head miss waits for another: an arrival wakes it

    @property
    def model(self) -> Classifier:
        return self._model

    @property
    def passes(self) -> int:
        """How many forward passes may run at once."""
        return self._passes

    def predict(self, item: Any, client: str | None = None) -> BatchedPrediction:
        """The model's prediction for one canonical input (raises what the model raised)."""
        waiter = _Waiter(item, client)
        batch: list[_Waiter] | None = None  # the batch this call leads, if it leads one
        with self._cond:
            waiter.depth = len(self._waiting) + self._running
            self._waiting.push(client or "", waiter)
            if self._awaiting_companion:
                self._cond.notify_all()
            while not waiter.taken:
                if self._running < self._passes and self._waiting.peek() is waiter:
                    wait_s = self._companion_wait_s()
                    if wait_s <= 0:
                        break
                    self._awaiting_companion = True
                    self._cond.wait(wait_s)
                    self._awaiting_companion = False
                else:
                    self._cond.wait()
            if waiter.taken:  # in another's batch: it only waits for the answer (the pass's end wakes it)
                while not waiter.done:
                    self._cond.wait()
            else:
                count = batch_share(len(self._waiting), self._passes - self._running, self._max_batch)
                self._running += 1
                competing = self._waiting.clients()
                batch = [self._waiting.pop() for _ in range(count)]
                for taken in batch:
                    taken.taken = True
                if len(self._waiting) and self._running < self._passes:
                    self._cond.notify_all()  # a batch left others behind and a pass is free
        if batch is not None:
            if self._waits is not None:
                now = time.perf_counter()
                for taken in batch:
                    self._waits.record(self._model.task, taken.depth, now - taken.arrived)
            try:
                self._run(batch, competing)
            finally:
                with self._cond:
                    for other in batch:  # only if the pass was interrupted (KeyboardInterrupt...)
                        if not other.done:
                            other.error, other.done = RuntimeError("the forward pass was interrupted"), True
                    self._running -= 1
                    self._last_pass_size, self._last_pass_end = len(batch), time.perf_counter()
                    self._cond.notify_all()
        if waiter.error is not None:
            raise waiter.error
        assert waiter.answer is not None
        return waiter.answer

    def _companion_wait_s(self) -> float:
        """How long the head miss, with a pass free, waits for a companion: alone in the queue
        while another pass runs, until COMPANION_WAIT_S after the last pass ended if that pass
        had several inputs; else 0 (it starts now)."""
        if len(self._waiting) > 1 or self._running == 0 or self._last_pass_size < 2:
            return 0.0
        return self._last_pass_end + COMPANION_WAIT_S - time.perf_counter()

    def _run(self, batch: Sequence[_Waiter], competing: list[str]) -> None:
        started = time.perf_counter()
        if self._on_pass is not None:
            self._on_pass([w.client for w in batch], competing)
        try:
            predictions = self._model.predict_batch([w.item for w in batch])
            if len(predictions) != len(batch):
                raise RuntimeError(f"predict_batch gave {len(predictions)} answers for {len(batch)} inputs")
        except Exception as exc:
            # A remote model's server that is down or slow fails every input alike: retrying them one
            # by one would only multiply the wait (engine.models.remote).
            if len(batch) > 1 and not isinstance(exc, RemoteUnavailableError):
                for waiter in batch:  # one bad input must not fail the others
                    self._run([waiter], [waiter.client or ""])
                return
            self._finish(batch[0], None, exc)
            return
        elapsed = time.perf_counter() - started
        for waiter, prediction in zip(batch, predictions, strict=True):
            self._finish(waiter, BatchedPrediction(prediction, len(batch), elapsed), None)

    def _finish(self, waiter: _Waiter, answer: BatchedPrediction | None, error: Exception | None) -> None:
        with self._cond:
            waiter.answer, waiter.error, waiter.done = answer, error, True
