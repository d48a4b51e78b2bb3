"""The interface every classifier follows, and the shape of its answers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

TOP_K = 5


@dataclass(frozen=True)
class Prediction:
    """Top classes, best first, with probabilities. Plain Python values only, so it
    round-trips exactly through JSON or msgpack and compares byte-identical."""

    labels: tuple[tuple[str, float], ...]

    @property
    def top_label(self) -> str:
        return self.labels[0][0]

    def as_label_value(self) -> dict[str, float]:
        """The value a `gr.Label` takes: class name -> confidence."""
        return dict(self.labels)

    def to_plain(self) -> list[list[Any]]:
        return [[name, score] for name, score in self.labels]

    @classmethod
    def from_plain(cls, value: Any) -> Prediction:
        if not isinstance(value, list | tuple) or not value:
            raise ValueError("prediction must be a non-empty list")
        labels = []
        for item in value:
            name, score = item
            if not isinstance(name, str) or not isinstance(score, float):
                raise ValueError("prediction items must be [str, float]")
            labels.append((name, score))
        return cls(tuple(labels))


def top_predictions(logits: np.ndarray, names: Sequence[str], k: int) -> list[Prediction]:
    """A softmax over each row of `logits` (inputs x classes, float32), then each row's `k` most
    probable classes, best first (ties: the class listed first). In numpy: torch's dispatch of
    these few small ops cost ~0.3 ms a miss in a serving process, whose caches the forward pass
    has just flushed."""
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    order = np.argsort(-probs, axis=1, kind="stable")[:, : min(k, probs.shape[1])]
    return [
        Prediction(tuple((names[i], float(row[i])) for i in top.tolist()))
        for top, row in zip(order, probs, strict=True)
    ]


@runtime_checkable
class Classifier(Protocol):
    """A loaded model. `version` digests everything that changes outputs."""

    task: str  # "image" or "text"
    name: str
    version: str
    device: str

    def canonicalize(self, raw: Any) -> Any:
        """Validate a raw input and return its canonical form (raises InvalidInputError)."""

    def predict_batch(self, inputs: Sequence[Any]) -> list[Prediction]:
        """Classify canonical inputs; one Prediction per input, same order."""


def model_state(model: Classifier) -> dict[str, Any]:
    """What /readyz, the console and the admin API say of a served model. `backend_reason`:
    why torch serves it (no export, the probe disagreed, a setting), or why a remote model's
    server is not used now (its misses are refused); None on onnxruntime or a remote in use.
    A remote model (engine.models.remote) adds `remote`: its status, reason and counts."""
    state = {"name": model.name, "version": model.version, "device": model.device,
             "backend": getattr(model, "backend", "torch"),
             "backend_reason": getattr(model, "backend_reason", None)}  # fmt: skip
    remote = getattr(model, "remote_state", None)
    remote_state = remote() if callable(remote) else None
    if remote_state is not None:
        state["remote"] = remote_state
    return state


def takes_image(model: object) -> bool:
    """Whether a model takes an image file (else a message): config-defined models and the
    built-ins name their `kind`; a model without one is known by its task."""
    kind = getattr(model, "kind", None)
    if isinstance(kind, str):
        return kind.startswith("image")
    return getattr(model, "task", None) == "image"
