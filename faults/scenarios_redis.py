"""Scenarios where Redis fails: killed, paused, dropping connections, full, holding damaged values."""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter

import redis

from faults.client import metric, read_metrics
from faults.config import PREFIX, REDIS_MAXMEMORY_MB, SOCKET_TIMEOUT_S
from faults.harness import (
    Case,
    Observation,
    Run,
    alias_key,
    fmt_s,
    key_of,
    latency_ms,
    split,
    tiers,
    wait_l2_in_use,
)
from faults.mutations import (
    corruptions,
)


def redis_killed(run: Run) -> None:
    """SIGKILL the Redis under load, keep it down, start it again on the same port (empty)."""
    ctx, sizes = run.ctx, run.ctx.sizes
    pids = [app.pid for app in ctx.apps]
    errors_before = sum(metric(read_metrics(app.url), "infcache_l2_errors") for app in ctx.apps)
    with run.load(ctx.pool, [0, 1]):
        time.sleep(sizes.phase_s)
        killed_at = time.monotonic()
        ctx.redis_server.kill()
        # New inputs on each replica while Redis is down: the pool may be all in L1 by now
        # (no L2 round trip to fail), a new input's lookup must meet the dead Redis.
        for replica in (0, 1):
            run.send(ctx.probe_case(), replica)
        time.sleep(max(0.0, sizes.outage_s - (time.monotonic() - killed_at)))
        ctx.redis_server.start()
        restarted_at = time.monotonic()
        recovery = wait_l2_in_use(run, restarted_at, sizes.recovery_limit_s)
        time.sleep(sizes.phase_s)
    during = run.between(killed_at, restarted_at)
    errors = sum(metric(read_metrics(app.url), "infcache_l2_errors") for app in ctx.apps) - errors_before
    run.result.recovery_s = recovery
    run.figure("requests while Redis was down", f"{len(during)} ({tiers(during)})")
    run.figure("slowest answer while down", fmt_s(max((o.done_at - o.sent_at for o in during), default=None)))
    run.figure("L2 errors counted by the apps", int(errors))
    run.check("requests were sent while Redis was down", len(during) > 0)
    run.check("the apps noticed (L2 errors counted)", errors > 0, f"{errors:.0f}")
    run.check(
        f"L2 written and read again within {sizes.recovery_limit_s:.0f}s of the restart",
        recovery is not None,
        f"recovery {fmt_s(recovery)}",
    )
    run.check("no app restarted", [app.pid for app in ctx.apps] == pids)


