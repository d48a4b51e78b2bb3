"""Scenarios of the fleet acting as one cache: flush and bump acknowledged by every replica
under load, a burst for one new input across both replicas, a lease holder killed."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter
from typing import Any

from faults.client import metric, read_metrics
from faults.config import PREFIX
from faults.harness import Case, Observation, Run, fmt_s, tiers
from faults.inputs import image_variants

# What B's answer to a marker (in B's L1 before the action) must come from right after it.
AFTER_FLUSH = {"l1": {"l2"}, "all": {"miss"}, "l2": {"l1"}}


def _replica_ids(run: Run) -> list[str]:
    """Each app's replica id, as its registry record names it (the one marked "self")."""
    ids = []
    for index in range(len(run.ctx.apps)):
        replicas = run.ctx.admin(index, "GET", "/admin/api/replicas")["replicas"]
        ids.append(next(r["id"] for r in replicas if r.get("self")))
    return ids


def _confirmed_by_all(run: Run, what: str, answer: dict[str, Any], ids: list[str]) -> None:
    fleet = answer.get("fleet") or {}
    run.check(
        f"{what}: confirmed by both replicas, none left unconfirmed",
        bool(fleet.get("complete")) and set(ids) <= set(fleet.get("confirmed", [])),
        f"confirmed {fleet.get('confirmed')}, unconfirmed {fleet.get('unconfirmed')}, "
        f"left {fleet.get('left')}",
    )


def fleet_flush_bump(run: Run) -> None:
    """Under load on A and B: flushes of each tier and bumps, asked of A, then of B. Right after
    each acknowledgement a marker message that sat in the other replica's L1 goes to that
    replica: after a flush of L1 it must not come from its L1; after a bump it must carry the
    new generation. No replica's generation may ever go back."""
    ctx, sizes = run.ctx, run.ctx.sizes
    ids = _replica_ids(run)
    acks: list[str] = []
    seen_generations: list[list[int]] = []  # per poll, each replica's registry generation
    stop = threading.Event()

    def watch_generations() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a missed poll is only a gap in the record
                replicas = ctx.admin(0, "GET", "/admin/api/replicas")["replicas"]
                live = {r["id"]: r["generation"] for r in replicas if r["state"] == "live"}
                seen_generations.append([live.get(i, -1) for i in ids])
            stop.wait(0.05)

    watcher = threading.Thread(target=watch_generations, daemon=True)
    with run.load(ctx.pool, [0, 1]):
        watcher.start()
        time.sleep(sizes.phase_s / 2)
        for asked in (0, 1):
            other = 1 - asked
            for tier in ("l1", "all", "l2"):
                marker = ctx.probe_case()
                run.send(marker, other)
                before = run.send(marker, other)  # now in the other replica's L1
                started = time.monotonic()
                answer = ctx.admin(asked, "POST", "/admin/api/flush", {"tier": tier})
                acks.append(f"flush {tier} via {ctx.apps[asked].name} {time.monotonic() - started:.3f}s")
                _confirmed_by_all(run, f"flush {tier} via {ctx.apps[asked].name}", answer, ids)
                after = run.send(marker, other)
                got = (after.outcome.info or {}).get("tier")
                run.check(
                    f"flush {tier} via {ctx.apps[asked].name}: {ctx.apps[other].name}'s next answer "
                    f"from {'/'.join(sorted(AFTER_FLUSH[tier]))}",
                    (before.outcome.info or {}).get("tier") == "l1" and got in AFTER_FLUSH[tier],
                    f"before {(before.outcome.info or {}).get('tier')}, after {got}",
                )
            for _ in range(sizes.bumps):
                started = time.monotonic()
                answer = ctx.admin(asked, "POST", "/admin/api/bump-version", {"note": "fleet ops"})
                acks.append(f"bump via {ctx.apps[asked].name} {time.monotonic() - started:.3f}s")
                _confirmed_by_all(run, f"bump to {answer.get('generation')}", answer, ids)
                on_other = run.send(ctx.probe_case(), other)
                got = (on_other.outcome.info or {}).get("generation")
                run.check(
                    f"bump to {answer.get('generation')}: {ctx.apps[other].name} answers under it at once",
                    got == answer.get("generation"),
                    f"acknowledged {answer.get('generation')}, answered {got}",
                )
        time.sleep(sizes.phase_s / 2)
        stop.set()
        watcher.join(timeout=10)
    backwards = [
        (ids[i], earlier[i], later[i])
        for earlier, later in itertools.pairwise(seen_generations)
        for i in range(len(ids))
        if earlier[i] >= 0 and later[i] >= 0 and later[i] < earlier[i]
    ]
    run.figure("acknowledgements", ", ".join(acks))
    run.figure("registry polls of the generations", len(seen_generations))
    run.figure("answers during the actions", tiers(run.observations))
    run.check("no replica's generation ever went back", not backwards and len(seen_generations) > 3,
              str(backwards[:5]))  # fmt: skip


def _model_calls(run: Run, task: str) -> list[float]:
    return [metric(read_metrics(app.url), "infcache_model_calls", task=task) for app in run.ctx.apps]


