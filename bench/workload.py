"""Workload benchmark: the cache against no cache, the common recipe and gr.cache, in one run.

Inputs (fixed seed): 2,000 distinct images derived from scikit-image's bundled
photos (crops, flips, small colour shifts; PNG and JPEG bytes, as uploads arrive)
and 2,000 distinct support messages (templated variations).

Workloads, each replayed by 4 concurrent clients:

- zipf-restart: a Zipf stream (s = 1.1) over all the inputs (a seeded
  permutation gives each input its rank), with one restart of the serving
  process at the halfway point: whatever lives in process memory is lost,
  whatever lives in Redis is kept.
- unique: every request a new input (min(requests / 5, inputs) requests): all
  misses, so the cache can only cost here.

Systems, around the same loaded models and the same decoding of uploaded bytes
(the engine's `canonicalize`):

- nocache: decode, then the model.
- seed: the common recipe: preprocess to the model's input tensor (image: the
  float tensor; text: token ids), key = MD5 of `tensor.cpu().numpy().tobytes()`,
  `functools.lru_cache(maxsize=128)`, Redis L2 with pickled values, 1-hour TTL.
- grcache: `gr.cache(fn, max_size=0, max_memory=<our L1 budget>)` around a
  classify function taking decoded pixels (what `gr.Image(type="numpy")` hands
  a callback) or the message.
- ours: `InferenceEngine.classify(task, raw)` from `build_runtime` at default
  settings (L1 in process, L2 on Redis, request log and metrics listeners).

Every system runs in its own child process (so its peak RSS is its own) with
its own fresh redis-server when it uses one (on a unix socket, as the app's
private redis-server when REDIS_URL is unset); all four are alive at once and the
stream is replayed in segments, the systems taking turns segment by segment (in
a rotating order), so that load from other processes spreads over all of them.
Restart time (and model loading) is not part of the wall time.

Measured per system and workload: wall time, throughput, p50/p95/p99 latency,
hit ratio (1 - model calls / requests), model calls, CPU per request (the
process plus its redis-server), peak RSS during the replay and its growth,
Redis memory; the ratios of ours to each peer; whether every system gave the
model's answers. The last line printed is the machine-readable summary:

    SUMMARY speedup_vs_nocache=X speedup_vs_grcache=Y speedup_vs_seed=Z unique_vs_nocache=W hit_ratio=H

`--http` adds the same Zipf stream (with a real server restart) sent through the
Gradio API of this app and of a minimal Gradio app using gr.cache, by 4 HTTP
clients. The default run (20,000 requests) writes bench/REPORT.md and
bench/workload_chart.html; `--quick` uses 4,000 and writes nothing unless asked.

    .venv/bin/python -m bench.workload [--quick] [--http] [--requests N] [--threads N]
                                       [--device auto|cpu|cuda] [--in-process]

Needs `redis-server` on PATH (the script starts and stops its own, one per
system that uses Redis, on unix sockets in temp dirs; it touches no other Redis).
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import io
import itertools
import json
import math
import multiprocessing
import os
import pickle
import platform
import re
import secrets
import shlex
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench.models import PHOTOS, SCORE_TOLERANCE, fmt_ms, format_table, host_load, photo_dir, set_threads
from storage.embedded_redis import free_port

SYSTEMS = ("nocache", "seed", "grcache", "ours")
PEERS = ("nocache", "seed", "grcache")
# Opt-in (--systems), to say where a difference comes from: `ours-l1` is ours with
# REDIS_URL=off (the Redis tier's cost, by difference); `ours-tcp` is ours with its Redis on
# loopback TCP instead of a unix socket (what the transport costs); `ours-nobatch` is ours with
# BATCH_MAX_SIZE=1 (what micro-batching gives); `nocache-twin` is a second, identical nocache
# (the run's noise floor: its ratio to nocache should be 1.00).
ATTRIBUTION_SYSTEMS = ("ours-l1", "ours-tcp", "ours-nobatch", "nocache-twin")
ALL_SYSTEMS = SYSTEMS + ATTRIBUTION_SYSTEMS
WORKLOADS = ("zipf-restart", "unique")
HTTP_SYSTEMS = ("grcache", "ours")
USES_REDIS = frozenset({"seed", "ours", "ours-tcp", "ours-nobatch"})
# Every Redis this script starts is like the app's private one (REDIS_URL unset): a unix
# socket, no TCP port; these systems get loopback TCP instead.
REDIS_OVER_TCP = frozenset({"ours-tcp"})

FULL_REQUESTS = 20_000
QUICK_REQUESTS = 4_000
IMAGES = 2_000
MESSAGES = 2_000
CLIENTS = 4
ZIPF_S = 1.1
SEED = 20_240_611
SEGMENTS = 20
UNIQUE_SHARE = 5  # the unique workload replays min(requests / 5, inputs) requests
# torch intra-op threads per process. Four clients already run up to four forward passes at
# once; torch's default (one thread per CPU each) oversubscribes the CPUs, and on a busy machine
# its threads wait on each other at every op (tenfold slowdowns measured). Same for every system.
THREADS = 1

INPUTS_VERSION = 1  # bump when the generators below change what they make

SEED_LRU_SIZE = 128
SEED_TTL_S = 3600
REDIS_MAXMEMORY_MB = 256  # the app's default for its private redis-server

IMAGE_SOURCES = (*PHOTOS, "motorcycle_left.png", "retina.jpg", "coins.png", "moon.png")
MAX_SIDE = 640  # derived images are at most this wide or high
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TARGETS = {  # summary key -> minimum
    "speedup_vs_nocache": 5.0,
    "speedup_vs_grcache": 1.2,
    "speedup_vs_seed": 1.2,
    "unique_vs_nocache": 0.95,
}
SUMMARY_KEYS = (*TARGETS, "hit_ratio")
SUMMARY_PATTERN = re.compile(
    r"^SUMMARY " + " ".join(rf"{key}=(?P<{key}>[0-9.]+|nan)" for key in SUMMARY_KEYS) + "$"
)
REPORT_PATH = Path(__file__).resolve().parent / "REPORT.md"
CHART_PATH = Path(__file__).resolve().parent / "workload_chart.html"
NOTES_MARKER = "<!-- notes: everything below this line is kept when the report is rewritten -->"

Labels = tuple[tuple[str, float], ...]
Job = tuple[str, Any]  # (task, raw input as received: PNG/JPEG bytes or a str)


# ---- inputs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageRecipe:
    source: str
    box: tuple[int, int, int, int]  # top, left, height, width of the crop
    flip: bool
    shift: tuple[int, int, int]  # added to R, G, B
    fmt: str  # "PNG" | "JPEG"
    quality: int


@functools.lru_cache(maxsize=len(IMAGE_SOURCES))
def _source_pixels(name: str) -> np.ndarray:
    from PIL import Image

    with Image.open(photo_dir() / name) as image:
        return np.asarray(image.convert("RGB"))


def _image_recipes(count: int, seed: int) -> list[ImageRecipe]:
    rng = np.random.default_rng([seed, 1])
    recipes = []
    for i in range(count):
        source = IMAGE_SOURCES[i % len(IMAGE_SOURCES)]
        height, width, _ = _source_pixels(source).shape
        crop_h, crop_w = (int(side * rng.uniform(0.55, 1.0)) for side in (height, width))
        top = int(rng.integers(0, height - crop_h + 1))
        left = int(rng.integers(0, width - crop_w + 1))
        red, green, blue = (int(v) for v in rng.integers(-12, 13, size=3))
        fmt = "PNG" if i % 2 == 0 else "JPEG"
        quality = int(rng.integers(80, 96))
        recipes.append(
            ImageRecipe(
                source,
                (top, left, crop_h, crop_w),
                bool(rng.random() < 0.5),
                (red, green, blue),
                fmt,
                quality,
            )
        )
    return recipes


def render_image(recipe: ImageRecipe) -> tuple[bytes, str]:
    """The encoded upload and a digest of its pixels before encoding."""
    from PIL import Image

    top, left, height, width = recipe.box
    pixels = _source_pixels(recipe.source)[top : top + height, left : left + width]
    if recipe.flip:
        pixels = pixels[:, ::-1]
    pixels = np.clip(pixels.astype(np.int16) + np.asarray(recipe.shift, dtype=np.int16), 0, 255)
    image = Image.fromarray(pixels.astype(np.uint8), "RGB")
    if max(image.size) > MAX_SIDE:
        image.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.BILINEAR)
    digest = hashlib.blake2b(np.ascontiguousarray(np.asarray(image)).tobytes(), digest_size=16).hexdigest()
    buffer = io.BytesIO()
    if recipe.fmt == "PNG":
        image.save(buffer, format="PNG")
    else:
        image.save(buffer, format="JPEG", quality=recipe.quality)
    return buffer.getvalue(), digest


def make_images(count: int, seed: int = SEED, *, workers: int | None = None) -> list[bytes]:
    """`count` distinct uploads (distinct bytes and distinct pixels), the same for a given seed."""
    recipes = _image_recipes(count + max(8, count // 20), seed)  # spares, in case two coincide
    workers = workers if workers is not None else min(os.cpu_count() or 1, 8)
    if workers > 1 and count >= 64:
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
            rendered = list(pool.map(render_image, recipes, chunksize=32))
    else:
        rendered = [render_image(recipe) for recipe in recipes]
    images: list[bytes] = []
    seen: set[str] = set()
    for data, digest in rendered:
        raw = hashlib.blake2b(data, digest_size=16).hexdigest()
        if digest in seen or raw in seen:
            continue
        seen.update((digest, raw))
        images.append(data)
        if len(images) == count:
            return images
    raise RuntimeError(f"only {len(images)} distinct images from {len(recipes)} recipes")


_OPENERS = ("", "Hi, ", "Hello! ", "Good morning. ", "Hey there, ", "Hi team, ", "Excuse me, ")
_CLOSERS = ("", " Thanks.", " Thank you!", " Please help.", " Regards, {name}", " Cheers, {name}")
_TEMPLATES = (
    "where is my order {order}? It was supposed to arrive on {day}.",
    "my package {order} has not arrived yet, it has been {days} days",
    "I was charged twice for order {order}",
    "can I return the {product} I bought on {day}?",
    "please cancel order {order}, I placed it by mistake",
    "the {product} arrived {damage}",
    "I forgot my password and can't log in as {email}",
    "can I talk to a real person about order {order} please?",
    "thanks for the help with the {product}, goodbye",
    "is anybody there? I have a question about my {product}",
    "my card was declined when I paid for the {product}",
    "how do I get a refund for the {product}? Order {order}",
    "tracking for {order} says in transit for {days} days",
    "the {product} stopped working after {days} days",
    "I was billed {amount} but the {product} costs less",
)
_PRODUCTS = (
    "blender",
    "kettle",
    "headphones",
    "running shoes",
    "desk lamp",
    "phone case",
    "backpack",
    "coffee grinder",
    "yoga mat",
    "toaster",
    "smart watch",
    "winter jacket",
)
_DAMAGES = ("with a cracked jar", "broken", "with a dent", "missing a part", "scratched", "soaking wet")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_NAMES = ("Ana", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jo")


def make_messages(count: int, seed: int = SEED) -> list[str]:
    """`count` support messages, distinct even after the engine's cleaning and case folding."""
    from engine.inputs import clean_text

    rng = np.random.default_rng([seed, 2])
    messages: list[str] = []
    seen: set[str] = set()
    while len(messages) < count:
        name = _NAMES[int(rng.integers(len(_NAMES)))]
        body = _TEMPLATES[len(messages) % len(_TEMPLATES)].format(
            order=f"#{int(rng.integers(10_000, 1_000_000))}",
            day=_DAYS[int(rng.integers(len(_DAYS)))],
            days=int(rng.integers(2, 30)),
            product=_PRODUCTS[int(rng.integers(len(_PRODUCTS)))],
            damage=_DAMAGES[int(rng.integers(len(_DAMAGES)))],
            email=f"{name.lower()}{int(rng.integers(1, 999))}@example.com",
            amount=f"${int(rng.integers(20, 400))}.{int(rng.integers(0, 100)):02d}",
        )
        opener = _OPENERS[int(rng.integers(len(_OPENERS)))]
        text = opener + (body[0].upper() + body[1:] if not opener or opener.endswith(". ") else body)
        text += _CLOSERS[int(rng.integers(len(_CLOSERS)))].format(name=name)
        canonical = clean_text(text, max_chars=2000).text.lower()
        if canonical not in seen:
            seen.add(canonical)
            messages.append(text)
    return messages


