"""common.background: one owned thread, with real threads and short waits."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from common.background import STOP, BackgroundThread

WAIT_S = 5.0  # the most a test waits for something that should happen at once


class Counter:
    def __init__(self) -> None:
        self.calls = 0
        self.called = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.called.set()

    def wait_for(self, calls: int) -> bool:
        deadline = time.monotonic() + WAIT_S
        while self.calls < calls and time.monotonic() < deadline:
            time.sleep(0.002)
        return self.calls >= calls


def test_nothing_runs_before_start() -> None:
    work = Counter()
    worker = BackgroundThread("t-idle", work, period_s=0.001)
    time.sleep(0.05)
    assert work.calls == 0 and not worker.started and not worker.running
    assert not any(t.name == "t-idle" for t in threading.enumerate())
    assert worker.close()  # closing a thread never started is fine


def test_the_work_runs_every_period_under_its_name() -> None:
    names: list[str] = []
    work = Counter()

    def step() -> None:
        names.append(threading.current_thread().name)
        work()

    with BackgroundThread("t-periodic", step, period_s=0.01) as worker:
        assert worker.running
        assert work.wait_for(3)
    assert not worker.running
    assert set(names) == {"t-periodic"}


def test_the_work_waits_for_its_period() -> None:
    work = Counter()
    with BackgroundThread("t-slow", work, period_s=60):
        time.sleep(0.1)
        assert work.calls == 0  # not at start: after one period


def test_a_wake_up_runs_the_work_early() -> None:
    work = Counter()
    with BackgroundThread("t-woken", work, period_s=60) as worker:
        worker.wake()
        assert work.called.wait(WAIT_S)
        assert work.calls == 1


def test_without_a_period_it_runs_only_when_woken() -> None:
    work = Counter()
    with BackgroundThread("t-on-demand", work, period_s=None) as worker:
        time.sleep(0.05)
        assert work.calls == 0
        worker.wake()
        assert work.wait_for(1)
        worker.wake()
        assert work.wait_for(2)


def test_a_callable_period_is_asked_before_each_wait() -> None:
    work = Counter()
    periods = iter([0.0, 0.0, 60.0])
    with BackgroundThread("t-deadline", work, period_s=lambda: next(periods)):
        assert work.wait_for(2)
        time.sleep(0.05)
        assert work.calls == 2  # then a long wait


def test_an_error_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls = Counter()

    def flaky() -> None:
        calls()
        if calls.calls <= 2:
            raise ValueError(f"boom {calls.calls}")

    log = logging.getLogger("test.background")
    with (
        caplog.at_level(logging.DEBUG, logger="test.background"),
        BackgroundThread("t-flaky", flaky, period_s=0.005, logger=log, what="flaky work"),
    ):
        assert calls.wait_for(4)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    # Two distinct errors: each logged with its traceback.
    assert [r.getMessage() for r in errors] == ["flaky work failed", "flaky work failed"]
    assert all(r.exc_info is not None for r in errors)
    assert "boom 1" in str(errors[0].exc_info[1]) and "boom 2" in str(errors[1].exc_info[1])


def test_the_same_error_in_a_row_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    calls = Counter()
    failing = threading.Event()
    failing.set()

    def broken() -> None:
        calls()
        if failing.is_set():
            raise ConnectionError("down")

    log = logging.getLogger("test.background")
    with (
        caplog.at_level(logging.DEBUG, logger="test.background"),
        BackgroundThread("t-burst", broken, period_s=0.002, logger=log, what="probe"),
    ):
        assert calls.wait_for(10)
        failing.clear()
        seen = calls.calls
        assert calls.wait_for(seen + 2)
        failing.set()
        seen = calls.calls
        assert calls.wait_for(seen + 2)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2  # one per burst, not one per failure
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.DEBUG, "probe failed again") in said
    assert any(level == logging.INFO and text.startswith("probe works again") for level, text in said)


def test_expected_errors_go_to_their_handler_not_the_log(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Exception] = []
    calls = Counter()

    def down() -> None:
        calls()
        raise TimeoutError("no answer")

    log = logging.getLogger("test.background")
    with (
        caplog.at_level(logging.DEBUG, logger="test.background"),
        BackgroundThread("t-expected", down, period_s=0.002, expected=(TimeoutError,),
                         on_expected=seen.append, logger=log),
    ):  # fmt: skip
        assert calls.wait_for(3)
    assert len(seen) >= 3 and all(isinstance(e, TimeoutError) for e in seen)
    assert caplog.records == []


def test_after_an_error_the_loop_rests() -> None:
    calls = Counter()

    def failing() -> None:
        calls()
        raise RuntimeError("x")

    with BackgroundThread("t-rest", failing, period_s=0, after_error_s=60,
                          logger=logging.getLogger("test.background")) as worker:  # fmt: skip
        assert calls.wait_for(1)
        time.sleep(0.05)
        assert calls.calls == 1
        started = time.monotonic()
    assert time.monotonic() - started < 1.0  # the rest ends at stop
    assert not worker.running


def test_stop_returns_within_its_bound_when_the_work_blocks() -> None:
    release = threading.Event()
    entered = threading.Event()

    def stuck() -> None:
        entered.set()
        release.wait(30)

    worker = BackgroundThread("t-stuck", stuck, period_s=0, join_s=0.1).start()
    try:
        assert entered.wait(WAIT_S)
        started = time.monotonic()
        assert worker.stop() is False  # still in the work
        assert time.monotonic() - started < 1.0
        assert worker.running
        started = time.monotonic()
        assert worker.stop(timeout_s=0.05) is False  # an explicit bound, again
        assert time.monotonic() - started < 1.0
    finally:
        release.set()
    assert worker.stop(timeout_s=WAIT_S) is True
    assert not worker.running


def test_interrupt_unblocks_work_that_waits_by_itself() -> None:
    import queue

    items: queue.Queue[int | None] = queue.Queue()
    got: list[int] = []

    def take() -> object:
        item = items.get()
        if item is None:
            return STOP
        got.append(item)
        return None

    worker = BackgroundThread("t-queue", take, period_s=0, interrupt=lambda: items.put(None)).start()
    items.put(1)
    items.put(2)
    deadline = time.monotonic() + WAIT_S
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
    started = time.monotonic()
    assert worker.stop() is True
    assert time.monotonic() - started < 1.0
    assert got == [1, 2]


def test_returning_stop_ends_the_loop_and_runs_final() -> None:
    order: list[str] = []

    def once() -> object:
        order.append("work")
        return STOP

    worker = BackgroundThread("t-once", once, period_s=0, final=lambda: order.append("final")).start()
    deadline = time.monotonic() + WAIT_S
    while worker.running and time.monotonic() < deadline:
        time.sleep(0.002)
    assert order == ["work", "final"]
    assert worker.close()


def test_final_runs_once_at_stop_after_the_last_work() -> None:
    order: list[str] = []
    worker = BackgroundThread("t-final", lambda: order.append("work"), period_s=60,
                              final=lambda: order.append("final")).start()  # fmt: skip
    worker.wake()
    deadline = time.monotonic() + WAIT_S
    while not order and time.monotonic() < deadline:
        time.sleep(0.002)
    assert worker.close()
    assert order == ["work", "final"]  # the stop itself does not run the work
    assert worker.close()  # idempotent: nothing runs again
    assert order == ["work", "final"]


def test_close_is_idempotent_and_start_after_close_does_nothing() -> None:
    work = Counter()
    worker = BackgroundThread("t-closed", work, period_s=0.001).start()
    assert work.wait_for(1)
    assert worker.close() and worker.close()
    assert worker.stopping
    calls = work.calls
    worker.start()
    time.sleep(0.05)
    assert work.calls == calls and not worker.running


def test_start_twice_starts_one_thread() -> None:
    worker = BackgroundThread("t-twice", lambda: None, period_s=60)
    worker.start()
    worker.start()
    try:
        assert sum(t.name == "t-twice" for t in threading.enumerate()) == 1
    finally:
        worker.close()


def test_wait_is_cut_short_by_stop() -> None:
    waited = threading.Event()
    results: list[bool] = []

    def sleeper() -> None:
        waited.set()
        results.append(worker.wait(60))

    worker = BackgroundThread("t-wait", sleeper, period_s=0)
    worker.start()
    assert waited.wait(WAIT_S)
    started = time.monotonic()
    assert worker.close()
    assert time.monotonic() - started < 1.0
    assert results[-1] is True


def test_the_work_may_stop_its_own_thread() -> None:
    done = threading.Event()

    def stop_self() -> None:
        worker.stop()  # no join of itself
        done.set()

    worker = BackgroundThread("t-self", stop_self, period_s=0)
    worker.start()
    assert done.wait(WAIT_S)
    assert worker.stop(timeout_s=WAIT_S)