def redis_paused(run: Run) -> None:
    """CLIENT PAUSE (all commands) for longer than the socket timeout. Replica B is under load;
    on replica A one client sends new messages one after the other. Every bound is judged on
    the engine's own time (`cache_info.latency_ms`), not end to end: on a busy machine HTTP and
    Gradio's queue can add a second or more that no Redis setting controls."""
    ctx, sizes = run.ctx, run.ctx.sizes
    warm, _ = split(ctx.pool, 0.5)
    run.send_many(warm, [0, 1], sizes.threads)

    def model_seconds() -> float:
        return metric(read_metrics(ctx.apps[0].url), "infcache_model_seconds", task="text")

    def timed_send() -> tuple[Observation, float]:
        """A new message to A, and its engine time outside the model: on a busy CPU the forward
        pass alone varies by hundreds of milliseconds, which is not what this scenario measures.
        A serves nobody else, so the change in its model seconds is this request's."""
        before = model_seconds()
        observation = run.send(ctx.probe_case(), 0)
        return observation, latency_ms(observation) / 1000.0 - (model_seconds() - before)

    # What a new message costs on A's engine outside the model when Redis answers (keys, L1,
    # Redis round trips, the machine's noise): the slowest of 8 before the pause and 8 after it.
    baseline = [timed_send() for _ in range(8)]
    timed: list[tuple[Observation, float]] = []
    with run.load(ctx.pool, [1]):
        time.sleep(sizes.phase_s)
        with contextlib.closing(ctx.direct) as direct:
            direct.execute_command("CLIENT", "PAUSE", str(int(sizes.pause_s * 1000)), "ALL")
        paused_at = time.monotonic()
        while time.monotonic() < paused_at + sizes.pause_s - 0.3:
            timed.append(timed_send())
        time.sleep(max(0.0, paused_at + sizes.pause_s - time.monotonic()) + sizes.phase_s)
        baseline += [timed_send() for _ in range(8)]
    base_s = max(outside for _, outside in baseline)
    # The promise: at most one socket timeout on top of what a request costs anyway.
    bound_s = SOCKET_TIMEOUT_S + base_s + 0.15
    for o, outside in timed:
        if outside > bound_s:
            run.downgrade(
                o,
                "failed",
                f"{outside:.2f}s in the engine outside the model during the pause (engine "
                f"{latency_ms(o) / 1000:.2f}s, {o.done_at - o.sent_at:.2f}s end to end): more than one "
                f"socket timeout ({SOCKET_TIMEOUT_S}s) over the {base_s:.2f}s it takes with Redis answering",
            )
    # Under load (B), requests also queue behind each other; in the engine each one must
    # still stay within one timeout plus the model (3x its reference time on a busy CPU).
    during = [o for o in run.between(paused_at, paused_at + sizes.pause_s) if o.replica == 1]
    worst_engine, worst_wall = 0.0, 0.0
    for o in during:
        engine_bound_s = SOCKET_TIMEOUT_S + 3 * o.case.expect.model_s + 1.0
        engine_s = latency_ms(o) / 1000.0
        worst_engine, worst_wall = max(worst_engine, engine_s), max(worst_wall, o.done_at - o.sent_at)
        if engine_s > engine_bound_s:
            run.downgrade(o, "failed", f"{engine_s:.2f}s in the engine during the pause")
    slow = [outside for _, outside in timed]
    over = [f"{t:.2f}s" for t in slow if t > bound_s]
    slowest_engine = max([worst_engine, *(latency_ms(o) / 1000.0 for o, _ in timed)])
    run.figure("pause", f"{sizes.pause_s:.1f}s (socket timeout {SOCKET_TIMEOUT_S}s)")
    run.figure(
        "A, one client, new messages, engine time outside the model: usual / bound",
        f"{base_s:.3f}s / {bound_s:.3f}s",
    )
    run.figure(
        "A during the pause",
        f"{len(timed)} requests, slowest {max(slow, default=0):.3f}s outside the model, "
        f"{len(over)} over the bound"
        + (f" ({', '.join(over)})" if over else "")
        + f"; slowest end to end {max((o.done_at - o.sent_at for o, _ in timed), default=0):.3f}s",
    )
    run.figure("B under load during the pause", f"{len(during)} ({tiers(during)})")
    run.figure("B slowest: engine / end to end", f"{worst_engine:.3f}s / {worst_wall:.3f}s")
    run.check("requests were sent during the pause", len(timed) > 0 and len(during) > 0)
    run.check(
        "no request waited in the engine for the pause to end",
        slowest_engine < sizes.pause_s,
        f"{slowest_engine:.2f}s",
    )
    recovery = wait_l2_in_use(run, time.monotonic(), sizes.recovery_limit_s)
    run.result.recovery_s = recovery
    run.check("L2 in use again after the pause", recovery is not None, fmt_s(recovery))


def redis_connections_dropped(run: Run) -> None:
    """CLIENT KILL every normal connection (as a proxy or a failover would), repeatedly, under load."""
    ctx, sizes = run.ctx, run.ctx.sizes
    killed = 0
    with run.load(ctx.pool, [0, 1]):
        time.sleep(sizes.phase_s / 2)
        with contextlib.closing(ctx.direct) as direct:
            for _ in range(5):
                # SKIPME yes: our own connection survives to send the next kill.
                killed += int(direct.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))
                time.sleep(sizes.phase_s / 5)
        time.sleep(sizes.phase_s / 2)
    recovery = wait_l2_in_use(run, time.monotonic(), sizes.recovery_limit_s)
    run.figure("connections killed", killed)
    run.figure("answers by tier", tiers(run.observations))
    run.check("connections were killed", killed > 0, str(killed))
    run.check("L2 in use afterwards", recovery is not None, fmt_s(recovery))


def redis_noeviction(run: Run) -> None:
    """Redis over `maxmemory` with `noeviction`: every write refused (OOM), reads still served."""
    ctx, sizes = run.ctx, run.ctx.sizes
    warm, fresh = split(ctx.pool, 0.5)
    run.send_many(warm, [0], sizes.threads)  # into L2
    with contextlib.closing(ctx.direct) as direct:
        direct.config_set("maxmemory-policy", "noeviction")
        direct.config_set("maxmemory", "1")  # far below what is used: no write fits
        try:
            direct.set(f"{PREFIX}-faults:probe", b"x")
            refused = "write accepted"
        except redis.ResponseError as exc:  # redis-py turns "-OOM ..." into OutOfMemoryError
            refused = f"{type(exc).__name__}: {exc}"
    for replica in (0, 1):
        # Reads must go to Redis. Each replica empties its own L1; telling the fleet needs a
        # Redis write, which is refused: the answer must say so (202), never pass in silence.
        answer = ctx.admin(replica, "POST", "/admin/api/flush", {"tier": "l1"}, accept=(200, 202))
        fleet = answer.get("fleet") or {}
        said = fleet.get("complete") is False and "Redis" in str(fleet.get("error"))
        run.check(f"flush on {ctx.apps[replica].name}: fleet not told, and said so", said, str(fleet))
    before = [read_metrics(app.url) for app in ctx.apps]
    started = time.monotonic()
    with run.load(warm + fresh, [0, 1]):
        time.sleep(2 * sizes.phase_s)
    during = run.between(started, time.monotonic())
    after = [read_metrics(app.url) for app in ctx.apps]
    errors = sum(
        metric(a, "infcache_l2_errors") - metric(b, "infcache_l2_errors")
        for a, b in zip(after, before, strict=True)
    )
    l2_reads = sum((o.outcome.info or {}).get("tier") == "l2" for o in during)
    computed = sum((o.outcome.info or {}).get("tier") == "miss" for o in during)
    with contextlib.closing(ctx.direct) as direct:
        direct.config_set("maxmemory", f"{REDIS_MAXMEMORY_MB}mb")
        direct.config_set("maxmemory-policy", "allkeys-lru")
    recovery = wait_l2_in_use(run, time.monotonic(), sizes.recovery_limit_s)
    run.figure("a write to the full Redis", refused)
    run.figure("answers during the fault", f"{len(during)} ({tiers(during)})")
    run.figure("write errors counted (infcache_l2_errors)", int(errors))
    run.check("Redis refused writes", refused.startswith("OutOfMemoryError"), refused)
    run.check("reads continued: answers served from L2 during the fault", l2_reads > 0, str(l2_reads))
    run.check("new inputs answered by the model", computed > 0, str(computed))
    run.check("write errors counted", errors > 0, f"{errors:.0f}")
    run.check("writes resume once memory is back", recovery is not None, fmt_s(recovery))