def make_inputs(images: int = IMAGES, messages: int = MESSAGES, seed: int = SEED) -> list[Job]:
    """Images first, then messages; the streams below refer to inputs by index."""
    return [("image", raw) for raw in make_images(images, seed)] + [
        ("text", raw) for raw in make_messages(messages, seed)
    ]


def cached_inputs(images: int, messages: int, seed: int, cache_dir: Path | None) -> tuple[list[Job], str]:
    """`make_inputs`, kept in `cache_dir` between runs (making 2,000 PNGs takes a minute or two).
    The file name digests everything that shapes the inputs, so a stale file is never read."""
    if cache_dir is None:
        return make_inputs(images, messages, seed), "made"
    import PIL
    import skimage

    shape = repr((INPUTS_VERSION, images, messages, seed, IMAGE_SOURCES, MAX_SIDE, _TEMPLATES, _OPENERS,
                  _CLOSERS, _PRODUCTS, PIL.__version__, skimage.__version__))  # fmt: skip
    path = cache_dir / f"bench-workload-inputs-{hashlib.sha256(shape.encode()).hexdigest()[:20]}.pickle"
    if path.is_file():
        try:
            return pickle.loads(path.read_bytes()), f"read from {path}"
        except (OSError, pickle.UnpicklingError, EOFError):
            pass  # a damaged file: make them again
    jobs = make_inputs(images, messages, seed)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(pickle.dumps(jobs, protocol=pickle.HIGHEST_PROTOCOL))
    partial.replace(path)
    return jobs, f"made, kept in {path}"


def zipf_stream(n_inputs: int, requests: int, s: float = ZIPF_S, seed: int = SEED) -> np.ndarray:
    """Input indices: rank k (1-based) drawn with probability proportional to k^-s over all inputs,
    ranks assigned to inputs by a seeded permutation (hot images and hot messages alike)."""
    by_rank = np.random.default_rng([seed, 3]).permutation(n_inputs)
    weights = np.arange(1, n_inputs + 1, dtype=np.float64) ** -s
    ranks = np.random.default_rng([seed, 4]).choice(n_inputs, size=requests, p=weights / weights.sum())
    return by_rank[ranks]


def unique_stream(n_inputs: int, requests: int, seed: int = SEED) -> np.ndarray:
    """Every request a new input: a seeded permutation, cut to `requests`."""
    return np.random.default_rng([seed, 5]).permutation(n_inputs)[: min(requests, n_inputs)]


