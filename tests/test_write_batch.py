"""WriteBatch on its own: when a request's L2 writes wait, and who sends them."""

from __future__ import annotations

import pytest

from engine.write_batch import L2Write, WriteBatch


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
