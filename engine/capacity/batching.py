"""Micro-batching: concurrent misses for one model share one forward pass.

For a model that opts in (`Classifier.batch_misses`), at most one forward pass
runs at a time; misses that arrive meanwhile wait, and the first of them, when the
pass ends, runs all that are waiting (up to `max_batch`) as one `predict_batch`
call. Alone, a miss runs at once: batching never adds a wait to an idle model.

Why only some models: on the CPU the text model's per-call cost (Python dispatch
of the transformer, under the GIL) is about 40 % of a one-message pass, so a batch
of 2 costs 21 % less per message and 4 costs 36 % less; the image model's cost is
in its convolutions, so batching gains nothing there and its concurrent passes
use both cores better.

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


class BatchedPrediction(NamedTuple):
    prediction: Prediction
    batch_size: int  # how many inputs the forward pass that answered it had
    elapsed_s: float  # that forward pass's time


class _Waiter:
    __slots__ = ("answer", "arrived", "client", "depth", "done", "error", "item")

    def __init__(self, item: Any, client: str | None) -> None:
        self.item = item
        self.client = client
        self.arrived = time.perf_counter()
        self.depth = 0  # misses waiting or running when it arrived
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
        on_pass: Callable[[list[str | None], list[str]], None] | None = None,
        waits: QueueWaits | None = None,
    ) -> None:
        if max_batch < 2:
            raise ValueError("max_batch must be >= 2 (1 means: do not batch)")
        self._model = model
        # Told each forward pass's clients (None: the app's own), one per input, and the clients
        # that were waiting when it was formed ("": the app's own): the batch-size histogram and
        # the contended shares (engine.capacity.admission).
        self._on_pass = on_pass
        self._max_batch = max_batch
        self._cond = threading.Condition()
        self._waiting: FairQueue[_Waiter] = FairQueue()
        self._waits = waits  # how long misses waited for their pass (/metrics)
        self._running = False

    @property
    def model(self) -> Classifier:
        return self._model

    def predict(self, item: Any, client: str | None = None) -> BatchedPrediction:
        """The model's prediction for one canonical input (raises what the model raised)."""
        waiter = _Waiter(item, client)
        with self._cond:
            waiter.depth = len(self._waiting) + self._running
            self._waiting.push(client or "", waiter)
            # A waiter taken into another's batch has left the queue: it only waits.
            while not waiter.done and (self._running or self._waiting.peek() is not waiter):
                self._cond.wait()
            if not waiter.done:
                self._running = True
                count = min(self._max_batch, len(self._waiting))
                competing = self._waiting.clients()
                batch = [self._waiting.pop() for _ in range(count)]
        if not waiter.done and self._waits is not None:
            now = time.perf_counter()
            for taken in batch:
                self._waits.record(self._model.task, taken.depth, now - taken.arrived)
        if not waiter.done:
            try:
                self._run(batch, competing)
            finally:
                with self._cond:
                    for other in batch:  # only if the pass was interrupted (KeyboardInterrupt...)
                        if not other.done:
                            other.error, other.done = RuntimeError("the forward pass was interrupted"), True
                    self._running = False
                    self._cond.notify_all()
        if waiter.error is not None:
            raise waiter.error
        assert waiter.answer is not None
        return waiter.answer

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