def unique_requests(requests: int, n_inputs: int) -> int:
    return max(1, min(n_inputs, requests // UNIQUE_SHARE))


def make_streams(
    n_inputs: int, requests: int, zipf_s: float = ZIPF_S, seed: int = SEED
) -> dict[str, np.ndarray]:
    return {
        "zipf-restart": zipf_stream(n_inputs, requests, zipf_s, seed),
        "unique": unique_stream(n_inputs, unique_requests(requests, n_inputs), seed),
    }


# ---- the systems --------------------------------------------------------------------------


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

    def predict_batch(self, inputs: Sequence[Any]) -> list[Any]:
        self._count(len(inputs))
        return self.inner.predict_batch(inputs)

    def predict_tensor(self, tensor: Any) -> Any:
        """The image model on an already transformed image (what `predict_batch` answers)."""
        from bench.cache import image_top5

        self._count(1)
        return image_top5(self.inner, tensor)


def counting(models: Mapping[str, Any]) -> dict[str, CountingModel]:
    return {task: CountingModel(model) for task, model in models.items()}


class System(Protocol):
    name: str

    def classify(self, task: str, raw: Any) -> tuple[Any, str | None]:
        """One request: (Prediction, the tier that answered it when the system says)."""

    def restart(self) -> None:
        """What a restarted serving process has: in-process state lost, Redis kept."""

    def close(self) -> None: ...


class NoCache:
    def __init__(self, models: Mapping[str, CountingModel], name: str = "nocache") -> None:
        self.name = name
        self._models = models

    def classify(self, task: str, raw: Any) -> tuple[Any, str | None]:
        model = self._models[task]
        return model.predict_batch([model.canonicalize(raw)])[0], "miss"

    def restart(self) -> None:
        pass

    def close(self) -> None:
        pass


class SeedRecipe:
    """preprocess -> md5(tensor bytes) -> lru_cache(128) -> Redis (pickle, 1 h TTL) -> model."""

    name = "seed"

    def __init__(self, models: Mapping[str, CountingModel], redis_url: str) -> None:
        import redis

        self._models = models
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=5)
        self._pending = threading.local()  # the model input of this thread's request
        self._cached = functools.lru_cache(maxsize=SEED_LRU_SIZE)(self._l2_or_model)

    def _key_and_input(self, task: str, raw: Any) -> tuple[str, Any]:
        from bench.models import tokenize

        model = self._models[task]
        canonical = model.canonicalize(raw)
        if task == "image":
            tensor = model.preprocess(canonical)
            return hashlib.md5(tensor.cpu().numpy().tobytes()).hexdigest(), tensor
        ids = tokenize(model.inner, [canonical.text])["input_ids"]
        return hashlib.md5(ids.cpu().numpy().tobytes()).hexdigest(), canonical

    def classify(self, task: str, raw: Any) -> tuple[Any, str | None]:
        key, model_input = self._key_and_input(task, raw)
        self._pending.value = (task, model_input)
        return self._cached(f"{task}:{key}"), None

    def _l2_or_model(self, key: str) -> Any:
        blob = self._redis.get(key)
        if blob is not None:
            return pickle.loads(blob)
        task, model_input = self._pending.value
        if task == "image":
            prediction = self._models[task].predict_tensor(model_input)
        else:
            prediction = self._models[task].predict_batch([model_input])[0]
        self._redis.set(key, pickle.dumps(prediction), ex=SEED_TTL_S)
        return prediction

    def restart(self) -> None:
        self._cached = functools.lru_cache(maxsize=SEED_LRU_SIZE)(self._l2_or_model)

    def close(self) -> None:
        self._redis.close()


class GrCache:
    """`gr.cache` around classify functions that take what Gradio's components hand them."""

    name = "grcache"

    def __init__(self, models: Mapping[str, CountingModel], *, max_memory: int) -> None:
        self._models = models
        self._max_memory = max_memory
        self._retired: list[Any] = []  # gr.cache registers wrappers by id(fn): keep old fns alive
        self._fns: dict[str, Any] = {}
        self._build()

    def _build(self) -> None:
        import gradio as gr

        from engine.inputs import CanonicalImage

        image_model, text_model = self._models["image"], self._models["text"]

        def classify_image(image: np.ndarray) -> Any:
            return image_model.predict_batch([CanonicalImage(image)])[0]

        def classify_text(text: str) -> Any:
            return text_model.predict_batch([text_model.canonicalize(text)])[0]

        self._retired.append((classify_image, classify_text))
        self._fns = {
            "image": gr.cache(classify_image, max_size=0, max_memory=self._max_memory),
            "text": gr.cache(classify_text, max_size=0, max_memory=self._max_memory),
        }

    def classify(self, task: str, raw: Any) -> tuple[Any, str | None]:
        if task == "image":
            return self._fns["image"](self._models["image"].canonicalize(raw).pixels), None
        return self._fns["text"](raw), None

    def restart(self) -> None:
        for fn in self._fns.values():
            fn.cache.clear()
        self._build()

    def close(self) -> None:
        for fn in self._fns.values():
            fn.cache.clear()


def our_settings(redis_url: str | None, data_dir: Path, device: str) -> Any:
    from settings import Settings

    return replace(
        Settings.from_env({}),
        redis_url=redis_url or "off",
        data_dir=data_dir,
        device=device,
        admin_token=secrets.token_urlsafe(24),  # else build_runtime logs a generated one
    )


class Ours:
    def __init__(self, models: Mapping[str, CountingModel], settings: Any, name: str = "ours") -> None:
        from engine.runtime import build_runtime

        self.name = name
        self._build = functools.partial(build_runtime, settings, models=models)
        self._runtime = self._build()
        self._l2_errors = 0  # of the runtimes closed so far

    def classify(self, task: str, raw: Any) -> tuple[Any, str | None]:
        result = self._runtime.engine.classify(task, raw)
        return result.prediction, result.tier

    @property
    def l2_errors(self) -> int:
        """Redis calls that failed or timed out (the engine skipped L2 and carried on)."""
        return self._l2_errors + self._runtime.engine.counters().l2_errors

    def restart(self) -> None:
        self._l2_errors = self.l2_errors
        self._runtime.close()
        self._runtime = self._build()

    def close(self) -> None:
        self._runtime.close()


def build_system(
    name: str, models: Mapping[str, CountingModel], *, redis_url: str | None, data_dir: Path, device: str
) -> System:
    settings = our_settings(redis_url, data_dir, device)
    if name == "nocache":
        return NoCache(models)
    if name == "seed":
        if redis_url is None:
            raise ValueError("seed needs a Redis")
        return SeedRecipe(models, redis_url)
    if name == "grcache":
        return GrCache(models, max_memory=settings.cache_l1_max_bytes)  # the same budget as our L1
    if name == "ours":
        return Ours(models, settings)
    if name == "ours-l1":
        return Ours(models, replace(settings, redis_url="off"), name)
    if name == "ours-tcp":  # the same engine; run_workload gives it a Redis on loopback TCP
        return Ours(models, settings, name)
    if name == "ours-nobatch":
        return Ours(models, replace(settings, batch_max_size=1), name)
    if name == "nocache-twin":
        return NoCache(models, name)
    raise ValueError(f"unknown system {name!r}")


def labels_of(prediction: Any) -> Labels:
    return tuple((str(name), float(score)) for name, score in prediction.labels)


# ---- replay ---------------------------------------------------------------------------------


@dataclass
class Segment:
    latencies_ms: np.ndarray
    wall_s: float
    cpu_s: float
    tiers: Counter[str]
    errors: list[str]


def replay(
    clients: Sequence[Callable[[str, Any], tuple[Labels, str | None]]],
    jobs: Sequence[Job],
    indices: Sequence[int],
    answers: dict[int, Labels],
    disagreements: list[str],
) -> Segment:
    """Replay `indices` with one thread per client, each taking the next request when its
    last one is answered. Records latency, the answer given to every input (`answers`) and any
    input answered differently from an earlier time (`disagreements`)."""
    n = len(indices)
    latencies = np.zeros(n)
    tiers: Counter[str] = Counter()
    errors: list[str] = []
    cursor = itertools.count()  # next() on it is atomic under the GIL
    lock = threading.Lock()

    def client(classify: Callable[[str, Any], tuple[Labels, str | None]]) -> None:
        while (i := next(cursor)) < n:
            index = indices[i]
            task, raw = jobs[index]
            started = time.perf_counter_ns()
            try:
                labels, tier = classify(task, raw)
            except Exception as exc:
                with lock:
                    errors.append(f"input {index} ({task}): {exc.__class__.__name__}: {exc}")
                continue
            latencies[i] = (time.perf_counter_ns() - started) / 1e6
            with lock:
                tiers[tier or "?"] += 1
                known = answers.setdefault(index, labels)
                if known != labels and not same_answer(known, labels):
                    disagreements.append(f"input {index} ({task}) answered {labels} after {known}")

    threads = [threading.Thread(target=client, args=(c,), name=f"client-{k}") for k, c in enumerate(clients)]
    gc.collect()
    cpu_started, started = time.process_time(), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return Segment(latencies, wall, cpu, tiers, errors)


def same_answer(a: Labels, b: Labels, tolerance: float = SCORE_TOLERANCE) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and abs(x[1] - y[1]) <= tolerance for x, y in zip(a, b, strict=True)
    )