def fleet_burst(run: Run) -> None:
    """Many concurrent requests for one new input, half to A and half to B at the same
    instant: the fleet runs the model once (one replica holds the lease, the other waits)."""
    ctx = run.ctx
    callers = max(4, ctx.sizes.flight_http_callers // 2) * 2
    fresh = [
        ctx.oracle.case("burst-image", "image", image_variants(ctx.sizes.images + 6, seed=1)[-1][1],
                        group="burst"),
        ctx.oracle.case("burst-text", "text", next(ctx.probes), group="burst"),
    ]  # fmt: skip
    for case in fresh:
        before = _model_calls(run, case.task)
        barrier = threading.Barrier(callers)
        started = time.monotonic()

        def call(index: int, case: Case = case, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            run.send(case, index % 2)  # no failover: each request stays on its replica

        threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        calls = [after - b for after, b in zip(_model_calls(run, case.task), before, strict=True)]
        mine = [o for o in run.observations if o.case is case]
        run.figure(
            f"{case.task}: {callers} callers on A and B",
            f"model calls A {calls[0]:.0f} + B {calls[1]:.0f}, {tiers(mine)}, "
            f"{time.monotonic() - started:.1f}s",
        )
        run.check(f"{case.task}: one model call in the fleet", sum(calls) == 1, f"{sum(calls):.0f}")


def _result_key(lease: bytes) -> str:
    return PREFIX + ":" + lease.decode().split(":lease:", 1)[1]


def lease_holder_killed(run: Run) -> None:
    """A takes the leases of new images and is killed (SIGKILL) before it answers; B, asked the
    same images, waits for A's leases to expire, computes them once each, and answers all."""
    ctx, sizes = run.ctx, run.ctx.sizes
    a = ctx.apps[0]
    images = image_variants(sizes.images + 16, seed=1)[-8:]  # never sent before
    cases = [ctx.oracle.case(f"held-{n}", "image", data, name=n, group="held") for n, data in images]
    b = ctx.apps[1].url
    b_calls_before = metric(read_metrics(b), "infcache_model_calls", task="image")
    results: list[Observation] = []
    direct = ctx.direct
    held: set[bytes] = set()
    killed_at = None
    try:
        threads = [
            threading.Thread(target=lambda c=case: results.append(run.send(c, 0, failover=True)), daemon=True)
            for case in cases
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not held:  # A holds a lease whose answer is not out
            for lease in direct.scan_iter(match=f"{PREFIX}:lease:*", count=500):
                if not direct.exists(_result_key(lease)):
                    held.add(lease)
            if not held:
                time.sleep(0.002)
        a.kill()
        killed_at = time.monotonic()
        # Leases whose answer never reached Redis: B must wait them out, then compute.
        orphaned = sum(not direct.exists(_result_key(lease)) for lease in held)
        later = [threading.Thread(target=lambda c=case: results.append(run.send(c, 1)), daemon=True)
                 for case in cases]  # fmt: skip
        for t in later:
            t.start()
        for t in [*threads, *later]:
            t.join(timeout=sizes.request_timeout_s * 2)
        done_at = max((o.done_at for o in results), default=killed_at)
        b_calls = metric(read_metrics(b), "infcache_model_calls", task="image") - b_calls_before
    finally:
        direct.close()
    answered_by = Counter((o.outcome.info or {}).get("tier", o.outcome.kind) for o in results)
    run.figure("leases of A's when it was killed / without their answer", f"{len(held)} / {orphaned}")
    last = fmt_s(done_at - killed_at)
    run.figure("answers", f"{len(results)}, the last {last} after the kill, {dict(answered_by)}")
    run.figure("B's model calls for these images", f"{b_calls:.0f} for {len(cases)} images")
    run.check("A was killed holding a lease whose answer it never wrote", orphaned >= 1, f"{orphaned}")
    run.check("every request answered (B after the leases expired)", len(results) == 2 * len(cases),
              f"{len(results)} of {2 * len(cases)}")  # fmt: skip
    run.check("B computed each image at most once", b_calls <= len(cases), f"{b_calls:.0f}")
    if ctx.remaining:
        a.start()
        a.wait_ready()


CONFIRM_S = 2.0  # GENERATION_CONFIRM_S given to the apps (the default)


def generation_unconfirmed(run: Run) -> None:
    """Redis paused (CLIENT PAUSE) longer than GENERATION_CONFIRM_S: once A cannot have
    confirmed the generation for that long, an answer it holds in L1 comes from elsewhere (the
    model); after the pause, L1 is served again."""
    ctx = run.ctx
    marker = ctx.probe_case()
    run.send(marker, 0)
    before = run.send(marker, 0)
    pause_s = CONFIRM_S + 1.5
    with contextlib.closing(ctx.direct) as direct:
        direct.execute_command("CLIENT", "PAUSE", int(pause_s * 1000), "ALL")
        paused_at = time.monotonic()
        time.sleep(0.3)
        early = run.send(marker, 0)  # within the bound: still from memory
        time.sleep(max(0.0, paused_at + CONFIRM_S + 0.6 - time.monotonic()))
        late = run.send(marker, 0)
        time.sleep(max(0.0, paused_at + pause_s - time.monotonic()))
    back_s = None
    while time.monotonic() - paused_at < pause_s + 10:
        if (run.send(marker, 0).outcome.info or {}).get("tier") == "l1":
            back_s = time.monotonic() - paused_at - pause_s
            break
        time.sleep(0.1)
    tier = {name: (o.outcome.info or {}).get("tier") for name, o in
            (("before", before), ("early", early), ("late", late))}  # fmt: skip
    run.figure("A's answers to a message in its L1", f"{tier}, pause {pause_s:.1f}s")
    run.figure("L1 served again after the pause", fmt_s(back_s))
    served = tier["before"] == "l1" and tier["early"] == "l1"
    run.check("from L1 before the pause and within the bound", served, str(tier))
    run.check(f"not from L1 once unconfirmed for over {CONFIRM_S:.0f}s", tier["late"] not in ("l1", None),
              str(tier))  # fmt: skip
    run.check("L1 served again after the pause", back_s is not None, fmt_s(back_s))
