"""MicroBatcher: concurrent misses of one model share a forward pass (engine.capacity.batching).

A tiny deterministic stand-in model: the subject is the queueing, not the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from engine.capacity import batching
from engine.capacity.batching import MicroBatcher, batch_share
from engine.models.base import Prediction


class GatedModel:
    """Records every batch; a batch containing "hold" waits for `gate`; "bad" makes a batch fail."""

    task = "text"
    name = "gated"
    version = "v1"
    device = "cpu"

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.holding = threading.Event()
        self.running = 0
        self.most_running = 0
        self._lock = threading.Lock()

    def predict_batch(self, inputs: Sequence[str]) -> list[Prediction]:
        with self._lock:
            self.batches.append(list(inputs))
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            self.hold(inputs)
            if "bad" in inputs:
                raise ValueError("a bad input in the batch")
            return [Prediction(((item, float(len(item))),)) for item in inputs]
        finally:
            with self._lock:
                self.running -= 1

    def hold(self, inputs: Sequence[str]) -> None:
        if "hold" in inputs:
            self.holding.set()
            assert self.gate.wait(10), "the test never released the held pass"


@pytest.fixture
def model() -> Iterator[GatedModel]:
    model = GatedModel()
    yield model
    model.gate.set()  # never leave a thread waiting


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as executor:
        yield executor


def wait_until_queued(batcher: MicroBatcher, count: int) -> None:
    for _ in range(500):
        if len(batcher._waiting) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"{count} misses never queued")


def test_alone_a_miss_runs_at_once_in_a_batch_of_one(model: GatedModel) -> None:
    batcher = MicroBatcher(model, max_batch=8)
    answer = batcher.predict("hello")
    assert answer.prediction.labels == (("hello", 5.0),)
    assert answer.batch_size == 1 and answer.elapsed_s >= 0
    assert model.batches == [["hello"]]


def test_misses_that_wait_for_a_pass_go_together_in_the_next(model: GatedModel, pool: Any) -> None:
    batcher = MicroBatcher(model, max_batch=8)
    held = pool.submit(batcher.predict, "hold")
    assert model.holding.wait(10)
    waiting = {text: pool.submit(batcher.predict, text) for text in ("a", "bb", "ccc")}
    wait_until_queued(batcher, 3)
    model.gate.set()
    assert held.result(10).batch_size == 1
    for text, future in waiting.items():
        answer = future.result(10)
        assert answer.prediction.labels == ((text, float(len(text))),)  # each its own answer
        assert answer.batch_size == 3
    assert len(model.batches) == 2 and sorted(model.batches[1]) == ["a", "bb", "ccc"]
    assert model.most_running == 1


def test_a_batch_holds_at_most_max_batch_inputs(model: GatedModel, pool: Any) -> None:
    batcher = MicroBatcher(model, max_batch=2)
    held = pool.submit(batcher.predict, "hold")
    assert model.holding.wait(10)
    futures = [pool.submit(batcher.predict, f"m{k}") for k in range(5)]
    wait_until_queued(batcher, 5)
    model.gate.set()
    held.result(10)
    assert [f.result(10).prediction.labels[0][0] for f in futures] == [f"m{k}" for k in range(5)]
    assert [len(batch) for batch in model.batches] == [1, 2, 2, 1]


def test_a_failing_batch_is_retried_one_by_one_so_only_the_bad_input_fails(
    model: GatedModel, pool: Any
) -> None:
    batcher = MicroBatcher(model, max_batch=8)
    held = pool.submit(batcher.predict, "hold")
    assert model.holding.wait(10)
    good = pool.submit(batcher.predict, "good")
    bad = pool.submit(batcher.predict, "bad")
    wait_until_queued(batcher, 2)
    model.gate.set()
    held.result(10)
    assert good.result(10).prediction.labels == (("good", 4.0),)
    with pytest.raises(ValueError, match="bad input"):
        bad.result(10)
    assert batcher.predict("after").batch_size == 1  # the batcher is not stuck


def test_under_load_one_pass_at_a_time_and_every_answer_its_own(model: GatedModel, pool: Any) -> None:
    batcher = MicroBatcher(model, max_batch=4)
    texts = [f"message {k}" * (k % 3 + 1) for k in range(200)]
    answers = list(pool.map(batcher.predict, texts))
    assert [a.prediction.labels for a in answers] == [((t, float(len(t))),) for t in texts]
    assert model.most_running == 1
    assert sum(len(batch) for batch in model.batches) == len(texts)
    assert max(len(batch) for batch in model.batches) <= 4


def test_max_batch_below_two_is_refused(model: GatedModel) -> None:
    with pytest.raises(ValueError):
        MicroBatcher(model, max_batch=1)


def wait_for(condition: Any, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(what)


def test_with_two_passes_a_miss_starts_beside_a_running_pass_and_later_ones_share_the_next(
    model: GatedModel, pool: Any
) -> None:
    batcher = MicroBatcher(model, max_batch=8, passes=2)
    held = [pool.submit(batcher.predict, "hold") for _ in range(2)]  # both passes busy
    wait_for(lambda: model.running == 2, "two passes never ran at once")
    waiting = [pool.submit(batcher.predict, text) for text in ("a", "b", "c")]
    wait_until_queued(batcher, 3)
    assert model.running == 2  # no third pass
    model.gate.set()
    for future in held:
        assert future.result(10).batch_size == 1
    assert [f.result(10).prediction.labels for f in waiting] == [(("a", 1.0),), (("b", 1.0),), (("c", 1.0),)]
    later = model.batches[2:]  # the waiting ones shared the next passes (one, or both when both were free)
    assert sorted(text for batch in later for text in batch) == ["a", "b", "c"] and len(later) <= 2
    assert model.most_running == 2


def test_a_full_batch_that_leaves_misses_behind_lets_them_take_the_free_pass(
    model: GatedModel, pool: Any
) -> None:
    batcher = MicroBatcher(model, max_batch=2, passes=2)
    held = [pool.submit(batcher.predict, "hold") for _ in range(2)]
    wait_for(lambda: model.running == 2, "two passes never ran at once")
    texts = [f"m{k}" for k in range(7)]
    waiting = [pool.submit(batcher.predict, text) for text in texts]
    wait_until_queued(batcher, len(texts))
    model.gate.set()
    # A leader that took a full batch wakes the next one for the free pass: none is left waiting.
    assert [f.result(10).prediction.labels[0][0] for f in waiting] == texts
    assert all(len(batch) <= 2 for batch in model.batches)
    for future in held:
        future.result(10)


def test_under_load_at_most_passes_at_once_and_every_answer_its_own(model: GatedModel, pool: Any) -> None:
    batcher = MicroBatcher(model, max_batch=4, passes=2)
    texts = [f"message {k}" * (k % 3 + 1) for k in range(300)]
    answers = list(pool.map(batcher.predict, texts))
    assert [a.prediction.labels for a in answers] == [((t, float(len(t))),) for t in texts]
    assert model.most_running <= 2
    assert sum(len(batch) for batch in model.batches) == len(texts)


@pytest.mark.parametrize(("backend", "passes"), [("onnxruntime", 2), ("torch", 1)])
def test_a_batching_model_on_onnxruntime_runs_its_miss_limit_of_passes_at_once_and_on_torch_one(
    model: GatedModel, pool: Any, backend: str, passes: int
) -> None:
    from engine.capacity.passes import ModelPasses

    model.batch_misses, model.backend = True, backend  # type: ignore[attr-defined]
    model_passes = ModelPasses({"text": model}, batch_max_size=8, miss_concurrency={"text": 2},  # type: ignore[dict-item]
                               on_pass=lambda task, size: None)  # fmt: skip
    assert model_passes.limits("text")["concurrent_passes"] == passes
    held = [pool.submit(model_passes.run, model, "hold", f"client{k}") for k in range(2)]
    queue = model_passes._batchers["text"]._waiting
    wait_for(lambda: model.running + len(queue) == 2, "the misses never arrived")
    time.sleep(0.1)  # a second pass, if it may start, has started by now
    assert model.running == passes
    model.gate.set()
    for future in held:
        assert future.result(10).prediction.labels == (("hold", 4.0),)


def test_waiting_misses_are_shared_out_evenly_among_the_free_passes() -> None:
    assert batch_share(8, 2, 8) == 4  # two passes of four, not one of eight beside an idle one
    assert batch_share(3, 2, 8) == 2
    assert batch_share(9, 2, 4) == 4  # never past max_batch
    assert batch_share(5, 1, 8) == 5
    assert batch_share(1, 2, 8) == 1


class NamedGates(GatedModel):
    """GatedModel where an input "hold:<name>" waits for `release(name)`."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, threading.Event] = {}

    def release(self, name: str) -> None:
        self.gates.setdefault(name, threading.Event()).set()

    def hold(self, inputs: Sequence[str]) -> None:
        for item in inputs:
            if item.startswith("hold:"):
                self.holding.set()
                assert self.gates.setdefault(item[5:], threading.Event()).wait(10), "never released"


