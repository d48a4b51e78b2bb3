"""Forward passes: how a miss gets the model, shared out among the requests that need it.

Per task, a miss either joins the model's micro-batcher (engine.capacity.batching; models that gain
from batching) or takes one of the task's pass slots (up to its miss concurrency at once).
Waiting misses are served round-robin across clients either way (engine.capacity.fairness), and a
miss is admitted here (engine.capacity.admission: the client's budget, refused only when it would take
the model from another client) just before a pass is waited for: only real misses get this
far (hits, coalesced answers and remembered rejections never do).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

from engine.capacity.admission import ContendedShare, MissAdmission
from engine.capacity.batching import MicroBatcher
from engine.capacity.fairness import FairSlots, MissBudget, QueueWaits
from engine.models.base import Classifier, Prediction


class PassResult(NamedTuple):
    prediction: Prediction
    forward_s: float  # the forward pass itself, without the wait for it
    share: float  # of that pass, this input's part (1 / the batch's size)


class ModelPasses:
    """Every task's way to the model. Thread-safe; owned by the engine."""

    def __init__(
        self,
        models: Mapping[str, Classifier],
        *,
        batch_max_size: int,
        miss_concurrency: Mapping[str, int] | None,
        on_pass: Callable[[str, int], None],
        miss_budget: MissBudget | None = None,
    ) -> None:
        self._batch_max_size = batch_max_size
        self._on_pass = on_pass  # (task, inputs in the pass): the batch-size histogram
        self._admission = MissAdmission(miss_budget)
        self._waits = QueueWaits()
        limits = dict(miss_concurrency or {})
        self._miss_limits = {task: max(1, limits.get(task, 1)) for task in models}
        # Every task has its slots: a model swapped in live may not batch where the old one did.
        self._slots = {t: FairSlots(n, task=t, waits=self._waits) for t, n in self._miss_limits.items()}
        self._batchers: dict[str, MicroBatcher] = {}
        for task, model in models.items():
            self.set_model(task, model)

    def set_model(self, task: str, model: Classifier) -> None:
        """Only models that gain from it batch (see engine.capacity.batching): the misses that wait
        for a pass share the next. The others run up to their limit at once."""
        max_batch = getattr(model, "max_batch", None) or self._batch_max_size  # MODELS_CONFIG's max_batch
        if max_batch > 1 and getattr(model, "batch_misses", False):
            on_pass = partial(self._record_pass, task)
            batcher = MicroBatcher(model, max_batch=max_batch, passes=self.batched_passes(task, model),
                                   on_pass=on_pass, waits=self._waits)  # fmt: skip
            self._batchers[task] = batcher
        else:
            self._batchers.pop(task, None)

    def batched_passes(self, task: str, model: Classifier) -> int:
        """Concurrent passes of a batching model: its miss limit when onnxruntime serves it (its
        session takes concurrent passes, each on its caller's thread; engine.capacity.batching),
        else one (torch's thread pool, a remote server's own batching)."""
        return self._miss_limits[task] if getattr(model, "backend", "torch") == "onnxruntime" else 1

    def admission_limit(self, task: str) -> int:
        """How many requests of a task may be inside the engine at once so that its
        misses use the model fully: its concurrent passes, or a full batch to share one."""
        if task in self._batchers:
            return max(self._miss_limits[task], self._batch_max_size)
        return self._miss_limits[task]

    @contextmanager
    def admitted(self, task: str, client: str | None) -> Iterator[None]:
        """Holds one of `client`'s misses of `task` from its admission (engine.capacity.admission; raises
        OverBudgetError when refused) until its pass is done; the app's own requests (None)
        and a budget turned off spend nothing."""
        with self._admission.admitted(task, client):
            yield

    def _record_pass(self, task: str, clients: list[str | None], competing: list[str]) -> None:
        self._on_pass(task, len(clients))
        self._admission.record_pass(task, clients, competing)

    def run(self, model: Classifier, canonical: Any, client: str | None) -> PassResult:
        """The model's prediction for one canonical input, in its turn (raises what the
        model raised)."""
        task = model.task
        batcher = self._batchers.get(task)
        if batcher is not None and batcher.model is model:  # else swapped meanwhile: its own pass
            prediction, batch_size, forward_s = batcher.predict(canonical, client)
            return PassResult(prediction, forward_s, 1.0 / batch_size)
        with self._slots[task].slot(client) as competing:
            started = time.perf_counter()  # the pass, not the wait for a slot
            self._record_pass(task, [client], competing)
            prediction = model.predict_batch([canonical])[0]
            return PassResult(prediction, time.perf_counter() - started, 1.0)

    def limits(self, task: str) -> dict[str, Any]:
        """For the batch summary: whether the task batches, its concurrent passes, its admission."""
        batcher = self._batchers.get(task)
        passes = self._miss_limits[task] if batcher is None else batcher.passes
        return {"batched": batcher is not None, "concurrent_passes": passes,
                "admitted": self.admission_limit(task)}  # fmt: skip

    def fairness_state(self) -> dict[str, Any]:
        """The miss budget (None when off), clients limited now, waits for a forward pass by
        (task, misses already waiting on arrival) as (count, seconds) (engine.capacity.fairness), and
        admissions by (task, decision) (engine.capacity.admission)."""
        budget = self._admission.budget
        return {
            "miss_budget": None if budget is None else {"rate": budget.rate, "burst": budget.burst,
                                                        "local_fallbacks": budget.local_fallbacks},
            "limited_clients": 0 if budget is None else budget.limited_clients(),
            "queue_waits": self._waits.snapshot(),
            "admissions": self._admission.state(),
        }  # fmt: skip

    def contended_share(self, client: str) -> ContendedShare:
        """engine.capacity.admission.ContendedShare of `client` (benchmarks, tests)."""
        return self._admission.contended_share(client)
