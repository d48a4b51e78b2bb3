"""Every scenario by name, and running one of them."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from faults.harness import Context, Run, ScenarioResult
from faults.scenarios_abandoned import abandoned_calls, traceback_probes
from faults.scenarios_fairness import miss_flood
from faults.scenarios_fleet import app_killed, graceful_stop, single_flight, version_bump
from faults.scenarios_fleet_ops import (
    fleet_burst,
    fleet_flush_bump,
    generation_unconfirmed,
    lease_holder_killed,
)
from faults.scenarios_hostile import collision_pair, header_stream, huge_gradio_body, shape_freeze
from faults.scenarios_input import malformed_inputs
from faults.scenarios_models import reload_under_load_scenario
from faults.scenarios_ops import admin_bruteforce, log_locked
from faults.scenarios_postgres import postgres_restarted
from faults.scenarios_redis import (
    corrupt_values,
    redis_connections_dropped,
    redis_killed,
    redis_noeviction,
    redis_paused,
)
from faults.scenarios_redis_scale import cluster_node_down, sentinel_failover
from faults.scenarios_trust import (
    forged_values,
    generation_key_evicted,
    key_rotation,
    planted_wrong_answer,
)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Callable[[Run], None]


SCENARIOS = (
    Scenario("redis_killed", "Redis killed (SIGKILL) under load, then restarted", redis_killed),
    Scenario("redis_paused", "Redis paused (CLIENT PAUSE) longer than the socket timeout", redis_paused),
    Scenario(
        "redis_connections_dropped",
        "Redis drops every client connection (CLIENT KILL)",
        redis_connections_dropped,
    ),
    Scenario("redis_noeviction", "Redis at maxmemory with noeviction: writes refused", redis_noeviction),
    Scenario("corrupt_values", "Corrupt and foreign-schema values under live keys", corrupt_values),
    Scenario("sentinel_failover", "Sentinel failover under load, two replicas", sentinel_failover),
    Scenario("cluster_node_down", "One primary of a 3-primary cluster killed under load", cluster_node_down),
    Scenario("forged_values", "L2 values not signed by the replicas' key", forged_values),
    Scenario("key_rotation", "Signing key rotated (new,old), then the old key retired", key_rotation),
    Scenario("planted_wrong_answer", "A signed wrong answer, shadow-checked", planted_wrong_answer),
    Scenario("generation_key_evicted", "The generation key evicted by Redis", generation_key_evicted),
    Scenario(
        "model_reload",
        "A model reloaded with new weights under load, two replicas",
        reload_under_load_scenario,
    ),
    Scenario("single_flight", "200 concurrent requests for one new input", single_flight),
    Scenario("version_bump", "Cache version bump while two processes serve", version_bump),
    Scenario("fleet_flush_bump", "Flushes and bumps under load, acknowledged by both", fleet_flush_bump),
    Scenario("fleet_burst", "One new input asked of both replicas at once", fleet_burst),
    Scenario("generation_unconfirmed", "Redis paused past GENERATION_CONFIRM_S", generation_unconfirmed),
    Scenario("log_locked", "SQLite request log locked by another writer", log_locked),
    Scenario("postgres_restarted", "PostgreSQL request log restarted under load", postgres_restarted),
    Scenario("malformed_inputs", "Malformed uploads and hostile texts", malformed_inputs),
    Scenario("admin_bruteforce", "Admin API brute force", admin_bruteforce),
    Scenario("shape_freeze", "REST shapes with enormous products, sent again and again", shape_freeze),
    Scenario("header_stream", "Request heads that never end, on raw connections", header_stream),
    Scenario("huge_gradio_body", "Hundreds of MB of JSON to Gradio's call and queue", huge_gradio_body),
    Scenario("collision_pair", "xxh3 collision pairs planted through Gradio and REST", collision_pair),
    Scenario("miss_flood", "One client floods both replicas with new inputs", miss_flood),
    Scenario("abandoned_calls", "Two-step calls of every kind posted and never fetched", abandoned_calls),
    Scenario("traceback_probes", "Every event of /config sent wrong values", traceback_probes),
    Scenario("lease_holder_killed", "A replica killed holding single-flight leases", lease_holder_killed),
    Scenario("app_killed", "App process killed (SIGKILL) under load, then restarted", app_killed),
    Scenario("graceful_stop", "App stopped (SIGTERM) with a browser connected", graceful_stop),
)


def run_scenario(ctx: Context, scenario: Scenario) -> ScenarioResult:
    run = Run(ctx, scenario.name, scenario.title)
    started = time.monotonic()
    try:
        ctx.reset()
        scenario.run(run)
    except Exception as exc:  # a crash of the scenario itself: reported, and the suite goes on
        where = traceback.extract_tb(exc.__traceback__)[-3:]
        trail = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(where))
        run.result.error = f"{type(exc).__name__}: {exc} (at {trail})"[:2000]
    result = run.finish()
    result.duration_s = time.monotonic() - started
    return result
