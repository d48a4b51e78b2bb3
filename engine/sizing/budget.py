"""The CPU budget of the sizing sampler (engine.sizing.key_sampler): the sampling rate it allows."""

from __future__ import annotations

import math

# Below the budget's share, by this factor: the next window lands under it, not on it.
BUDGET_MARGIN = 0.8


class CpuBudget:
    """The highest sampling threshold (of `full`: every key) that keeps the profiles' updates
    within `share` of one core (0: no bound). Each window of `window_s` (wall clock) compares
    the CPU the updates took with the share; above it, the threshold in effect is scaled by
    share / used (an update's cost is per sampled use, so proportional to the rate), less
    `BUDGET_MARGIN`. Sampled uses dropped on a full queue halve it at once, at most once every
    `squeeze_gap_s` (the lower threshold needs that long to show in the queue): the thread is
    behind (starved of the GIL by busy request threads) whatever its CPU says. It is never
    raised: a key first sampled later would count its first reuse as a miss (fixed-size SHARDS
    never raises its threshold for the same reason).
    """

    def __init__(
        self, share: float, *, window_s: float, start: float, squeeze_gap_s: float, full: int
    ) -> None:
        self.share = share
        self._squeeze_gap_s = squeeze_gap_s
        self._squeezed_at = -math.inf
        self.threshold = full
        self._window_s = window_s
        self._start = (start, 0.0)  # the window's wall time and the CPU used before it
        self.dropped = 0  # the drops already answered

    def record(self, *, now: float, cpu_s: float, dropped: int, current: int) -> int:
        """`cpu_s`, `dropped`: totals so far; `current`: the highest threshold in effect."""
        if dropped > self.dropped:
            if now - self._squeezed_at >= self._squeeze_gap_s:
                self.threshold = max(1, min(self.threshold, current // 2))
                self._squeezed_at = now
            self.dropped = dropped
        started, cpu_before = self._start
        elapsed = now - started
        if elapsed < self._window_s:
            return self.threshold
        used = (cpu_s - cpu_before) / elapsed
        if self.share > 0 and used > self.share:
            self.threshold = max(1, min(self.threshold, int(current * self.share / used * BUDGET_MARGIN)))
        self._start = (now, cpu_s)
        return self.threshold
