"""Alert rules (deploy/prometheus/alerts.yml) checked and unit-tested by Prometheus's own
`promtool` (Debian package `prometheus`): each rule with series that fire it and series that
do not (alerts_test.yml). A missing promtool fails the suite; it is never skipped."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from tests.test_deploy import DASHBOARD, DEPLOY, checkable_prometheus_config, run, system_tool

RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
WANTED = {  # alert -> a metric its expression must watch (the issue's list)
    "CacheHitRatioLow": "infcache_requests_total", "RedisMemoryHigh": "infcache_redis_maxmemory_bytes",
    "L2BreakerOpen": "infcache_l2_breaker_state", "ShadowMismatch": "infcache_shadow_mismatches_total",
    "RequestLogRowsDropped": "infcache_log_rows_dropped_total", "ReplicaLost": "up{",
    "ModelErrorRateHigh": 'status="error"',
}  # fmt: skip


def promtool() -> str:
    return system_tool("promtool", "prometheus")


def rules() -> dict[str, dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def test_promtool_checks_the_rules() -> None:
    done = run([promtool(), "check", "rules", str(RULES)])
    assert done.returncode == 0, f"promtool refused alerts.yml:\n{done.stdout}{done.stderr}"
    assert f"{len(rules())} rules found" in done.stdout


def test_promtool_unit_tests_fire_and_stay_silent() -> None:
    done = run([promtool(), "test", "rules", str(RULE_TESTS)], cwd=RULE_TESTS.parent)
    assert done.returncode == 0, f"promtool test rules failed:\n{done.stdout}{done.stderr}"


def test_every_rule_has_a_firing_and_a_silent_unit_test() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    checks = [c for t in tests for c in t.get("alert_rule_test", [])]
    for alert in rules():
        outcomes = {bool(c["exp_alerts"]) for c in checks if c["alertname"] == alert}
        assert outcomes == {True, False}, f"{alert}: unit tests that fire and that do not: {outcomes}"


def test_the_issue_s_alerts_watch_what_they_say(tmp_path: Path) -> None:
    found = rules()
    for alert, metric in WANTED.items():
        assert metric in found[alert]["expr"], (alert, found[alert]["expr"])
    assert found["CacheHitRatioLow"]["for"] == "15m" and "0.60" in found["CacheHitRatioLow"]["expr"]
    assert "0.70" in found["RedisMemoryHigh"]["expr"]
    # A rule that can no longer fire makes its unit test fail: the tests bite.
    broken = tmp_path / "alerts.yml"
    broken.write_text(RULES.read_text().replace(") < 0.60", ") < 0.40"))
    shutil.copy(RULE_TESTS, tmp_path / "alerts_test.yml")
    done = run([promtool(), "test", "rules", "alerts_test.yml"], cwd=tmp_path)
    assert done.returncode != 0 and "CacheHitRatioLow" in done.stdout + done.stderr


def test_compose_prometheus_loads_the_rules_and_grafana_shows_the_same(tmp_path: Path) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    compose = yaml.safe_load((DEPLOY.parent / "docker-compose.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    mount = "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro"
    assert mount in compose["services"]["prometheus"]["volumes"]
    done = run([promtool(), "check", "config", str(checkable_prometheus_config(tmp_path))])
    assert done.returncode == 0 and f"{len(rules())} rules found" in done.stdout, done.stdout + done.stderr
    exprs = " ".join(t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"])
    watched = ("infcache_redis_used_memory_bytes", "infcache_redis_evicted_keys_total",
               "infcache_gpu_utilization_ratio", "infcache_shadow_mismatches_total", 'status="error"')
    for metric in watched:
        assert metric in exprs, metric
    assert re.search(r"infcache_redis_maxmemory_bytes > 0", exprs)
