"""A public demo under a flood (issues 26, 33): one client sends new inputs as fast as it can to
both replicas while the suite's ordinary load goes on.

Two in-process replicas (`replicas_on`) on the suite's Redis with a small miss budget of their
own (one bucket per client for the fleet). The flooding client is an address behind the
trusted loopback proxy (`X-Forwarded-For`), sending unique messages through REST from 8
connections, half to each replica, ignoring `Retry-After`; the ordinary load is the suite's
(Gradio's HTTP API from loopback, another client) over the pool, answered from the cache, plus
new messages of its own. The budget is work-conserving (engine.capacity.admission): the flood has the
model whenever nobody else wants it, so it is answered well beyond one budget, and while
others want it, it holds at most its fair share of the passes.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import httpx

from engine.capacity.fairness import client_id
from faults.client import metric, read_metrics
from faults.harness import Run, tiers
from faults.scenarios_redis_scale import replicas_on

FLOODER = "198.51.100.66"
CONNECTIONS = 8
RATE = 2.0  # the scenario's budget: small, so that the flood meets it within a phase
BURST = 10
SLACK = 2  # a token refilled between the last check and the end of the flood, per replica
INFER_PATH = "/v2/models/text/infer"


def _infer(http: httpx.Client, text: str) -> httpx.Response:
    body = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": [text]}]}
    return http.post(INFER_PATH, json=body)


def _kind(response: httpx.Response) -> str:
    if response.status_code == 200:
        return "accepted"
    if response.status_code == 429:
        return "refused" if response.headers.get("retry-after", "").isdigit() else "refused, no Retry-After"
    return f"status {response.status_code}"


def miss_flood(run: Run) -> None:
    """One client floods both replicas with unique messages while the ordinary load goes on."""
    ctx, sizes = run.ctx, run.ctx.sizes
    budget = {"CLIENT_MISS_RATE": str(RATE), "CLIENT_MISS_BURST": str(BURST)}
    with replicas_on(run, ctx.redis_server.url, "fairness", settings_env=budget) as replicas:
        for case in ctx.pool:  # the app's own requests (no client): the pool is cached, no budget spent
            replicas[0].runtime.engine.classify(case.task, case.raw)
        replies: Counter[str] = Counter()
        lock = threading.Lock()
        stop = threading.Event()

        def flood(index: int) -> None:
            url = replicas[index % 2].url
            with httpx.Client(base_url=url, timeout=sizes.request_timeout_s,
                              headers={"x-forwarded-for": FLOODER}) as http:  # fmt: skip
                while not stop.is_set():
                    try:
                        response = _infer(http, f"new input {uuid.uuid4().hex} where is my parcel")
                    except httpx.HTTPError:
                        kind = "transport"
                    else:
                        kind = _kind(response)
                    with lock:
                        replies[kind] += 1

        threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(CONNECTIONS)]
        new_inputs = [ctx.probe_case() for _ in range(4)]
        started = time.monotonic()
        with run.load(ctx.pool, [0, 1]):
            for thread in threads:
                thread.start()
            time.sleep(sizes.phase_s)
            own = [run.send(case, n % 2) for n, case in enumerate(new_inputs)]  # another client's misses
            time.sleep(sizes.phase_s)
            with httpx.Client(base_url=replicas[1].url, timeout=sizes.request_timeout_s,
                              headers={"x-forwarded-for": FLOODER}) as http:  # fmt: skip
                cached = _infer(http, next(c.raw for c in ctx.pool if c.task == "text"))
            stop.set()
            for thread in threads:
                thread.join(timeout=sizes.request_timeout_s * 2)
        elapsed = time.monotonic() - started
        refused_metric = sum(metric(read_metrics(r.url), "infcache_refused_misses") for r in replicas)
        shares = [r.runtime.engine.contended_share(client_id(FLOODER)) for r in replicas]

    one_budget = BURST + RATE * elapsed + SLACK * 2
    run.figure("flood replies", dict(replies))
    accepted = replies["accepted"]
    run.figure("flood accepted / one fleet budget", f"{accepted} / {one_budget:.0f} in {elapsed:.1f} s")
    run.figure("ordinary tiers", tiers(run.observations))
    inputs, fair, total = (sum(s[i] for s in shares) for i in range(3))
    run.figure("flood share of contended passes", f"{inputs:.0f} of {total:.0f} inputs, fair {fair:.1f}")
    # Work-conserving: past its budget the flood still has the model whenever nobody else wants it.
    run.check("the flood used the idle model beyond its budget", accepted > one_budget,
              f"{accepted} accepted, one budget {one_budget:.0f}")  # fmt: skip
    # + one input per replica: the pass formed as contention began may hold one more of its own.
    run.check("under contention the flood held at most its fair share + 10 %",
              inputs <= fair + 0.10 * total + len(shares),
              f"{inputs:.0f} of {total:.0f} contended inputs, fair {fair:.1f}")  # fmt: skip
    run.check("refusals counted in /metrics", refused_metric == replies["refused"],
              f"{refused_metric:.0f} counted, {replies['refused']} answered")  # fmt: skip
    odd = {k: v for k, v in replies.items() if k not in ("accepted", "refused")}
    run.check("every refusal is a 429 with Retry-After", not odd, str(odd))
    tier = (cached.json().get("parameters") or {}).get("tier") if cached.status_code == 200 else None
    run.check("a limited client's cached input is answered", tier in ("l1", "l2"),
              f"{cached.status_code} {tier}")  # fmt: skip
    run.check("another client's new inputs are answered", all(o.verdict == "ok" for o in own),
              "; ".join(f"{o.verdict} {o.reason}" for o in own if o.verdict != "ok"))  # fmt: skip
