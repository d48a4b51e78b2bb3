"""Operator actions and console data, shared by the JSON API and the Admin tab."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from admin.console import stats
from admin.hard_examples.service import HardExampleAdmin
from admin.trust.service import shadow_report
from engine.errors import CacheUnavailableError, InvalidInputError, ModelLoadError
from engine.fleet.member import FleetAck, FleetMember
from engine.lifecycle.cleanup import Cleanup
from engine.lifecycle.reload import ModelLifecycle, ReloadBusyError
from engine.lifecycle.warmup import WarmSet
from engine.models.base import model_state
from engine.pipeline.service import InferenceEngine, RequestRecord
from engine.quality.hard_examples import HardExamples
from storage.log_writer import RequestLogWriter
from storage.sql import recent_audit, record_audit

log = logging.getLogger(__name__)

WINDOWS_S = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0, "7d": 7 * 86400.0}
MAX_NOTE_CHARS = 500


def record_to_row(record: RequestRecord) -> dict[str, Any]:
    return record._asdict()


class LogUnavailableError(Exception):
    """The request-log database cannot be read (down, restarting, locked too long)."""


class FleetUnavailableError(Exception):
    """The replica registry cannot be read (Redis down)."""


class AdminService:
    def __init__(
        self,
        *,
        engine: InferenceEngine,
        db: Engine,
        writer: RequestLogWriter,
        clock: Callable[[], float] = time.time,
        fleet: FleetMember | None = None,
        replica_id: str | None = None,
        lifecycle: ModelLifecycle | None = None,
        cleanup: Cleanup | None = None,
        warm_set: WarmSet | None = None,
        hard_examples: HardExamples | None = None,
    ) -> None:
        # Hard examples to label and export (admin.hard_examples.service); its calls say when it is off.
        self.hard_examples = HardExampleAdmin(collector=hard_examples, engine=engine, audit=self._audit,
                                              clock=clock)  # fmt: skip
        self._warm_set = warm_set  # warm-up after a swap or a bump (engine.lifecycle.warmup); None: off
        self._cleanup = cleanup  # old versions in L2 (engine.lifecycle.cleanup)
        self._lifecycle = lifecycle  # live model reloads (engine.lifecycle.reload)
        self._replica_id = replica_id  # names this replica in the audit log
        self._engine = engine
        self._fleet = fleet  # None without a shared Redis: this replica is the whole fleet
        self._db = db
        self._writer = writer
        self._clock = clock

    # ---- actions (each audited) --------------------------------------------

    def flush(self, tier: str, *, actor: str) -> dict[str, Any]:
        if tier not in ("l1", "l2", "all"):
            raise InvalidInputError("bad_tier", "tier must be one of 'l1', 'l2', 'all'")
        result = asdict(self._engine.flush(tier))
        # Then every other replica's L1 (and its L2 writes still waiting), acknowledged.
        result["fleet"] = self._fleet_ack(lambda fleet: fleet.broadcast_l1({"op": "flush", "tier": tier}))
        self._audit("flush", {"tier": tier}, result, actor)
        return result

    def _fleet_ack(self, reach: Callable[[FleetMember], FleetAck]) -> dict[str, Any]:
        if self._fleet is None:
            return FleetAck(confirmed=(self._replica_id or "this replica",)).as_dict()
        ack = reach(self._fleet)
        if not ack.complete or ack.lost:
            log.warning("fleet action not confirmed everywhere: %s", ack.as_dict())
        return ack.as_dict()

    def replicas(self) -> list[dict[str, Any]]:
        """The replica registry (engine.fleet.member): every replica sharing this Redis."""
        if self._fleet is None:
            return [{"id": self._replica_id, "state": "live", "self": True,
                     "generation": self._engine.generation, **self._engine.replica_state()}]  # fmt: skip
        try:
            return self._fleet.replicas()
        except CacheUnavailableError as exc:
            raise FleetUnavailableError(f"the replica registry is unreachable: {exc}") from None

    def bump_version(self, *, actor: str, note: str | None = None) -> dict[str, Any]:
        note = (note or "").strip()[:MAX_NOTE_CHARS]
        before = self._engine.generation
        try:
            after = self._engine.bump_generation()
            result: dict[str, Any] = {"ok": True, "generation_before": before, "generation": after}
            result["fleet"] = self._fleet_ack(lambda fleet: fleet.announce_generation(after))
        except CacheUnavailableError as exc:
            result = {"ok": False, "generation": before, "error": f"Redis unavailable: {exc}"}
        self._audit("bump_version", {"note": note} if note else {}, result, actor)
        return result

    def reload_model(self, task: str, *, actor: str, note: str | None = None) -> dict[str, Any]:
        """Load `task`'s model again from its source and swap it in here and on every replica
        (engine.lifecycle.reload). Audited, failures too; raises InvalidInputError (unknown task),
        ReloadBusyError or ModelLoadError (the old model keeps serving)."""
        note = (note or "").strip()[:MAX_NOTE_CHARS]
        params = {"task": task, **({"note": note} if note else {})}
        if self._lifecycle is None:
            raise ModelLoadError("model reloads are not available in this process")
        try:
            result = self._lifecycle.reload_fleet(task, note=note).as_dict()
        except (InvalidInputError, ReloadBusyError, ModelLoadError) as exc:
            self._audit("reload_model", params, {"ok": False, "error": str(exc)}, actor)
            raise
        if self._fleet is None:
            result["fleet"] = FleetAck(confirmed=(self._replica_id or "this replica",)).as_dict()
        self._audit("reload_model", params, result, actor)
        return result

    def l2_versions(self) -> dict[str, Any]:
        """L2 entries per (task, model version, generation), estimated from a sample."""
        if self._cleanup is None:
            raise InvalidInputError("no_l2", "L2 is disabled: there is nothing to count.")
        try:
            return self._cleanup.census()
        except CacheUnavailableError as exc:
            raise InvalidInputError("l2_unavailable", f"Redis did not answer: {exc}") from None

    def start_cleanup(self, *, dry_run: bool, actor: str) -> dict[str, Any]:
        """Count (dry run) or delete, in the background, the L2 entries of model versions not
        served now and of older generations. A deletion is audited."""
        if self._cleanup is None:
            raise InvalidInputError("no_l2", "L2 is disabled: there is nothing to clean up.")
        progress = self._cleanup.start(dry_run=dry_run)
        if not dry_run:
            self._audit("cleanup_l2", {"dry_run": False}, {"ok": True, "started_at": progress["started_at"]},
                        actor)  # fmt: skip
        return progress

    def cleanup_progress(self) -> dict[str, Any] | None:
        return self._cleanup.progress() if self._cleanup is not None else None

    def warmup_progress(self) -> dict[str, Any]:
        """The last warm-up (inputs total/done/failed, running) and the warm set's bounds;
        `enabled` false when WARM_SET_SIZE is 0 or L2 is off."""
        if self._warm_set is None:
            return {"enabled": False, "running": False}
        return {"enabled": True, **self._warm_set.progress()}

    def inspect(self, task: str, raw: Any) -> dict[str, Any]:
        """One entry as each tier holds it (engine.cache.entries); changes nothing, not audited."""
        return asdict(self._engine.inspect(task, raw))

    def evict(self, task: str, raw: Any, *, actor: str) -> dict[str, Any]:
        """Remove the entry `raw` has now from L2 and L1 (engine.evict), with an audit row."""
        key = self._engine.entry_key(task, raw)
        result = asdict(self._engine.evict(key))
        # engine.evict tells the fleet without waiting (shadow verification calls it too); the
        # operator's answer waits for every live replica to confirm its L1 copy is gone.
        result["fleet"] = self._fleet_ack(lambda fleet: fleet.broadcast_l1({"op": "evict", "keys": [key]}))
        self._audit("evict", {"task": task, "key": key}, result, actor)
        return result

    def tasks(self) -> list[str]:
        return list(self._engine.models)

    def cache_state_models(self) -> dict[str, dict[str, Any]]:
        """Per task: the model's name, version, device and backend (no Redis call)."""
        return {t: model_state(m) for t, m in self._engine.models.items()}

    def shadow_report(self) -> dict[str, Any]:
        return shadow_report(self._engine)

    def _audit(self, action: str, params: dict[str, Any], result: dict[str, Any], actor: str) -> None:
        log.info("admin %s %s by %s -> %s", action, params, actor, result)
        try:
            record_audit(self._db, at=self._clock(), action=action, params=params, result=result, actor=actor,
                         replica=self._replica_id)  # fmt: skip
        except Exception:  # the action happened; a failed audit write must be visible, not fatal
            log.exception("could not write the audit row for %s", action)

    # ---- reads --------------------------------------------------------------

    def window_s(self, window: str | float | None) -> float:
        if window is None:
            return WINDOWS_S["1h"]
        if isinstance(window, str):
            if window in WINDOWS_S:
                return WINDOWS_S[window]
            try:
                window = float(window)
            except ValueError:
                raise InvalidInputError(
                    "bad_window", f"window must be one of {', '.join(WINDOWS_S)} or seconds"
                ) from None
        if not 1 <= window <= 90 * 86400:
            raise InvalidInputError("bad_window", "window must be between 1 second and 90 days")
        return float(window)

    def stats(self, window: str | float | None = None) -> dict[str, Any]:
        """Everything the console shows, as JSON-ready data."""
        self._writer.flush(timeout_s=1.0)  # show what has just happened
        window_s = self.window_s(window)
        now = self._clock()
        try:
            reads = {
                "summary": stats.as_plain(stats.summary(self._db, now=now, window_s=window_s)),
                "per_minute": [
                    {**stats.as_plain(b), "hit_rate": b.hit_rate}
                    for b in stats.per_minute(self._db, now=now, window_s=window_s)
                ],
                "latency": stats.as_plain(stats.latency_histogram(self._db, now=now, window_s=window_s)),
                "hot_keys": stats.as_plain(stats.hot_keys(self._db, now=now, window_s=window_s)),
            }
        except SQLAlchemyError as exc:  # the database is telemetry: say so, no traceback
            log.warning("console: the request log cannot be read: %s", exc.__class__.__name__)
            raise LogUnavailableError(
                f"the request log database is unavailable ({exc.__class__.__name__}); requests are "
                "still served and their rows queued; try again shortly"
            ) from None
        return {
            "window_s": window_s,
            **reads,
            "cache": self.cache_state(),
            "counters": asdict(self._engine.counters()),
            "log_writer": asdict(self._writer.stats()),
        }

    def cache_state(self) -> dict[str, Any]:
        state = self._engine.cache_state()
        store = self._engine.l2_store()
        if store is not None:
            try:
                state["l2"]["memory_bytes"] = store.memory_used_bytes()
                counts = store.key_counts()  # per primary: a cluster's nodes each, None if down
                known = [n for n in counts.values() if n is not None]
                state["l2"]["keys"] = sum(known) if known else None
            except CacheUnavailableError:
                counts = {}
                state["l2"]["memory_bytes"] = state["l2"]["keys"] = None
            breakers = dict(store.stats().nodes)
            state["l2"]["nodes"] = [
                {"node": node, "keys": keys, "breaker": breakers.get(node)}
                for node, keys in sorted(counts.items())
            ]
        return state

    def audit_rows(self, limit: int = 50) -> list[dict[str, Any]]:
        return [
            {"at": row.at, "action": row.action, "params": row.params, "result": row.result,
             "actor": row.actor, "replica": row.replica}
            for row in recent_audit(self._db, limit=limit)
        ]  # fmt: skip
