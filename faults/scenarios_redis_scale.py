"""Scenarios for Redis at scale: a Sentinel failover, and a dead primary of a Redis Cluster.

Each scenario starts its own Redis set-up (`testing/redis_servers.py`) and two replicas on it
(REDIS_URL=redis+sentinel://... or redis+cluster://...), built and served the way
`python app.py` builds and serves them (`runtime.build_runtime`, the readiness gate and the
whole app, on their own ports), but inside this process with the suite's models, so that no
model is loaded again. The suite's own two app processes wait meanwhile; requests, verdicts
and the client-side balancer are the suite's.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from faults.config import REFRESH_S, SOCKET_TIMEOUT_S, TOKEN
from faults.harness import Observation, Run, alias_key, fmt_s, key_of, tiers
from storage.redis.embedded import free_port
from testing.redis_servers import LocalCluster, LocalSentinel

SHARED_AGAIN_LIMIT_S = 15.0  # the bound: L2 shared through the new primary


@dataclass
class InProcessReplica:
    """A replica served from this process: what the harness needs of an app (name, url)."""

    name: str
    url: str
    runtime: Any
    server: Any
    process: None = None
    pid: None = None

    def close(self) -> None:
        self.server.close()
        self.runtime.close()


@contextlib.contextmanager
def replicas_on(
    run: Run, redis_url: str, label: str, settings_env: dict[str, str] | None = None
) -> Iterator[list[InProcessReplica]]:
    """Two replicas on `redis_url` stand in for the suite's apps until the block ends
    (`settings_env`: settings of the scenario's own; no miss budget unless it sets one)."""
    from runtime import build_runtime
    from settings import Settings
    from ui.server import serve_runtime

    ctx = run.ctx
    built: list[InProcessReplica] = []
    original = ctx.apps
    try:
        for name in ("A", "B"):
            settings = Settings.from_env({
                "REDIS_URL": redis_url, "DATA_DIR": str(ctx.work / f"{label}-{name}"), "HOST": "127.0.0.1",
                "ADMIN_TOKEN": TOKEN, "REDIS_SOCKET_TIMEOUT_S": str(SOCKET_TIMEOUT_S),
                "GENERATION_REFRESH_S": str(REFRESH_S), **(settings_env or {}),
            })  # fmt: skip
            runtime = build_runtime(settings, models=ctx.oracle.models)
            try:
                server = serve_runtime(runtime, port=free_port())
            except BaseException:
                runtime.close()
                raise
            built.append(InProcessReplica(f"{label}-{name}", server.url, runtime, server))
        ctx.apps = built  # type: ignore[assignment]
        yield built
    finally:
        ctx.apps = original
        for replica in reversed(built):
            replica.close()


def wait_shared(run: Run, stored: Callable[[str], bool], since: float, limit_s: float, *,
                wanted: Callable[[str], bool] = lambda key: True) -> float | None:  # fmt: skip
    """Seconds after `since` until each replica writes a fresh answer that `stored(key)` sees
    and the other replica reads it from L2; None if not within `limit_s`. Probes whose key
    `wanted` refuses (say, on another cluster node) are sent but not counted."""
    pending = {(0, 1), (1, 0)}
    while pending and time.monotonic() - since < limit_s:
        for writer, reader in sorted(pending):
            probe = run.ctx.probe_case()
            key = key_of(run.send(probe, writer))
            if key is None or not wanted(key):
                continue
            try:
                here = stored(key)
            except redis.RedisError:
                here = False
            if here and (run.send(probe, reader).outcome.info or {}).get("tier") == "l2":
                pending.discard((writer, reader))
        if pending:
            time.sleep(0.1)
    return None if pending else time.monotonic() - since


def sentinel_failover(run: Run) -> None:
    """SENTINEL FAILOVER under load from two replicas on a primary + replica + Sentinel."""
    ctx, sizes = run.ctx, run.ctx.sizes
    with LocalSentinel() as sentinel, replicas_on(run, sentinel.url, "sentinel"):
        run.send_many(ctx.pool, [0, 1], sizes.threads)  # L2 holds the pool's answers
        with run.load(ctx.pool, [0, 1]):
            time.sleep(sizes.phase_s)
            for replica in (0, 1):  # the load then reads L2 while the primary changes
                ctx.admin(replica, "POST", "/admin/api/flush", {"tier": "l1"})
            asked_at = time.monotonic()
            old, new = sentinel.failover()
            switched_at = time.monotonic()
            direct = redis.Redis(host="127.0.0.1", port=new, socket_timeout=2.0)
            try:
                recovery = wait_shared(
                    run, lambda key: bool(direct.exists(key)), asked_at, SHARED_AGAIN_LIMIT_S
                )
            finally:
                direct.close()
            time.sleep(sizes.phase_s)
    during = run.between(asked_at, asked_at + (recovery or SHARED_AGAIN_LIMIT_S))
    run.result.recovery_s = recovery
    named = switched_at - asked_at
    run.figure(
        "failover", f"primary :{old} -> :{new}, named by the Sentinel {named:.2f}s after SENTINEL FAILOVER"
    )
    run.figure("requests until L2 was shared again", f"{len(during)} ({tiers(during)})")
    run.figure("slowest answer then", fmt_s(max((o.done_at - o.sent_at for o in during), default=None)))
    run.check("the Sentinel promoted the replica", old != new, f":{old} -> :{new}")
    run.check("requests were sent during the failover", len(during) > 0)
    run.check(
        f"L2 shared again through the new primary within {SHARED_AGAIN_LIMIT_S:.0f}s, no restart",
        recovery is not None,
        f"recovery {fmt_s(recovery)} after SENTINEL FAILOVER",
    )


def cluster_node_down(run: Run) -> None:
    """SIGKILL one primary of a 3-primary cluster under load: its slots fall back to the model,
    the others still answer from L2; then it comes back (empty) and is used again."""
    ctx, sizes = run.ctx, run.ctx.sizes
    with LocalCluster() as cluster, replicas_on(run, cluster.url, "cluster"):
        run.send_many(ctx.pool, [0, 1], sizes.threads)  # L2 holds the pool's answers
        for replica in (0, 1):
            ctx.admin(replica, "POST", "/admin/api/flush", {"tier": "l1"})
        owners = {key: cluster.owner(key) for o in run.observations if (key := key_of(o))}
        victim = max(cluster.ports, key=lambda port: list(owners.values()).count(port))
        for o in run.observations:  # image aliases too, while every node can answer
            if o.case.task == "image" and (info := o.outcome.info):
                alias = alias_key(o.case, info["model_version"], int(info["generation"]))
                owners[alias] = cluster.owner(alias)
        cluster.kill(victim)
        killed_at = time.monotonic()
        first = run.send_many(ctx.pool, [0, 1], sizes.threads)  # each input's first answer since
        with run.load(ctx.pool, [0, 1]):
            time.sleep(sizes.phase_s)
        restarted_at = time.monotonic()
        cluster.restart(victim)
        recovery = wait_shared(
            run, lambda key: True, time.monotonic(), sizes.recovery_limit_s,
            wanted=lambda key: cluster.owner(key) == victim,
        )  # fmt: skip
        state = ctx.admin(0, "GET", "/admin/api/stats").get("cache", {}).get("l2", {})
    during = run.between(killed_at, restarted_at)

    def keys(o: Observation) -> list[str]:
        """The keys an answer needed: its result and, for an image, its raw-bytes alias."""
        info = o.outcome.info or {}
        key = key_of(o)
        if key is None:
            return []
        return [key] + ([alias_key(o.case, info["model_version"], int(info["generation"]))]
                        if o.case.task == "image" else [])  # fmt: skip

    def owner(key: str) -> int:
        if key not in owners:  # slots never move here: any live node knows the owner
            owners[key] = cluster.owner(key)
        return owners[key]

    def tier_of(o: Observation) -> str:
        return str((o.outcome.info or {}).get("tier", o.outcome.kind))

    dead = [o for o in first if key_of(o) is not None and owner(key_of(o) or "") == victim]
    live = [o for o in first if key_of(o) is not None and all(owner(k) != victim for k in keys(o))]
    mixed = [o for o in first if o not in dead and o not in live]
    dead_tiers, live_tiers = Counter(tier_of(o) for o in dead), Counter(tier_of(o) for o in live)
    run.result.recovery_s = recovery
    run.figure("killed", f"primary :{victim}, owner of {len(dead)} of {len(first)} pool answers")
    run.figure("first answers since, result on its slots", f"{len(dead)} ({dict(dead_tiers)})")
    run.figure("first answers since, every key on a live primary", f"{len(live)} ({dict(live_tiers)})")
    run.figure("first answers since, an image whose alias alone was on it", f"{len(mixed)} ({tiers(mixed)})")
    run.figure("all requests while it was down", f"{len(during)} ({tiers(during)})")
    run.figure("slowest answer while down", fmt_s(max((o.done_at - o.sent_at for o in during), default=None)))
    run.figure("console's L2 nodes after the restart", state.get("nodes"))
    run.check("some of the pool lived on the killed primary", len(dead) > 0 and len(live) > 0)
    # "l1"/"coalesced": another variant of the same canonical input answered just before.
    run.check("its slots fell back to the model", dead_tiers["miss"] > 0 and dead_tiers["l2"] == 0,
              str(dict(dead_tiers)))  # fmt: skip
    run.check("the other primaries still answered from L2", live_tiers["l2"] > 0 and live_tiers["miss"] == 0,
              str(dict(live_tiers)))  # fmt: skip
    run.check(
        f"the restarted primary used again within {sizes.recovery_limit_s:.0f}s, no app restart",
        recovery is not None,
        f"recovery {fmt_s(recovery)}",
    )
