"""WriteBatch on its own: when a request's L2 writes wait, and who sends them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from engine.cache.write_batch import L2Write, OverdueWriteTimer, WriteBatch


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def write(name: str) -> L2Write:
    return L2Write(f"k:{name}", name.encode(), 60)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def batch(clock: FakeClock) -> WriteBatch:
    return WriteBatch(max_delay_s=0.05, clock=clock)


def keys(writes: list[L2Write]) -> list[str]:
    return [w.key for w in writes]


def test_alone_a_request_sends_its_writes_at_once(batch: WriteBatch) -> None:
    batch.enter()
    assert keys(batch.add([write("a"), write("b")])) == ["k:a", "k:b"]
    assert batch.leave() == []


def test_with_others_in_flight_writes_wait_in_order_for_a_read(batch: WriteBatch) -> None:
    batch.enter()
    batch.enter()
    assert batch.add([write("result"), write("alias")]) == []
    assert batch.add([write("other")]) == []
    assert keys(batch.take()) == ["k:result", "k:alias", "k:other"]  # a read carries them
    assert batch.take() == []


def test_the_last_request_to_leave_sends_what_waits(batch: WriteBatch) -> None:
    batch.enter()
    batch.enter()
    assert batch.add([write("a")]) == []
    assert batch.leave() == []  # one still in flight: keep waiting
    assert keys(batch.leave()) == ["k:a"]
    batch.enter()
    assert batch.leave() == []  # nothing left to send


def test_overdue_writes_go_with_the_next_write_or_leave(batch: WriteBatch, clock: FakeClock) -> None:
    for _ in range(3):
        batch.enter()
    assert batch.add([write("a")]) == []
    clock.now += 0.04
    assert batch.add([write("b")]) == []  # not yet overdue
    clock.now += 0.02
    assert keys(batch.add([write("c")])) == ["k:a", "k:b", "k:c"]  # a's delay ran out
    assert batch.add([write("d")]) == []
    clock.now += 0.06
    assert keys(batch.leave()) == ["k:d"]  # others still in flight, but d is overdue


def test_discard_drops_what_waits(batch: WriteBatch) -> None:
    batch.enter()
    batch.enter()
    batch.add([write("a"), write("b")])
    assert batch.discard() == 2
    batch.leave()
    assert batch.leave() == []


def test_the_timer_is_handed_overdue_writes_and_nothing_younger(batch: WriteBatch, clock: FakeClock) -> None:
    batch.enter()
    batch.enter()
    batch.add([write("a")])
    clock.now += 0.05
    assert keys(batch.wait_overdue() or []) == ["k:a"]  # due now: at once
    batch.add([write("b")])
    got: list[list[L2Write] | None] = []
    waiter = threading.Thread(target=lambda: got.append(batch.wait_overdue()), daemon=True)
    waiter.start()
    time.sleep(0.2)  # b is young on the fake clock: the timer must still be waiting
    assert got == [] and waiter.is_alive()
    batch.stop_timer()
    waiter.join(5)
    assert not waiter.is_alive() and got == [None]
    assert keys(batch.take()) == ["k:b"]  # stopping the timer leaves b for whoever closes


class Sent:
    """The timer's `send`: records what it was handed; the first `failures` calls raise."""

    def __init__(self, failures: int = 0) -> None:
        self.batches: list[list[str]] = []
        self.calls = 0
        self.failures = failures
        self.arrived = threading.Event()

    def __call__(self, writes: list[L2Write]) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("boom")
        self.batches.append(keys(writes))
        self.arrived.set()


@contextmanager
def timed(max_delay_s: float, sent: Sent) -> Iterator[WriteBatch]:
    """A batch (on the real clock: the timer sleeps for real) with two requests in flight and
    its timer running; the timer is asserted stopped afterwards."""
    batch = WriteBatch(max_delay_s=max_delay_s)
    timer = OverdueWriteTimer(batch, sent)
    timer.start()
    try:
        batch.enter()
        batch.enter()
        yield batch
    finally:
        timer.close()
    assert not timer.running
    timer.close()  # idempotent


def test_the_timer_sends_writes_no_request_carried() -> None:
    sent = Sent()
    with timed(0.05, sent) as batch:
        started = time.monotonic()
        assert batch.add([write("a"), write("b")]) == []
        assert sent.arrived.wait(5), "the timer never sent the waiting writes"
        assert time.monotonic() - started >= 0.05  # not before they were due
        assert sent.batches == [["k:a", "k:b"]]
        sent.arrived.clear()
        assert batch.add([write("c")]) == []  # the timer sleeps until something waits again
        assert sent.arrived.wait(5) and sent.batches[-1] == ["k:c"]
        assert batch.leave() == [] and batch.leave() == []  # nothing left for the last to leave


def test_writes_a_request_took_are_not_sent_by_the_timer() -> None:
    sent = Sent()
    with timed(0.05, sent) as batch:
        batch.add([write("a")])
        assert keys(batch.take()) == ["k:a"]  # a read carried them
        time.sleep(0.2)
        assert sent.calls == 0


def test_a_failing_send_does_not_stop_the_timer() -> None:
    sent = Sent(failures=1)
    with timed(0.01, sent) as batch:
        batch.add([write("a")])
        deadline = time.monotonic() + 5
        while sent.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        batch.add([write("b")])
        assert sent.arrived.wait(5) and sent.batches == [["k:b"]]