# ---- memory ---------------------------------------------------------------------------------


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM), so the next reading covers only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        found = re.search(r"VmHWM:\s+(\d+) kB", status.read())
    return int(found.group(1)) / 1024 if found else float("nan")


# ---- one system, one workload (in a child process, or in this one) --------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    system: str
    workload: str
    inputs_path: str
    data_dir: str
    redis_url: str | None
    device: str
    threads: int | None
    clients: int


class Worker:
    """Serves one system for one workload: setup, segments, a restart, finish."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        models: Mapping[str, Any] | None = None,
        jobs: Sequence[Job] | None = None,
        isolated: bool = True,
    ) -> None:
        self.spec = spec
        self._shared_models = models
        self._jobs = jobs
        self._isolated = isolated  # alone in its process: its RSS is its own
        self._system: System | None = None
        self._models: dict[str, CountingModel] = {}
        self._answers: dict[int, Labels] = {}
        self._disagreements: list[str] = []
        self._rss_start = float("nan")

    def setup(self) -> dict[str, Any]:
        spec = self.spec
        if self._jobs is None:
            self._jobs = pickle.loads(Path(spec.inputs_path).read_bytes())
        models = self._shared_models
        if models is None:
            set_threads(spec.threads)
            models = load_models(spec.device)
        self._models = counting(models)
        self._system = build_system(
            spec.system,
            self._models,
            redis_url=spec.redis_url,
            data_dir=Path(spec.data_dir),
            device=spec.device,
        )
        gc.collect()
        self._rss_start = rss_mib()
        if self._isolated:
            reset_peak_rss()
        return {"rss_start_mib": self._rss_start, "pid": os.getpid()}

    def _classify(self, task: str, raw: Any) -> tuple[Labels, str | None]:
        assert self._system is not None
        prediction, tier = self._system.classify(task, raw)
        return labels_of(prediction), tier

    def run(self, indices: Sequence[int]) -> Segment:
        assert self._jobs is not None
        clients = [self._classify] * self.spec.clients
        return replay(clients, self._jobs, indices, self._answers, self._disagreements)

    def restart(self) -> float:
        assert self._system is not None
        started = time.perf_counter()
        self._system.restart()
        gc.collect()
        return time.perf_counter() - started

    def finish(self) -> dict[str, Any]:
        if self._system is not None:
            self._system.close()
        return {
            "model_calls": sum(m.calls for m in self._models.values()),
            "l2_errors": getattr(self._system, "l2_errors", None),
            "rss_start_mib": self._rss_start if self._isolated else None,
            "rss_peak_mib": peak_rss_mib() if self._isolated else None,
            "answers": self._answers,
            "disagreements": self._disagreements,
        }


def load_models(device: str) -> dict[str, Any]:
    from bench.models import load_real_models

    image, text = load_real_models(device)
    return {"image": image, "text": text}


def _child_main(conn: Any, spec: WorkerSpec) -> None:
    """A child process: runs the Worker's methods the parent asks for, one at a time."""
    try:
        worker = Worker(spec)
        while True:
            command, args = conn.recv()
            if command == "exit":
                return
            conn.send(("ok", getattr(worker, command)(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class Handle(Protocol):
    def send(self, command: str, *args: Any) -> None: ...

    def receive(self) -> Any: ...

    def close(self) -> None: ...


class ChildHandle:
    """A Worker in its own process (spawned: a fresh interpreter, its own memory)."""

    def __init__(self, target: Callable[..., None], spec: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=target, args=(child_conn, spec), daemon=True)
        self.process.start()
        child_conn.close()

    def send(self, command: str, *args: Any) -> None:
        self._conn.send((command, args))

    def receive(self) -> Any:
        while not self._conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(
                    f"worker process {self.process.pid} died (exit code {self.process.exitcode})"
                )
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"worker process failed:\n{value}")
        return value

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.receive()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit", ()))
            except OSError:
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        self._conn.close()


class LocalHandle:
    """A Worker in this process (tests, --in-process): shares the loaded models."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._result: Any = None

    def send(self, command: str, *args: Any) -> None:
        self._result = getattr(self._worker, command)(*args)

    def receive(self) -> Any:
        result, self._result = self._result, None
        return result

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.receive()

    def close(self) -> None:
        pass


# ---- results --------------------------------------------------------------------------------------


@dataclass
class Result:
    system: str
    workload: str
    latencies_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the system's process, and its redis-server when it has one
    restart_s: float | None = None
    model_calls: int = 0
    tiers: Counter[str] = field(default_factory=Counter)
    rss_peak_mib: float | None = None
    rss_start_mib: float | None = None
    redis_mib: float | None = None
    l2_errors: int | None = None  # ours: Redis calls that failed or timed out
    answers: dict[int, Labels] = field(default_factory=dict)
    disagreements: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.latencies_ms)

    @property
    def throughput(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def hit_ratio(self) -> float:
        return 1.0 - self.model_calls / self.requests if self.requests else float("nan")

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.requests else float("nan")

    def add(self, segment: Segment) -> None:
        if segment.errors:
            raise RuntimeError(
                f"{self.system} on {self.workload}: {len(segment.errors)} requests failed, "
                f"first: {segment.errors[0]}"
            )
        self.latencies_ms = np.concatenate([self.latencies_ms, segment.latencies_ms])
        self.wall_s += segment.wall_s
        self.cpu_s += segment.cpu_s
        self.tiers.update(segment.tiers)


def rotated(items: Sequence[str], k: int) -> list[str]:
    k %= len(items)
    return [*items[k:], *items[:k]]


def split_segments(stream: np.ndarray, segments: int) -> list[list[int]]:
    return [part.tolist() for part in np.array_split(stream, max(1, min(segments, len(stream))))]


@contextmanager
def fresh_redis(workdir: Path, *, tcp: bool = False) -> Iterator[Any]:
    """A private redis-server with the app's maxmemory and policy and no snapshots: on a unix
    socket as the app starts its own (REDIS_URL unset), or on a free loopback port (`tcp`)."""
    from storage.embedded_redis import EmbeddedRedis

    port = free_port() if tcp else None
    server = EmbeddedRedis(data_dir=workdir, maxmemory_mb=REDIS_MAXMEMORY_MB, port=port, save=False)
    server.start()
    try:
        yield server
    finally:
        server.close()


def redis_state(server: Any) -> tuple[float, float]:
    """(used memory MiB, CPU seconds so far) of a redis-server this script started."""
    import psutil
    import redis

    client = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        used = int(client.info("memory")["used_memory"]) / 2**20
    finally:
        client.close()
    cpu = psutil.Process(server.pid).cpu_times()
    return used, cpu.user + cpu.system


def process_cpu_s(pid: int) -> float:
    import psutil

    cpu = psutil.Process(pid).cpu_times()
    return cpu.user + cpu.system


@dataclass(frozen=True)
class Config:
    requests: int = FULL_REQUESTS
    images: int = IMAGES
    messages: int = MESSAGES
    clients: int = CLIENTS
    zipf_s: float = ZIPF_S
    seed: int = SEED
    segments: int = SEGMENTS
    systems: tuple[str, ...] = SYSTEMS
    workloads: tuple[str, ...] = WORKLOADS
    device: str = "auto"
    threads: int | None = THREADS
    isolated: bool = True  # each system in its own process (False: tests, --in-process)
    http: bool = False
    http_sessions: bool = True  # each HTTP client keeps one Gradio session, as gradio_client does
    inputs_cache: Path | None = None  # where generated inputs are kept between runs (None: nowhere)


def run_workload(
    workload: str,
    stream: np.ndarray,
    config: Config,
    workdir: Path,
    inputs_path: Path,
    *,
    models: Mapping[str, Any] | None = None,
    jobs: Sequence[Job] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Result]:
    """Every system on one workload: all alive at once, taking turns segment by segment."""
    results = {name: Result(name, workload) for name in config.systems}
    with ExitStack() as stack:
        servers: dict[str, Any] = {}
        handles: dict[str, ChildHandle | LocalHandle] = {}
        for name in config.systems:
            redis_url = None
            if name in USES_REDIS:
                servers[name] = stack.enter_context(
                    fresh_redis(workdir / f"{workload}-{name}-redis", tcp=name in REDIS_OVER_TCP)
                )
                redis_url = servers[name].url
            spec = WorkerSpec(
                name,
                workload,
                str(inputs_path),
                str(workdir / f"{workload}-{name}"),
                redis_url,
                config.device,
                config.threads,
                config.clients,
            )
            if config.isolated:
                handles[name] = ChildHandle(_child_main, spec)
            else:
                handles[name] = LocalHandle(Worker(spec, models=models, jobs=jobs, isolated=False))
            stack.callback(handles[name].close)
        for handle in handles.values():  # the children load their models in parallel
            handle.send("setup")
        for name, handle in handles.items():
            ready = handle.receive()
            results[name].rss_start_mib = ready["rss_start_mib"] if config.isolated else None
        segments = split_segments(stream, config.segments)
        restart_at = len(segments) // 2 if workload == "zipf-restart" else None
        log(
            f"{workload}: {len(stream):,} requests, {len(segments)} segments, {config.clients} clients"
            f" | at start: {host_load()}"
        )
        for k, segment in enumerate(segments):
            if k == restart_at:
                for name in config.systems:
                    results[name].restart_s = handles[name].call("restart")
            for name in rotated(config.systems, k):
                # CPU per segment: the system's process (measured there) and its redis-server's.
                redis_cpu = redis_state(servers[name])[1] if name in servers else 0.0
                segment_result = handles[name].call("run", segment)
                if name in servers:
                    segment_result.cpu_s += redis_state(servers[name])[1] - redis_cpu
                results[name].add(segment_result)
        log(f"{workload}: done | at end: {host_load()}")
        for name in config.systems:
            if name in servers:
                results[name].redis_mib = redis_state(servers[name])[0]
            final = handles[name].call("finish")
            results[name].model_calls = final["model_calls"]
            results[name].l2_errors = final["l2_errors"]
            results[name].rss_peak_mib = final["rss_peak_mib"]
            results[name].answers = final["answers"]
            results[name].disagreements = final["disagreements"]
    return results


# ---- HTTP: the Gradio API of this app, and of a minimal Gradio app with gr.cache --------------------


def build_grcache_demo(models: Mapping[str, Any], *, max_memory: int) -> Any:
    """The minimal Gradio app: gr.Image(type="numpy") and a Textbox into gr.cache'd classifiers."""
    import gradio as gr

    from engine.inputs import CanonicalImage
    from ui.server import QUEUE_MAX_SIZE

    image_model, text_model = models["image"], models["text"]

    @gr.cache(max_size=0, max_memory=max_memory)
    def classify_image(image: np.ndarray) -> dict[str, float]:
        return image_model.predict_batch([CanonicalImage(np.ascontiguousarray(image))])[0].as_label_value()

    @gr.cache(max_size=0, max_memory=max_memory)
    def classify_text(text: str) -> dict[str, float]:
        return text_model.predict_batch([text_model.canonicalize(text)])[0].as_label_value()

    with gr.Blocks(title="gr.cache") as demo:
        image_in = gr.Image(type="numpy")
        image_out = gr.Label(num_top_classes=5)
        gr.Button("Classify image").click(classify_image, image_in, image_out, api_name="classify_image")
        text_in = gr.Textbox()
        text_out = gr.Label(num_top_classes=5)
        gr.Button("Classify message").click(classify_text, text_in, text_out, api_name="classify_text")
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=1)  # what our app sets
    return demo


def build_grcache_app(models: Mapping[str, Any], *, max_memory: int) -> Any:
    import gradio as gr
    from fastapi import FastAPI

    demo = build_grcache_demo(models, max_memory=max_memory)
    return gr.mount_gradio_app(FastAPI(), demo, path="", ssr_mode=False)


@dataclass(frozen=True)
class ServerSpec:
    system: str
    data_dir: str
    redis_url: str | None
    device: str
    threads: int | None
    port: int


class HttpServer:
    """One app (ours or the gr.cache app) served by uvicorn in a thread of this process."""

    def __init__(
        self, spec: ServerSpec, *, models: Mapping[str, Any] | None = None, isolated: bool = True
    ) -> None:
        self.spec = spec
        self._shared_models = models
        self._isolated = isolated
        self._models: dict[str, CountingModel] = {}
        self._runtime: Any = None
        self._server: Any = None

    def setup(self) -> dict[str, Any]:
        from ui.server import BackgroundServer, build_app

        spec = self.spec
        models = self._shared_models
        if models is None:
            set_threads(spec.threads)
            models = load_models(spec.device)
        self._models = counting(models)
        settings = our_settings(spec.redis_url, Path(spec.data_dir), spec.device)
        if spec.system == "ours":
            from engine.runtime import build_runtime

            self._runtime = build_runtime(settings, models=self._models)
            app = build_app(self._runtime)
        else:
            app = build_grcache_app(self._models, max_memory=settings.cache_l1_max_bytes)
        self._server = BackgroundServer(app, port=spec.port).start()
        gc.collect()
        rss = rss_mib()
        if self._isolated:
            reset_peak_rss()
        return {"url": self._server.url, "pid": os.getpid(), "rss_start_mib": rss}

    def finish(self) -> dict[str, Any]:
        if self._server is not None:
            self._server.close()
        if self._runtime is not None:
            self._runtime.close()
        return {
            "model_calls": sum(m.calls for m in self._models.values()),
            "rss_peak_mib": peak_rss_mib() if self._isolated else None,
        }


def _server_main(conn: Any, spec: ServerSpec) -> None:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        server = HttpServer(spec)
        while True:
            command, args = conn.recv()
            if command == "exit":
                return
            conn.send(("ok", getattr(server, command)(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class GradioApiClient:
    """One HTTP client of the Gradio API (upload, then /call/<api> and its event stream)."""

    def __init__(self, url: str, *, session: bool = True) -> None:
        import httpx

        self._http = httpx.Client(base_url=f"{url}/gradio_api", timeout=120.0)
        # One session per client, as gradio_client and the browser keep one; without it every
        # request is a new session, which Gradio builds from the whole Blocks config.
        self._session = secrets.token_hex(8) if session else None

    def classify(self, task: str, raw: Any) -> tuple[Labels, str | None]:
        if task == "image":
            name, mime = ("upload.png", "image/png") if raw[:8] == PNG_MAGIC else ("upload.jpg", "image/jpeg")
            uploaded = self._http.post("/upload", files={"files": (name, raw, mime)})
            uploaded.raise_for_status()
            data: list[Any] = [
                {"path": uploaded.json()[0], "orig_name": name, "meta": {"_type": "gradio.FileData"}}
            ]
            api = "classify_image"
        else:
            data, api = [raw], "classify_text"
        body: dict[str, Any] = {"data": data}
        if self._session is not None:
            body["session_hash"] = self._session
        joined = self._http.post(f"/call/{api}", json=body)
        joined.raise_for_status()
        events = self._http.get(f"/call/{api}/{joined.json()['event_id']}")
        events.raise_for_status()
        outputs = parse_events(events.text)
        label = outputs[0]
        tier = outputs[1].get("tier") if len(outputs) > 1 and isinstance(outputs[1], dict) else None
        return tuple((c["label"], float(c["confidence"])) for c in label["confidences"]), tier

    def close(self) -> None:
        self._http.close()


def parse_events(text: str) -> list[Any]:
    """The outputs of the `complete` event of a Gradio /call event stream."""
    event = None
    for line in text.splitlines():
        if line.startswith("event: "):
            event = line[len("event: ") :].strip()
        elif line.startswith("data: ") and event in ("complete", "error"):
            payload = json.loads(line[len("data: ") :])
            if event == "error":
                raise RuntimeError(f"the app answered with an error: {payload}")
            return payload
    raise RuntimeError(f"no complete event in the stream: {text[:300]!r}")


def run_http(
    stream: np.ndarray,
    jobs: Sequence[Job],
    config: Config,
    workdir: Path,
    *,
    models: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Result]:
    """The Zipf stream through the Gradio API of both apps, servers restarted at halfway."""
    systems = [s for s in HTTP_SYSTEMS if s in config.systems]
    results = {name: Result(name, "zipf-restart (HTTP)") for name in systems}
    answers: dict[str, dict[int, Labels]] = {name: {} for name in systems}
    disagreements: dict[str, list[str]] = {name: [] for name in systems}
    peaks: dict[str, list[float]] = {name: [] for name in systems}
    with ExitStack() as stack:
        servers: dict[str, Any] = {}
        for name in systems:
            if name in USES_REDIS:
                servers[name] = stack.enter_context(fresh_redis(workdir / f"http-{name}-redis"))

        def start_all() -> dict[str, tuple[Any, dict[str, Any]]]:
            """Start both servers (in parallel); each one's `ready` holds its url, pid and start time."""
            started = time.perf_counter()
            handles: dict[str, Any] = {}
            for name in systems:
                spec = ServerSpec(
                    name,
                    str(workdir / f"http-{name}"),
                    servers[name].url if name in servers else None,
                    config.device,
                    config.threads,
                    free_port(),
                )
                handles[name] = (
                    ChildHandle(_server_main, spec)
                    if config.isolated
                    else LocalHandle(HttpServer(spec, models=models, isolated=False))
                )
                handles[name].send("setup")
            live = {}
            for name, handle in handles.items():
                ready = handle.receive()
                ready["start_s"] = time.perf_counter() - started
                live[name] = (handle, ready)
            return live

        def stop_all(live: Mapping[str, tuple[Any, dict[str, Any]]]) -> None:
            for name, (handle, _) in live.items():
                final = handle.call("finish")
                results[name].model_calls += final["model_calls"]
                if final["rss_peak_mib"] is not None:
                    peaks[name].append(final["rss_peak_mib"])
                handle.close()

        def server_cpu(name: str) -> float:
            """CPU seconds so far of the server process (when it has its own) and its redis-server."""
            total = process_cpu_s(live[name][1]["pid"]) if config.isolated else 0.0
            return total + (redis_state(servers[name])[1] if name in servers else 0.0)

        live = start_all()
        for name, (_, ready) in live.items():
            results[name].rss_start_mib = ready["rss_start_mib"] if config.isolated else None
        segments = split_segments(stream, config.segments)
        restart_at = len(segments) // 2
        sessions = "one session per client" if config.http_sessions else "no session (a new one per request)"
        log(
            f"zipf-restart over HTTP: {len(stream):,} requests, {len(segments)} segments, "
            f"{config.clients} HTTP clients, {sessions} | at start: {host_load()}"
        )
        try:
            for k, segment in enumerate(segments):
                if k == restart_at:  # a real restart: new processes, models loaded again
                    stop_all(live)
                    live = start_all()
                    for name, (_, ready) in live.items():
                        results[name].restart_s = ready["start_s"]
                for name in rotated(systems, k):
                    url = live[name][1]["url"]
                    clients = [
                        GradioApiClient(url, session=config.http_sessions) for _ in range(config.clients)
                    ]
                    try:
                        cpu = server_cpu(name)
                        segment_result = replay(
                            [c.classify for c in clients], jobs, segment, answers[name], disagreements[name]
                        )
                        segment_result.cpu_s = server_cpu(name) - cpu  # the server's, not the clients'
                    finally:
                        for c in clients:
                            c.close()
                    results[name].add(segment_result)
        finally:
            for name, server in servers.items():
                results[name].redis_mib = redis_state(server)[0]
            stop_all(live)
        log(f"zipf-restart over HTTP: done | at end: {host_load()}")
    for name in systems:
        if not config.isolated:  # the servers ran in this process, alongside the clients
            results[name].cpu_s = float("nan")
        results[name].answers = answers[name]
        results[name].disagreements = disagreements[name]
        results[name].rss_peak_mib = max(peaks[name]) if peaks[name] else None
    return results


# ---- figures --------------------------------------------------------------------------------------


def ratio(ours: Result | None, peer: Result | None) -> float:
    if ours is None or peer is None or not peer.throughput or math.isnan(peer.throughput):
        return float("nan")
    return ours.throughput / peer.throughput


def summary_values(results: Mapping[str, Mapping[str, Result]]) -> dict[str, float]:
    zipf, unique = results.get("zipf-restart", {}), results.get("unique", {})
    ours = zipf.get("ours")
    return {
        "speedup_vs_nocache": ratio(ours, zipf.get("nocache")),
        "speedup_vs_grcache": ratio(ours, zipf.get("grcache")),
        "speedup_vs_seed": ratio(ours, zipf.get("seed")),
        "unique_vs_nocache": ratio(unique.get("ours"), unique.get("nocache")),
        "hit_ratio": ours.hit_ratio if ours is not None else float("nan"),
    }


def summary_line(values: Mapping[str, float]) -> str:
    def cell(key: str) -> str:
        value = values[key]
        return "nan" if math.isnan(value) else f"{value:.3f}" if key == "hit_ratio" else f"{value:.2f}"

    return "SUMMARY " + " ".join(f"{key}={cell(key)}" for key in SUMMARY_KEYS)


def parse_summary(line: str) -> dict[str, float]:
    found = SUMMARY_PATTERN.match(line.strip())
    if found is None:
        raise ValueError(f"not a summary line: {line!r}")
    return {key: float(found.group(key)) for key in SUMMARY_KEYS}


def _mib(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.0f}"


def results_table(results: Mapping[str, Result]) -> str:
    rows = []
    for r in results.values():
        growth = (
            None if r.rss_peak_mib is None or r.rss_start_mib is None else r.rss_peak_mib - r.rss_start_mib
        )
        rows.append(
            [
                r.system,
                f"{r.requests:,}",
                f"{r.wall_s:.1f}",
                f"{r.throughput:.1f}",
                fmt_ms(r.percentile(50)),
                fmt_ms(r.percentile(95)),
                fmt_ms(r.percentile(99)),
                f"{r.hit_ratio:.3f}",
                f"{r.model_calls:,}",
                "-" if math.isnan(r.cpu_s) else f"{1000 * r.cpu_s / max(r.requests, 1):.2f}",
                _mib(r.rss_peak_mib),
                _mib(growth),
                "-" if r.redis_mib is None else f"{r.redis_mib:.1f}",
                "-" if r.restart_s is None else f"{r.restart_s:.2f}",
            ]
        )
    headers = [
        "system",
        "requests",
        "wall s",
        "req/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "hit ratio",
        "model calls",
        "CPU ms/req",
        "peak RSS MiB",
        "RSS growth MiB",
        "Redis MiB",
        "restart s",
    ]
    return format_table(headers, rows)


def ratio_table(results: Mapping[str, Mapping[str, Result]]) -> str:
    rows = []
    pairs = [("ours", peer) for peer in PEERS] + [
        ("ours", "ours-l1"),
        ("ours-tcp", "ours"),
        ("ours-nobatch", "ours"),
        ("nocache-twin", "nocache"),
    ]
    for workload, by_system in results.items():
        for name, peer in pairs:
            subject, other = by_system.get(name), by_system.get(peer)
            if subject is None or other is None:
                continue
            rows.append(
                [
                    f"{workload}: {name} / {peer}",
                    f"{ratio(subject, other):.2f}x",
                    _times(other.percentile(50), subject.percentile(50)),
                    _times(other.percentile(99), subject.percentile(99)),
                    _times(other.cpu_s / max(other.requests, 1), subject.cpu_s / max(subject.requests, 1)),
                    f"{other.model_calls / max(subject.model_calls, 1):.2f}x",
                ]
            )
    headers = [
        "",
        "throughput",
        "p50 (peer/ours)",
        "p99 (peer/ours)",
        "CPU/req (peer/ours)",
        "model calls (peer/ours)",
    ]
    return format_table(headers, rows)


def _times(peer: float, ours: float) -> str:
    return "n/a" if not ours or math.isnan(ours) or math.isnan(peer) else f"{peer / ours:.2f}x"


def tier_line(result: Result) -> str:
    parts = [f"{tier} {result.tiers.get(tier, 0):,}" for tier in ("l1", "l2", "coalesced", "miss")]
    errors = "" if result.l2_errors is None else f"; Redis calls failed or timed out: {result.l2_errors:,}"
    return f"{result.workload}, ours by tier: " + ", ".join(parts) + errors


def check_answers(results: Mapping[str, Result], reference: str = "nocache") -> list[str]:
    """Every system's answer on every input it saw, against the reference system's (the model's)."""
    lines = []
    base = results.get(reference)
    if base is None:
        return [f"answers: no {reference} run to compare with"]
    for name, result in results.items():
        problems = list(result.disagreements)
        identical = 0
        for index, labels in result.answers.items():
            expected = base.answers.get(index)
            if expected is None:
                continue
            if labels == expected:
                identical += 1
            elif not same_answer(labels, expected):
                problems.append(f"input {index}: {labels} but {reference} says {expected}")
        compared = sum(1 for index in result.answers if index in base.answers)
        if name == reference:
            continue
        note = (
            f"{identical:,} of {compared:,} identical, the rest within {SCORE_TOLERANCE:g}"
            if identical < compared
            else f"all {compared:,} identical"
        )
        lines.append(
            f"answers {result.workload}, {name} vs {reference}: "
            + (f"{len(problems)} differ, e.g. {problems[0]}" if problems else note)
        )
    return lines


def target_lines(values: Mapping[str, float]) -> list[str]:
    lines = []
    for key, minimum in TARGETS.items():
        value = values[key]
        verdict = "n/a" if math.isnan(value) else "met" if value >= minimum else "SHORT"
        lines.append(f"target {key} >= {minimum:g}: {value:.2f} ({verdict})")
    return lines


def machine_lines() -> list[str]:
    import gradio
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            found = re.search(r"model name\s*:\s*(.+)", info.read())
            cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    return [
        f"CPU: {cpu}, {os.cpu_count()} logical CPUs; memory {psutil.virtual_memory().total / 2**30:.0f} GiB",
        f"OS: {platform.platform()}; Python {platform.python_version()}",
        f"torch {torch.__version__} (its default: {torch.get_num_threads()} intra-op threads), "
        f"gradio {gradio.__version__}",
    ]


# ---- the run -----------------------------------------------------------------------------------------


@dataclass
class Run:
    config: Config
    results: dict[str, dict[str, Result]]
    http: dict[str, Result] | None
    values: dict[str, float]
    lines: list[str]  # the printed report, without the summary line
    progress: list[str]  # what was logged during the run (load averages at each workload's start and end)
    started: datetime
    elapsed_s: float
    device: str


def run_benchmark(
    config: Config,
    *,
    models: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
    workdir: Path | None = None,
) -> Run:
    started_at, started = datetime.now(UTC), time.perf_counter()
    progress: list[str] = []
    outer_log = log

    def log(message: str) -> None:
        progress.append(message)
        outer_log(message)

    with ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-workload-")))
        t0 = time.perf_counter()
        jobs, origin = cached_inputs(config.images, config.messages, config.seed, config.inputs_cache)
        inputs_path = workdir / "inputs.pickle"
        inputs_path.write_bytes(pickle.dumps(jobs, protocol=pickle.HIGHEST_PROTOCOL))
        streams = make_streams(len(jobs), config.requests, config.zipf_s, config.seed)
        image_kib = sum(len(raw) for task, raw in jobs if task == "image") / max(config.images, 1) / 1024
        log(
            f"inputs: {config.images:,} images (mean {image_kib:.0f} KiB, PNG and JPEG), {config.messages:,} "
            f"messages, {origin} in {time.perf_counter() - t0:.1f} s | seed {config.seed}"
        )
        for name, stream in streams.items():
            distinct = len(set(stream.tolist()))
            log(f"{name}: {len(stream):,} requests over {distinct:,} distinct inputs")
        results: dict[str, dict[str, Result]] = {}
        for workload in config.workloads:
            results[workload] = run_workload(
                workload, streams[workload], config, workdir, inputs_path, models=models, jobs=jobs, log=log
            )
        http = None
        if config.http:
            http = run_http(streams["zipf-restart"], jobs, config, workdir, models=models, log=log)
    values = summary_values(results)
    device = "cpu"
    if models is not None:
        device = str(getattr(models["image"], "device", "cpu"))
    elif config.device != "auto":
        device = config.device
    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = report_lines(config, results, http, values, device)
    return Run(
        config, results, http, values, lines, progress, started_at, time.perf_counter() - started, device
    )


def report_lines(
    config: Config,
    results: Mapping[str, Mapping[str, Result]],
    http: Mapping[str, Result] | None,
    values: Mapping[str, float],
    device: str,
) -> list[str]:
    tcp_note = " (ours-tcp: loopback TCP)" if REDIS_OVER_TCP & set(config.systems) else ""
    lines = [
        f"device: {device} | {config.clients} concurrent clients | Zipf s={config.zipf_s} | torch threads "
        f"{config.threads or 'default'} | "
        f"{'each system in its own process' if config.isolated else 'all systems in one process (RSS n/a)'}"
        f" | Redis on unix sockets{tcp_note}",
    ]
    for workload, by_system in results.items():
        lines += ["", f"{workload}:", results_table(by_system)]
        if "ours" in by_system:
            lines.append(tier_line(by_system["ours"]))
    if http:
        lines += [
            "",
            "zipf-restart through the Gradio API (CPU: the server process and its Redis; restart: new "
            "processes, models loaded again):",
            results_table(http),
        ]
        if "ours" in http:
            lines.append(tier_line(http["ours"]))
    ratio_input: dict[str, Mapping[str, Result]] = dict(results)
    if http:
        ratio_input["zipf-restart (HTTP)"] = http
    lines += ["", ratio_table(ratio_input), ""]
    for by_system in results.values():
        lines += check_answers(by_system)
    if http and {"ours", "grcache"} <= set(http):
        lines += check_answers(http, reference="grcache")
    lines += ["", *target_lines(values)]
    return lines


# ---- report and chart --------------------------------------------------------------------------------


def write_chart(run: Run, path: Path) -> None:
    """Latency CDF per system (one panel per workload, and HTTP) and throughput bars."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels: list[tuple[str, Mapping[str, Result]]] = list(run.results.items())
    if run.http:
        panels.append(("zipf-restart over HTTP", run.http))
    titles = [f"latency CDF: {name}" for name, _ in panels] + ["throughput (requests/s)"]
    fig = make_subplots(rows=1, cols=len(panels) + 1, subplot_titles=titles)
    colours = {"nocache": "#7f7f7f", "seed": "#ff7f0e", "grcache": "#1f77b4", "ours": "#2ca02c",
               "ours-l1": "#98df8a", "ours-tcp": "#ff9896", "ours-nobatch": "#c5b0d5",
               "nocache-twin": "#c7c7c7"}  # fmt: skip
    for col, (_, by_system) in enumerate(panels, start=1):
        for name, result in by_system.items():
            ordered = np.sort(result.latencies_ms)
            if not len(ordered):
                continue
            picks = np.unique(np.linspace(0, len(ordered) - 1, num=min(len(ordered), 400)).astype(int))
            fig.add_trace(
                go.Scatter(
                    x=ordered[picks],
                    y=(picks + 1) / len(ordered),
                    mode="lines",
                    name=name,
                    line={"color": colours.get(name)},
                    legendgroup=name,
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(type="log", title_text="ms (log)", row=1, col=col)
        fig.update_yaxes(title_text="share of requests", range=[0, 1], row=1, col=col)
    bar_col = len(panels) + 1
    for name in ALL_SYSTEMS:
        xs = [label for label, by_system in panels if name in by_system]
        ys = [by_system[name].throughput for _, by_system in panels if name in by_system]
        fig.add_trace(
            go.Bar(x=xs, y=ys, name=name, marker_color=colours.get(name), legendgroup=name, showlegend=False),
            row=1,
            col=bar_col,
        )
    fig.update_yaxes(type="log", title_text="req/s (log)", row=1, col=bar_col)
    fig.update_layout(
        title=f"bench.workload, {run.started:%Y-%m-%d}: {summary_line(run.values)}",
        barmode="group",
        height=520,
        width=560 * (len(panels) + 1),
    )
    path.write_text(fig.to_html(include_plotlyjs="cdn", full_html=True), encoding="utf-8")


def write_report(run: Run, path: Path, command: str) -> None:
    kept = ""
    if path.exists():
        old = path.read_text(encoding="utf-8")
        if NOTES_MARKER in old:
            kept = old[old.index(NOTES_MARKER) :]
    config = run.config
    unique = unique_requests(config.requests, config.images + config.messages)
    body = [
        "# Workload benchmark report",
        "",
        "Written by `bench/workload.py` (the table below is the output of the run; the notes at the end",
        "are kept when the report is rewritten).",
        "",
        f"- command: `{command}`",
        f"- date: {run.started:%Y-%m-%d %H:%M} UTC; the run took {run.elapsed_s / 60:.1f} minutes",
        *(f"- {line}" for line in machine_lines()),
        f"- requests: {config.requests:,} (zipf-restart), {unique:,} (unique); inputs {config.images:,} "
        f"images + {config.messages:,} messages; seed {config.seed}; {config.segments} segments; "
        f"torch intra-op threads per process: {config.threads or 'torch default'}",
        "",
        "```",
        *run.lines,
        summary_line(run.values),
        "```",
        "",
        "Progress log of the run (the load average counts every runnable process on the machine, "
        "this run's included):",
        "",
        "```",
        *run.progress,
        "```",
        "",
    ]
    path.write_text("\n".join(body) + (("\n" + kept) if kept else ""), encoding="utf-8")


# ---- command line ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.workload", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_REQUESTS:,} requests instead of {FULL_REQUESTS:,}"
    )
    parser.add_argument(
        "--requests", type=int, default=None, help="zipf-restart requests (overrides --quick)"
    )
    parser.add_argument("--http", action="store_true", help="also run the Zipf stream through the Gradio API")
    parser.add_argument(
        "--http-no-session",
        action="store_true",
        help="HTTP clients send no session hash (curl style): Gradio builds a new session per request",
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}; opt-in: {','.join(ATTRIBUTION_SYSTEMS)}"
        " (ours without Redis; a second nocache, the noise floor)",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument("--images", type=int, default=IMAGES)
    parser.add_argument("--messages", type=int, default=MESSAGES)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--segments", type=int, default=SEGMENTS, help="turns per system (interleaving)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--inputs-cache",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="folder that keeps the generated inputs between runs (default: the temp folder)",
    )
    parser.add_argument("--no-inputs-cache", action="store_true", help="make the inputs afresh, keep nothing")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--threads",
        type=int,
        default=THREADS,
        help=f"torch intra-op threads per serving process (default {THREADS}: clients run forwards at once)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="all systems in this process, sharing one copy of the models (no RSS figures)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        help=f"write the report here (default run: {REPORT_PATH.name}; --quick: nowhere)",
    )
    parser.add_argument(
        "--chart",
        type=Path,
        default=None,
        help=f"write the plotly chart here (default run: {CHART_PATH.name}; --quick: nowhere)",
    )
    args = parser.parse_args(argv)
    args.systems = tuple(s for s in ALL_SYSTEMS if s in args.systems.split(","))
    args.workloads = tuple(w for w in WORKLOADS if w in args.workloads.split(","))
    if not args.systems or not args.workloads:
        parser.error(
            f"--systems takes some of {','.join(ALL_SYSTEMS)}; --workloads some of {','.join(WORKLOADS)}"
        )
    if min(args.images, args.messages, args.clients, args.segments) < 1 or (
        args.threads is not None and args.threads < 1
    ):
        parser.error("--images, --messages, --clients, --segments and --threads must be >= 1")
    if args.requests is not None and args.requests < 2:
        parser.error("--requests must be >= 2")
    return args


def config_from_args(args: argparse.Namespace) -> Config:
    requests = args.requests or (QUICK_REQUESTS if args.quick else FULL_REQUESTS)
    return Config(
        requests=requests,
        images=args.images,
        messages=args.messages,
        clients=args.clients,
        seed=args.seed,
        segments=args.segments,
        systems=args.systems,
        workloads=args.workloads,
        device=args.device,
        threads=args.threads,
        isolated=not args.in_process,
        http=args.http or args.http_no_session,
        http_sessions=not args.http_no_session,
        inputs_cache=None if args.no_inputs_cache else args.inputs_cache,
    )


def main(argv: Sequence[str] | None = None, *, models: Mapping[str, Any] | None = None) -> int:
    from storage.embedded_redis import find_redis_server

    args = parse_args(argv)
    if find_redis_server() is None:
        print("redis-server is not installed: `apt-get install -y redis-server`.", file=sys.stderr)
        return 2
    config = config_from_args(args)
    if models is not None:
        config = replace(config, isolated=False)
    elif not config.isolated:
        set_threads(config.threads)
        models = load_models(config.device)
    command = "python -m bench.workload" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv)
    )
    print(f"{command} | {host_load()}")
    run = run_benchmark(config, models=models)
    print()
    print("\n".join(run.lines))
    is_default = not args.quick and args.requests is None
    report = args.report or (REPORT_PATH if is_default else None)
    chart = args.chart or (CHART_PATH if is_default else None)
    if report is not None:
        write_report(run, report, command)
        print(f"report: {report}")
    if chart is not None:
        write_chart(run, chart)
        print(f"chart: {chart}")
    ok = not any(line.startswith("answers") and " differ" in line for line in run.lines)
    print(summary_line(run.values))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
