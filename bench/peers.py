"""The systems the cache is measured against, and the cache itself, behind one small interface.

Around the same loaded models and the same decoding of uploaded bytes (the engine's
`canonicalize`):

- `NoCache`: decode, then the model.
- `CommonRecipe` (the "seed" of `bench.workload`): preprocess to the model's input tensor
  (image: the float tensor; text: token ids), key = MD5 of `tensor.cpu().numpy().tobytes()`,
  `functools.lru_cache(maxsize=128)`, Redis L2 with pickled values, 1-hour TTL.
- `GrCache`: `gr.cache(fn, max_size=0, max_memory=...)` around classify functions that take
  what Gradio's components hand a callback (`gr.Image(type="numpy")`: decoded pixels; a
  Textbox: the str).
- `Ours`: `InferenceEngine.classify(task, raw)` from `build_runtime` (L1 in process, L2 on
  Redis, request log and metrics listeners).

Each counts its model calls through `CountingModel` wrappers and answers (Prediction, tier).
`bench.cache` (hits by tier) and `bench.workload` (whole streams) both use these.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import secrets
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from bench.models import image_forward, tokenize
from engine.models.base import TOP_K, Prediction, top_predictions
from settings import Settings

RECIPE_LRU_SIZE = 128
RECIPE_TTL_S = 3600


class CountingModel:
    """A loaded model, shared, with this system's count of items classified (model calls)."""

    def __init__(self, model: Any) -> None:
        self.inner = model
        self._lock = threading.Lock()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, n: int) -> None:
        with self._lock:
            self.calls += n

    def predict_batch(self, inputs: Sequence[Any]) -> list[Prediction]:
        self._count(len(inputs))
        return self.inner.predict_batch(inputs)

    def predict_tensor(self, tensor: torch.Tensor) -> Prediction:
        """The image model on an already transformed image (what `predict_batch` answers)."""
        self._count(1)
        return image_top5(self.inner, tensor)


def counting(models: Mapping[str, Any]) -> dict[str, CountingModel]:
    return {task: CountingModel(model) for task, model in models.items()}


def image_top5(model: Any, tensor: torch.Tensor) -> Prediction:
    """What `predict_batch` answers, from an already transformed image."""
    logits = image_forward(model, tensor.unsqueeze(0)).float().cpu().numpy()
    return top_predictions(logits, model.categories, TOP_K)[0]


def md5_key(tensor: torch.Tensor) -> str:
    """The common recipe's key: md5 of the model input tensor's bytes."""
    return hashlib.md5(tensor.cpu().numpy().tobytes()).hexdigest()


class System(Protocol):
    name: str
    has_l2: bool

    def classify(self, task: str, raw: Any) -> tuple[Prediction, str]:
        """One request: the prediction and the tier that answered it ("l1", "l2", "miss", "coalesced")."""

    def drop_l1(self) -> None:
        """Forget the in-process tier, keep the rest (cheap: between timed samples)."""

    def restart(self) -> None:
        """What a restarted serving process has: in-process state lost, Redis kept."""

    def drop_all(self) -> None:
        """Forget every tier, so that the next request is a miss."""

    def close(self) -> None: ...


class NoCache:
    has_l2 = False

    def __init__(self, models: Mapping[str, CountingModel], name: str = "nocache") -> None:
        self.name = name
        self._models = models

    def classify(self, task: str, raw: Any) -> tuple[Prediction, str]:
        model = self._models[task]
        return model.predict_batch([model.canonicalize(raw)])[0], "miss"

    def drop_l1(self) -> None:
        pass

    def restart(self) -> None:
        pass

    def drop_all(self) -> None:
        pass

    def close(self) -> None:
        pass


class CommonRecipe:
    """preprocess -> md5(tensor bytes) -> lru_cache(128) -> Redis (pickle, 1 h TTL) -> model."""

    has_l2 = True

    def __init__(self, models: Mapping[str, CountingModel], redis_url: str, name: str = "seed") -> None:
        import redis

        self.name = name
        self._models = models
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=5)
        self._local = threading.local()  # this thread's request: its model input, then its tier
        self._cached = functools.lru_cache(maxsize=RECIPE_LRU_SIZE)(self._l2_or_model)

    def key_image(self, raw: bytes) -> tuple[str, torch.Tensor]:
        model = self._models["image"]
        tensor = model.preprocess(model.canonicalize(raw))
        return md5_key(tensor), tensor

    def key_text(self, raw: str) -> tuple[str, Any]:
        model = self._models["text"]
        canonical = model.canonicalize(raw)
        return md5_key(tokenize(model.inner, [canonical.text])["input_ids"]), canonical

    def classify(self, task: str, raw: Any) -> tuple[Prediction, str]:
        key, model_input = self.key_image(raw) if task == "image" else self.key_text(raw)
        self._local.pending = (task, model_input)
        self._local.tier = "l1"  # unless lru_cache calls through
        return self._cached(f"{task}:{key}"), self._local.tier

    def _l2_or_model(self, key: str) -> Prediction:
        blob = self._redis.get(key)
        if blob is not None:
            self._local.tier = "l2"
            return pickle.loads(blob)
        self._local.tier = "miss"
        task, model_input = self._local.pending
        if task == "image":
            prediction = self._models[task].predict_tensor(model_input)
        else:
            prediction = self._models[task].predict_batch([model_input])[0]
        self._redis.set(key, pickle.dumps(prediction), ex=RECIPE_TTL_S)
        return prediction

    def drop_l1(self) -> None:
        self._cached.cache_clear()

    def restart(self) -> None:
        self._cached = functools.lru_cache(maxsize=RECIPE_LRU_SIZE)(self._l2_or_model)

    def drop_all(self) -> None:
        self._cached.cache_clear()
        self._redis.flushdb()  # a database of a server the benchmark started: only this peer's keys

    def close(self) -> None:
        self._redis.close()