def corrupt_values(run: Run) -> None:
    """Damaged and foreign values written under live keys (results and raw-input aliases)."""
    ctx = run.ctx
    images = [c for c in ctx.pool if c.task == "image"]
    texts = [c for c in ctx.pool if c.task == "text"]
    per_task = max(2, ctx.sizes.corrupt_inputs // 2)
    cases = images[:per_task] + texts[:per_task]
    tripwire = ctx.work / "unpickled-tripwire"
    rng = random.Random(5)
    warmed = {o.case.id: o for o in run.send_many(cases, [0], 2)}
    planted: list[tuple[Case, str, str, str, bytes]] = []  # case, key kind, key, corruption, value
    seen: Counter[str] = Counter()
    previous: dict[str, bytes] = {}  # the last valid value of each kind of key
    with contextlib.closing(ctx.direct) as direct:
        for index, case in enumerate(cases):
            observation = warmed[case.id]
            if observation.verdict != "ok":
                continue
            generation = int(observation.outcome.info["generation"])  # type: ignore[index]
            # Only uploads have their raw-input alias in Redis (text aliases stay in process).
            kind = "alias" if case.task == "image" and index % 2 == 0 else "result"
            key = (
                key_of(observation)
                if kind == "result"
                else alias_key(case, ctx.oracle.versions[case.task], generation)
            )
            valid = direct.get(key) if key else None
            if valid is None:
                run.check(f"{case.id}: its {kind} key is in Redis", False, str(key))
                continue
            options = corruptions(valid, kind, rng, tripwire, previous.get(kind))
            previous[kind] = valid
            name, value = options[seen[kind] % len(options)]  # each kind of key cycles through its list
            seen[kind] += 1
            direct.set(key, value, ex=3600)
            planted.append((case, kind, key, name, value))
    for replica in (0, 1):
        ctx.admin(replica, "POST", "/admin/api/flush", {"tier": "l1"})
    before = [read_metrics(app.url) for app in ctx.apps]
    served: list[str] = []
    left: list[str] = []
    with contextlib.closing(ctx.direct) as direct:
        for index, (case, kind, key, name, value) in enumerate(planted):
            observation = run.send(case, index % 2)
            tier = (observation.outcome.info or {}).get("tier")
            if kind == "result" and key_of(observation) == key and tier == "l2":
                served.append(f"{case.id} ({name})")
            if observation.verdict != "ok":
                observation.reason = f"{kind} key planted with {name}: {observation.reason}"
            if direct.get(key) == value:
                left.append(f"{case.id} {kind} ({name})")
    after = [read_metrics(app.url) for app in ctx.apps]
    detected = sum(
        metric(a, "infcache_l2_corrupt_values") - metric(b, "infcache_l2_corrupt_values")
        for a, b in zip(after, before, strict=True)
    )
    by_kind = Counter(name for _, _, _, name, _ in planted)
    run.figure("values planted", f"{len(planted)} ({dict(by_kind)})")
    run.figure("detected and deleted by the apps", int(detected))
    run.figure("planted result values served as cache hits", len(served))
    # Each planted value is read once (one request per case, L1 flushed): each must be found out.
    run.check(
        "every planted value was read and found corrupt (infcache_l2_corrupt_values)",
        len(planted) > 0 and detected == len(planted),
        f"{detected:.0f} of {len(planted)}",
    )
    run.check("nothing was unpickled", not tripwire.exists())
    run.check("no planted result value was served", not served, ", ".join(served[:6]))
    run.check("no planted value left in place", not left, ", ".join(left[:6]))
