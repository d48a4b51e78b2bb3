"""Scenarios of the fleet: a thundering herd, a version bump, an app killed, an app stopped."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections import Counter
from typing import Any

import httpx

from faults.client import FaultClient, Outcome, metric, read_metrics
from faults.config import PREFIX, TOKEN
from faults.harness import (
    Case,
    Observation,
    Run,
    fmt_s,
    tiers,
)
from faults.inputs import image_variants
from settings import Settings


def single_flight(run: Run) -> None:
    """200 concurrent requests for one new input: in one engine (threads), then over HTTP."""
    ctx, callers = run.ctx, run.ctx.sizes.flight_callers
    from runtime import build_runtime

    settings = Settings.from_env({}).changed(
        server__data_dir=ctx.work / "single-flight",
        redis__url=ctx.redis_server.url,
        cache__prefix=f"{PREFIX}-flight",
        server__admin_token=TOKEN,
    )
    images = image_variants(ctx.sizes.images + 4, seed=1)[-4:]  # never sent before
    fresh = [
        ctx.oracle.case("flight-image", "image", images[0][1], group="flight"),
        ctx.oracle.case("flight-text", "text", next(ctx.probes), group="flight"),
        ctx.oracle.case("flight-http-image", "image", images[1][1], group="flight-http"),
        ctx.oracle.case("flight-http-text", "text", next(ctx.probes), group="flight-http"),
    ]
    with build_runtime(settings, models=ctx.oracle.models) as runtime:
        engine = runtime.engine
        for case in fresh[:2]:
            before = engine.counters().model_calls[case.task]
            barrier = threading.Barrier(callers)
            found: list[Any] = [None] * callers

            def call(
                i: int, case: Case = case, barrier: threading.Barrier = barrier, found: list = found
            ) -> None:
                barrier.wait()
                try:
                    found[i] = engine.classify(case.task, case.raw)
                except Exception as exc:  # reported as a failed request below
                    found[i] = exc

            threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
            sent_at = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            calls = engine.counters().model_calls[case.task] - before
            took = time.monotonic() - sent_at
            for result in found:
                if isinstance(result, Exception) or result is None:
                    outcome = Outcome("failure", message=repr(result))
                else:
                    labels = result.prediction.labels
                    label = {
                        "label": result.prediction.top_label,
                        "confidences": [{"label": n, "confidence": s} for n, s in labels],
                    }
                    outcome = Outcome("answer", label=label, info=result.cache_info())
                run.record(case, -1, sent_at, outcome, 0)
            mix = tiers([o for o in run.observations if o.case is case])
            run.figure(
                f"in-process {case.task}: {callers} callers", f"{calls} model call, {mix}, {took:.1f}s"
            )
            run.check(f"in-process {case.task}: one model call", calls == 1, str(calls))
    callers = ctx.sizes.flight_http_callers
    for case in fresh[2:]:
        before = metric(read_metrics(ctx.apps[0].url), "infcache_model_calls", task=case.task)
        barrier = threading.Barrier(callers)
        started = time.monotonic()

        def http_call(case: Case = case, barrier: threading.Barrier = barrier) -> None:
            client = FaultClient(ctx.apps[0].url, timeout_s=ctx.sizes.request_timeout_s)
            try:
                barrier.wait()
                sent_at = time.monotonic()
                run.record(case, 0, sent_at, client.classify(case.task, case.raw, "flight.png"), 0)
            finally:
                client.close()

        threads = [threading.Thread(target=http_call) for _ in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        calls = metric(read_metrics(ctx.apps[0].url), "infcache_model_calls", task=case.task) - before
        mix = tiers([o for o in run.observations if o.case is case])
        run.figure(
            f"over HTTP {case.task}: {callers} callers",
            f"{calls:.0f} model call, {mix}, {time.monotonic() - started:.1f}s",
        )
        run.check(f"over HTTP {case.task}: one model call", calls == 1, f"{calls:.0f}")


def version_bump(run: Run) -> None:
    """Bump the cache generation through A's admin API while A and B both serve traffic. Right
    after each acknowledgement a new message goes to B, the replica that was not asked: its
    answer must already carry the new generation."""
    ctx, sizes = run.ctx, run.ctx.sizes
    acks: list[tuple[float, int, float]] = []  # (acknowledged at, generation, seconds the call took)
    at_once: list[tuple[int, Any]] = []  # (acknowledged generation, B's on a request sent at once)
    with run.load(ctx.pool, [0, 1]):
        for _ in range(sizes.bumps):
            time.sleep(sizes.phase_s)
            asked = time.monotonic()
            answer = ctx.admin(0, "POST", "/admin/api/bump-version", {"note": "faults suite"})
            acked = time.monotonic()
            run.check(f"bump to {answer.get('generation')} acknowledged", bool(answer.get("ok")), str(answer))
            acks.append((acked, int(answer["generation"]), acked - asked))
            on_b = run.send(ctx.probe_case(), 1)
            at_once.append((int(answer["generation"]), (on_b.outcome.info or {}).get("generation")))
        time.sleep(sizes.phase_s)
    stale = 0
    for o in run.observations:
        floor = max((g for at, g, _ in acks if at <= o.sent_at), default=None)
        generation = (o.outcome.info or {}).get("generation")
        if floor is not None and o.outcome.kind == "answer" and (generation is None or generation < floor):
            stale += 1
            run.downgrade(
                o,
                "wrong",
                f"generation {generation} in a request sent after generation {floor} "
                f"was acknowledged (replica {ctx.apps[o.replica].name})",
            )
    after = [o for o in run.observations if acks and o.sent_at >= acks[0][0]]
    generations = [httpx.get(app.url + "/readyz", timeout=5).json()["generation"] for app in ctx.apps]
    run.figure("bumps", ", ".join(f"-> {g} in {took:.2f}s" for _, g, took in acks))
    run.figure("answers after the first acknowledgement", f"{len(after)} on A and B")
    run.figure("answers with an older generation after an acknowledgement", stale)
    run.check("both replicas on the last generation", generations == [acks[-1][1]] * 2, str(generations))
    run.check(
        "B answers the first request after each acknowledgement under the new generation",
        bool(at_once) and all(got == acked for acked, got in at_once),
        ", ".join(f"acknowledged {acked}, B answered {got}" for acked, got in at_once),
    )


def app_killed(run: Run) -> None:
    """SIGKILL app A under load; B takes the traffic; A restarts and answers from L2."""
    ctx, sizes = run.ctx, run.ctx.sizes
    warm = ctx.pool
    run.send_many(warm, [0, 1], sizes.threads)  # every input now in L2
    a = ctx.apps[0]
    with run.load(warm, [0, 1], threads=max(2, sizes.threads // 2)):
        time.sleep(sizes.phase_s)
        killed_at = time.monotonic()
        a.kill()
        a.start()
        a.wait_ready()
        ready_at = time.monotonic()
        time.sleep(sizes.phase_s)
    # Only inputs already in L2 were sent, so the new process must never have run its model.
    first_from_new: dict[str, Observation] = {}
    for o in sorted(run.observations, key=lambda o: o.done_at):
        # After the kill, whatever A answered was answered by the new process.
        answered = o.outcome.kind != "unreachable"
        if o.replica == 0 and o.sent_at >= killed_at and answered and o.case.id not in first_from_new:
            first_from_new[o.case.id] = o
    for case in warm:
        if case.id not in first_from_new:
            first_from_new[case.id] = run.send(case, 0)
    new_tiers = Counter((o.outcome.info or {}).get("tier", o.outcome.kind) for o in first_from_new.values())
    model_calls = metric(read_metrics(a.url), "infcache_model_calls")
    run.result.recovery_s = ready_at - killed_at
    down = run.between(killed_at, ready_at)
    run.figure("replacement ready after", fmt_s(ready_at - killed_at))
    run.figure("requests while A was down", f"{len(down)}, {sum(o.retries > 0 for o in down)} retried on B")
    run.figure("first answer of each input from the new A", dict(new_tiers))
    run.figure("model calls in the new A", int(model_calls))
    run.check(
        "the new process answered every input from L2 (or L1 after it)",
        set(new_tiers) <= {"l2", "l1", "coalesced"} and new_tiers["l2"] > 0,
        str(dict(new_tiers)),
    )
    run.check("the new process never ran its model", model_calls == 0, f"{model_calls:.0f}")


def graceful_stop(run: Run) -> None:
    """SIGTERM app A (a deploy) while a browser tab keeps its event stream open, under load."""
    ctx, sizes = run.ctx, run.ctx.sizes
    a = ctx.apps[0]
    wall_start = time.time()
    stop_stream = threading.Event()

    def browser_tab() -> None:  # what an open page holds: Gradio's heartbeat stream
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("GET", f"{a.url}/gradio_api/heartbeat/faults-suite-tab", timeout=None) as stream,
        ):
            for _ in stream.iter_lines():
                if stop_stream.is_set():
                    return

    tab = threading.Thread(target=browser_tab, daemon=True)
    tab.start()
    grace_s = 10.0
    with run.load(ctx.pool, [0, 1]):
        time.sleep(sizes.phase_s)
        exit_s = a.stop(grace_s=grace_s)
        time.sleep(sizes.phase_s / 2)
    stop_stream.set()
    answered_by_a = sum(1 for o in run.observations if o.replica == 0 and o.outcome.kind != "unreachable")
    with contextlib.closing(sqlite3.connect(f"file:{a.sqlite_path}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT COUNT(*) FROM request_log WHERE at >= ?", (wall_start,)).fetchone()[0]
    run.figure(
        "exit after SIGTERM",
        f"did not exit: SIGKILL after {grace_s:.0f}s" if exit_s is None else f"{exit_s:.2f}s",
    )
    run.figure("A's answers / its log rows", f"{answered_by_a} / {rows}")
    run.check(
        f"exits within {grace_s:.0f}s of SIGTERM with a client connected", exit_s is not None, fmt_s(exit_s)
    )
    run.check(
        "every answer of A has its log row", rows >= answered_by_a, f"{rows} rows, {answered_by_a} answers"
    )
    if ctx.remaining and sizes.restart_between:
        a.start()
        a.wait_ready()
