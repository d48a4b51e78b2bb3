"""What the engine hands out: results, request records, counters, and the policy it is given.

Plain values, importable without the engine (listeners, the admin floor, tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.cache.policy import CachePolicy, FlushResult  # noqa: F401 (re-exported)
from engine.models.base import Prediction


class ProbeMiss(Exception):
    """Raised in probe mode when the answer is not already cached (go to the queue)."""


@dataclass(slots=True)  # not frozen: built on every request, and frozen init is slow
class ClassifyResult:
    prediction: Prediction
    tier: str
    key: str
    model: str
    model_version: str
    generation: int
    latency_ms: float
    device: str
    age_s: float
    model_ms: float | None = None  # forward time, on the request that ran the model
    backend: str = "torch"  # what runs the forward pass: "torch" or "onnxruntime"

    def cache_info(self) -> dict[str, Any]:
        # Spelled out: dataclasses.asdict deep-copies and costs ~20x more, on every request.
        return {
            "tier": self.tier, "key": self.key, "model": self.model, "model_version": self.model_version,
            "generation": self.generation, "latency_ms": self.latency_ms, "device": self.device,
            "backend": self.backend, "age_s": self.age_s,
        }  # fmt: skip


class RequestRecord(NamedTuple):
    """What the request log and metrics see of one request. No raw input.
    A NamedTuple: built on every request, so it must be cheap."""

    at: float
    task: str
    tier: str | None  # None when the request failed before any tier answered
    latency_ms: float
    status: str  # "ok" | "invalid" | "error" | "refused" (a miss past the client's budget)
    error_code: str | None
    key_digest: str | None
    model_version: str
    generation: int
    top_label: str | None
    model_ms: float | None = None
    route: str = "gradio"  # which front door the request came through: gradio | rest
    # engine.capacity.fairness.ClientLabels' label, never the address; None: the app itself
    client: str | None = None


@dataclass
class EngineCounters:
    hits_l1: int = 0
    hits_l2: int = 0
    misses: int = 0
    coalesced: int = 0
    negative_hits: int = 0
    invalid: int = 0
    errors: int = 0
    refused: int = 0  # misses refused: the client's miss budget was spent (engine.capacity.fairness)
    corrupt_values: int = 0
    forged_values: int = 0  # L2 values whose signature is missing or wrong (signing on)
    l2_errors: int = 0
    model_calls: dict[str, int] = field(default_factory=dict)
    model_seconds: dict[str, float] = field(default_factory=dict)
    # task -> inputs per forward pass -> passes (1 for models that do not batch)
    batch_sizes: dict[str, dict[int, int]] = field(default_factory=dict)


RequestListener = Callable[[RequestRecord], None]
