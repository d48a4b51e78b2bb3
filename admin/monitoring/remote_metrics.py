"""Remote models (engine.models.remote) in `/metrics`, read at scrape time, by `task`; absent
without one: `infcache_remote_up` (1 while its server is used, 0 while its misses are refused),
`infcache_remote_breaker_state` (0 closed, 1 half-open, 2 open), and the counters
`infcache_remote_calls`, `infcache_remote_rows` (inputs sent), `infcache_remote_failures` (calls
that timed out, could not connect or were refused) and `infcache_remote_refused_answers` (garbage:
a wrong shape, NaN or infinite values; never cached). The reason a remote is not used is in
`/readyz` and the console."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.pipeline.service import InferenceEngine

BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}
COUNTERS = {
    "calls": "Calls to a remote model's server",
    "rows": "Inputs sent to a remote model's server",
    "failures": "Remote calls that failed (timeout, no connection, error, invalid answer)",
    "refused_answers": "Remote answers refused as invalid (wrong shape, NaN or infinite); never cached",
}


def remote_metrics(engine: InferenceEngine) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    states = {}
    for task, model in engine.models.items():
        remote = getattr(model, "remote_state", None)
        state = remote() if callable(remote) else None
        if state is not None:
            states[task] = state
    if not states:
        return
    up = GaugeMetricFamily("infcache_remote_up", "Whether a remote model's server is used (1) or its "
                           "misses are refused (0)", labels=["task"])  # fmt: skip
    breaker = GaugeMetricFamily("infcache_remote_breaker_state", "Remote breaker: 0 closed, 1 half-open, "
                                "2 open", labels=["task"])  # fmt: skip
    counters = {name: CounterMetricFamily(f"infcache_remote_{name}", doc, labels=["task"])
                for name, doc in COUNTERS.items()}  # fmt: skip
    for task, state in states.items():
        up.add_metric([task], 1 if state["usable"] else 0)
        breaker.add_metric([task], BREAKER_VALUES.get(state["breaker"], 2))
        for name, family in counters.items():
            family.add_metric([task], state[name])
    yield up
    yield breaker
    yield from counters.values()
