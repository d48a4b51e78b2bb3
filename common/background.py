"""One owned background thread: a name, a period or a wake-up, a stop, errors that never kill it.

    worker = BackgroundThread("key-sampler", sampler.drain, period_s=5.0, logger=log)
    worker.start()  # nothing runs before the owner asks
    ...
    worker.close()  # bounded join; idempotent

The loop: wait (`period_s`, cut short by `wake()` or `stop()`), then `work()`, until stopped;
then `final()` once (a last flush). `period_s` is seconds between runs, a callable giving the
next wait (a deadline of the owner's), `None` to run only when woken, or `0` for work that blocks
by itself (on a queue or a condition: `interrupt` unblocks it at stop). `work` may return `STOP`
to end the loop (a one-shot job, a closed queue).

An exception of `work` or `final` is logged and the loop goes on: `expected` types go to
`on_expected` (silent by default: e.g. a store that is down, which its breaker reports), any other
is logged with its traceback once per burst (the same error again in a row is logged at debug
level, and the recovery once it ends), so that a loop failing every period does not flood the log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

STOP = object()  # returned by `work`: the loop ends (then `final` runs)

Period = float | Callable[[], float] | None


class BackgroundThread:
    """A daemon thread owned by one object: `start()`, `wake()`, `stop()` / `close()`."""

    def __init__(
        self,
        name: str,
        work: Callable[[], Any],
        *,
        period_s: Period = None,
        final: Callable[[], Any] | None = None,
        interrupt: Callable[[], Any] | None = None,
        join_s: float = 5.0,
        expected: tuple[type[Exception], ...] = (),
        on_expected: Callable[[Exception], Any] | None = None,
        after_error_s: float = 0.0,
        logger: logging.Logger | None = None,
        what: str | None = None,
    ) -> None:
        self.name = name
        self._work = work
        self._period_s = period_s
        self._final = final
        self._interrupt = interrupt
        self.join_s = join_s
        self._expected = expected
        self._on_expected = on_expected
        self._after_error_s = after_error_s
        self._log = logger or logging.getLogger(__name__)
        self._what = what or name
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_error: tuple[type[BaseException], str] | None = None
        self._repeats = 0

    # ---- the owner's side ----------------------------------------------------

    def start(self) -> BackgroundThread:
        """Start the thread; idempotent, and a no-op once stopped."""
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return self

    def wake(self) -> None:
        """Run the work now rather than at the end of the period."""
        self._wake.set()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop the loop and wait up to `timeout_s` (default `join_s`) for the thread to end.
        Idempotent; True when no thread is left running."""
        with self._lock:
            first = not self._stop.is_set()
            self._stop.set()
            self._wake.set()
            thread = self._thread
        if thread is None:
            return True
        if first and self._interrupt is not None:
            try:
                self._interrupt()
            except Exception:  # the join below is bounded either way
                self._log.exception("%s: interrupting the work failed", self._what)
        if thread is not threading.current_thread() and thread.is_alive():
            thread.join(self.join_s if timeout_s is None else timeout_s)
        return not thread.is_alive()

    close = stop

    def __enter__(self) -> BackgroundThread:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.stop()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, timeout_s: float) -> bool:
        """For the work: sleep up to `timeout_s` unless stopped; True once stopping."""
        return self._stop.wait(timeout_s)

    # ---- the thread ----------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            period = self._period_s() if callable(self._period_s) else self._period_s
            self._wake.wait(period)
            self._wake.clear()
            if self._stop.is_set():
                break
            if self._call(self._work) is STOP:
                break
        if self._final is not None:
            self._call(self._final)

    def _call(self, fn: Callable[[], Any]) -> Any:
        try:
            result = fn()
        except self._expected as exc:
            if self._on_expected is not None:
                self._call_quietly(self._on_expected, exc)
            return None
        except Exception as exc:  # never kill the loop
            self._failed(exc)
            if self._after_error_s > 0:
                self._stop.wait(self._after_error_s)
            return None
        if self._last_error is not None:
            if self._repeats:
                self._log.info("%s works again (after %d more failures like the last one)", self._what,
                               self._repeats)  # fmt: skip
            self._last_error, self._repeats = None, 0
        return result

    def _failed(self, exc: Exception) -> None:
        error = (type(exc), str(exc))
        if error == self._last_error:
            self._repeats += 1
            self._log.debug("%s failed again", self._what, exc_info=True)
            return
        if self._repeats:
            self._log.info("%s: %d more failures like the last one", self._what, self._repeats)
        self._last_error, self._repeats = error, 0
        self._log.exception("%s failed", self._what)

    def _call_quietly(self, fn: Callable[[Exception], Any], exc: Exception) -> None:
        try:
            fn(exc)
        except Exception:  # a reporting hook's failure must not kill the loop either
            self._log.exception("%s: reporting an error failed", self._what)