class GrCache:
    """`gr.cache` around classify functions that take what Gradio's components hand them."""

    has_l2 = False

    def __init__(
        self, models: Mapping[str, CountingModel], *, max_memory: int, name: str = "grcache"
    ) -> None:
        self.name = name
        self._models = models
        self._max_memory = max_memory
        self._local = threading.local()  # whether this thread's request ran the model
        self._retired: list[Any] = []  # gr.cache registers wrappers by id(fn): keep old fns alive
        self._fns: dict[str, Any] = {}
        self._build()

    def _build(self) -> None:
        import gradio as gr

        from engine.inputs import CanonicalImage

        image_model, text_model = self._models["image"], self._models["text"]

        def classify_image(image: np.ndarray) -> Prediction:
            self._local.computed = True
            return image_model.predict_batch([CanonicalImage(image)])[0]

        def classify_text(text: str) -> Prediction:
            self._local.computed = True
            return text_model.predict_batch([text_model.canonicalize(text)])[0]

        self._retired.append((classify_image, classify_text))
        self._fns = {
            "image": gr.cache(classify_image, max_size=0, max_memory=self._max_memory),
            "text": gr.cache(classify_text, max_size=0, max_memory=self._max_memory),
        }

    def decoded(self, task: str, raw: Any) -> Any:
        """What the Gradio component gives the callback: decoded pixels, or the str as typed."""
        return self._models["image"].canonicalize(raw).pixels if task == "image" else raw

    def classify(self, task: str, raw: Any) -> tuple[Prediction, str]:
        self._local.computed = False
        prediction = self._fns[task](self.decoded(task, raw))
        return prediction, "miss" if self._local.computed else "l1"

    def drop_l1(self) -> None:
        self.drop_all()

    def restart(self) -> None:
        self.drop_all()
        self._build()

    def drop_all(self) -> None:
        for fn in self._fns.values():
            fn.cache.clear()

    def close(self) -> None:
        self.drop_all()


class Ours:
    """The engine, built by `build_runtime` from `settings` around the given models."""

    has_l2 = True

    def __init__(self, models: Mapping[str, Any], settings: Any, name: str = "ours") -> None:
        from runtime import build_runtime

        self.name = name
        self._build = functools.partial(build_runtime, settings, models=dict(models))
        self._runtime = self._build()
        self._l2_errors = 0  # of the runtimes closed so far

    @property
    def engine(self) -> Any:
        return self._runtime.engine

    def classify(self, task: str, raw: Any) -> tuple[Prediction, str]:
        result = self._runtime.engine.classify(task, raw)
        return result.prediction, result.tier

    @property
    def l2_errors(self) -> int:
        """Redis calls that failed or timed out (the engine skipped L2 and carried on)."""
        return self._l2_errors + self._runtime.engine.counters().l2_errors

    def drop_l1(self) -> None:
        self._runtime.engine.flush("l1")

    def restart(self) -> None:
        self._l2_errors = self.l2_errors
        self._runtime.close()
        self._runtime = self._build()

    def drop_all(self) -> None:
        flushed = self._runtime.engine.flush("all")
        if flushed.l2_error:
            raise RuntimeError(f"could not flush L2: {flushed.l2_error}")

    def close(self) -> None:
        self._runtime.close()


def our_settings(redis_url: str | None, data_dir: Path, device: str) -> Any:
    """Default settings, with this Redis (None: none), data folder and device."""
    return Settings.from_env({}).changed(
        redis__url=redis_url or "off",
        server__data_dir=data_dir,
        models__device=device,
        server__admin_token=secrets.token_urlsafe(24),  # else build_runtime logs a generated one
        # Model calls here count the cache's own work (tests hold ours to one per distinct
        # input); what shadow verification's recomputations cost is bench.trust's to measure.
        quality__shadow_sample_rate=0.0,
    )