@pytest.fixture
def gated() -> Iterator[NamedGates]:
    model = NamedGates()
    yield model
    for gate in list(model.gates.values()):
        gate.set()


def a_pass_of(batcher: MicroBatcher, model: NamedGates, pool: Any, texts: Sequence[str]) -> None:
    """With a held pass running beside "hold:h", `texts` queue up; the held pass ends and they
    run as one pass, which ends while "hold:h" still runs."""
    gate = f"before {texts[0]}"
    pool.submit(batcher.predict, f"hold:{gate}")
    wait_for(lambda: model.running == 2, "two passes never ran at once")
    futures = [pool.submit(batcher.predict, text) for text in texts]
    wait_until_queued(batcher, len(texts))
    model.release(gate)
    assert [f.result(10).batch_size for f in futures] == [len(texts)] * len(texts)


def test_a_lone_miss_beside_a_running_pass_waits_for_the_ended_passes_other_clients(
    gated: NamedGates, pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a pass of several inputs, their clients' next misses arrive one by one: the first,
    with a pass free but another running, waits (up to COMPANION_WAIT_S) and they share a pass."""
    monkeypatch.setattr(batching, "COMPANION_WAIT_S", 5.0)  # room for a slow machine
    batcher = MicroBatcher(gated, max_batch=8, passes=2)
    held = pool.submit(batcher.predict, "hold:h")
    assert gated.holding.wait(10)
    a_pass_of(batcher, gated, pool, ["q1", "q2"])
    first = pool.submit(batcher.predict, "r1")
    wait_until_queued(batcher, 1)  # waiting, though a pass is free
    second = pool.submit(batcher.predict, "r2")
    assert first.result(10).batch_size == second.result(10).batch_size == 2
    assert ["r1", "r2"] in gated.batches
    gated.release("h")
    held.result(10)


def test_a_lone_miss_never_waits_after_a_pass_of_one_nor_on_an_idle_model(
    gated: NamedGates, pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clients (passes of one each), or nothing running: no companion is coming, a miss starts at once."""
    monkeypatch.setattr(batching, "COMPANION_WAIT_S", 30.0)  # a wait would show as a timeout
    batcher = MicroBatcher(gated, max_batch=8, passes=2)
    held = pool.submit(batcher.predict, "hold:h")
    assert gated.holding.wait(10)
    a_pass_of(batcher, gated, pool, ["q1"])
    assert pool.submit(batcher.predict, "alone").result(5).batch_size == 1
    a_pass_of(batcher, gated, pool, ["q2", "q3"])
    gated.release("h")
    held.result(10)
    wait_for(lambda: gated.running == 0, "the passes never ended")
    assert pool.submit(batcher.predict, "idle").result(5).batch_size == 1
