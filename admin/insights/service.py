"""The operator's questions, answered for the console and the admin API: is caching worth it
here (admin.insights.verdict), how big should each tier be (admin.insights.sizing), is Redis about to fill and
how busy is the GPU (storage.redis.health, admin.monitoring.device_health), and CSV downloads."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from admin.console import exports
from admin.console.service import LogUnavailableError
from admin.insights import verdict
from admin.insights.sizing import redis_fixed_bytes, sizing_report
from admin.monitoring.device_health import NO_CUDA, DeviceMonitor, read_gpus
from engine.pipeline.service import InferenceEngine
from engine.sizing.key_sampler import OVERALL, KeySampler
from storage.log_writer import RequestLogWriter
from storage.redis.health import NodeHealth, read_health

REDIS_MEMORY_WARN = 0.70  # the design's "warn at 70 % of its limit"
EVICTING_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def redis_warnings(nodes: list[NodeHealth]) -> list[str]:
    """What an operator should act on, one sentence per problem and node."""
    out = []
    for n in nodes:
        if not n.up:
            out.append(f"{n.node}: did not answer.")
        elif not n.maxmemory:
            out.append(f"{n.node}: no maxmemory limit is set, so Redis grows until the host runs out of "
                       "memory and the allkeys-LRU defence is off (set maxmemory and "
                       "maxmemory-policy allkeys-lru).")  # fmt: skip
        else:
            fill = n.fill or 0.0
            if fill >= REDIS_MEMORY_WARN:
                out.append(f"{n.node}: {100 * fill:.0f} % of its {_mb(n.maxmemory)} limit is used "
                           f"(warning from {100 * REDIS_MEMORY_WARN:.0f} %).")  # fmt: skip
            if n.policy not in EVICTING_POLICIES:
                out.append(f"{n.node}: maxmemory-policy is {n.policy}: when full, cache writes fail "
                           "instead of evicting old entries.")  # fmt: skip
    return out


class Insights:
    """Read-only; every method may run on any thread."""

    def __init__(
        self,
        *,
        engine: InferenceEngine,
        db: Engine,
        writer: RequestLogWriter,
        window_s: Callable[[str | float | None], float],
        sampler: KeySampler | None,
        l1_max_bytes: int,
        cost_per_hour: float = 0.0,
        devices: DeviceMonitor | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine = engine
        self._db = db
        self._writer = writer
        self._window_s = window_s  # AdminService.window_s: one parser, one error message
        self._sampler = sampler
        self._l1_max_bytes = l1_max_bytes
        self._cost_per_hour = cost_per_hour
        self._devices = devices
        self._clock = clock

    @property
    def sampler(self) -> KeySampler | None:
        """The sizing curves' key sampler (None: SIZING_MAX_KEYS=0), for its cost counters."""
        return self._sampler

    def redis_nodes(self) -> list[NodeHealth] | None:
        """INFO of every primary; None without L2."""
        store = self._engine.l2_store()
        return None if store is None else read_health(store)

    def sizing(
        self, window: str | float | None = None, *, nodes: list[NodeHealth] | None = None
    ) -> dict[str, Any]:
        window_s = self._window_s(window)  # InvalidInputError first: a bad window changes nothing
        if self._sampler is None:
            return {"window_s": window_s, "tasks": {}, "overall": None, "enabled": False}
        nodes = self.redis_nodes() if nodes is None else nodes
        l2 = None
        if nodes is not None:
            up = [n for n in nodes if n.up]
            limit_set = bool(up) and all(n.maxmemory for n in up)
            current = sum((n.maxmemory if limit_set else n.used_memory) or 0 for n in up)
            # Redis's own memory, which its entries cannot use: the curve is drawn over the limit
            # (maxmemory) but evaluated at what is left of it for entries.
            per_key = self._sampler.profiles()[OVERALL].l2_bytes_per_key()
            fixed = sum(redis_fixed_bytes(n, per_key) for n in up)
            l2 = {"current_bytes": current, "limit_set": limit_set, "fixed_bytes": fixed}
        report = sizing_report(self._sampler, window_s=window_s, l1_bytes=self._l1_max_bytes, l2=l2)
        return {**report, "enabled": True}

    def worth(self, window: str | float | None = None) -> dict[str, Any]:
        window_s = self._window_s(window)
        self._writer.flush(timeout_s=1.0)
        try:
            entries = verdict.worth(self._db, now=self._clock(), window_s=window_s,
                                    cost_per_hour=self._cost_per_hour)  # fmt: skip
        except SQLAlchemyError as exc:
            name = exc.__class__.__name__
            raise LogUnavailableError(f"the request log database is unavailable ({name})") from None
        return verdict.as_dict(entries, window_s, self._cost_per_hour)

    def health(self, *, nodes: list[NodeHealth] | None = None) -> dict[str, Any]:
        nodes = self.redis_nodes() if nodes is None else nodes
        redis: dict[str, Any] = {"enabled": nodes is not None, "warn_ratio": REDIS_MEMORY_WARN}
        if nodes is not None:
            redis["nodes"] = [{**asdict(n), "fill": n.fill and round(n.fill, 4)} for n in nodes]
            redis["warnings"] = redis_warnings(nodes) or ([] if nodes else ["Redis did not answer."])
        gpus = read_gpus()
        gpu: dict[str, Any] = {"enabled": bool(gpus), "note": None if gpus else NO_CUDA,
                               "devices": [asdict(g) for g in gpus]}  # fmt: skip
        gpu["trend"] = self._devices.trend() if self._devices is not None and gpus else []
        return {"redis": redis, "gpu": gpu}

    def requests_csv(self, window: str | float | None = None) -> Iterator[str]:
        window_s = self._window_s(window)
        self._writer.flush(timeout_s=1.0)
        return exports.requests_csv(self._db, now=self._clock(), window_s=window_s)

    def audit_csv(self) -> Iterator[str]:
        return exports.audit_csv(self._db)
