"""The cache, measured at engine level against two common alternatives, in one run.

Three systems answer the same inputs (scikit-image photos, support messages)
with the same loaded models, in the same process, their samples interleaved:

- ours: `InferenceEngine.classify(task, raw)` built by `build_runtime` (with
  whatever request listeners it attaches), L1 in process, L2 on a private
  redis-server this script starts (DB 0).
- the common recipe: preprocess to the model's input tensor (image: the image
  model's `preprocess`; text: token ids), key = md5 of the tensor's bytes,
  `functools.lru_cache(maxsize=128)` as L1, Redis values via pickle with a
  1-hour TTL as L2 (DB 1 of the same server).
- gr.cache: Gradio's `gr.cache(fn, max_size=0, max_memory=...)` around a
  classify function that takes the decoded image (uint8 pixels, what
  `gr.Image(type="numpy")` hands a callback) or the text. No L2.

Every system decodes with the engine's own decoder (`canonicalize`), so the
differences are in the keying and the caching alone.

Measured: the time to derive a key (hashing alone, and from the input as
received) against the model's forward pass; then p50/p99 latency of an L1 hit,
an L2 hit and a miss, from the input as received (bytes of an upload, a str),
for images and for text. A peer's hit includes the decoding (and, for the
recipe, the transform) it needs before it can compute its key; ours hits on
the raw bytes' digest.

    .venv/bin/python -m bench.cache [--quick] [--device auto|cpu|cuda] [--threads N]

Needs `redis-server` on PATH (the script starts and stops its own on a free
loopback port; it touches no other Redis).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.models import (
    MESSAGES,
    fmt_ms,
    format_table,
    host_load,
    image_batch,
    image_forward,
    interleaved_samples,
    load_photos,
    load_real_models,
    positive_int,
    set_threads,
    synchronizer,
    text_forward,
    tokenize,
)
from bench.peers import CommonRecipe, CountingModel, GrCache, Ours, System, counting, md5_key, our_settings
from engine.cache.keys import digest_parts, raw_digest
from engine.inputs import CanonicalImage, CanonicalText
from engine.models.image import ImageClassifier
from engine.models.text import TextClassifier
from storage.redis.embedded import EmbeddedRedis, find_redis_server, free_port

RECIPE_REDIS_DB = 1
TASKS = ("image", "text")
TIERS = ("l1", "l2", "miss")
TIER_NAMES = {"l1": "L1 hit", "l2": "L2 hit", "miss": "miss"}
RECIPE, GRADIO = "common recipe", "gr.cache"  # the peers' names in the tables


@dataclass(frozen=True)
class Profile:
    key_repeats: int  # timed key derivations per input
    hits: int  # timed hits per system and tier (inputs taken in turn)
    misses: int  # timed misses per system


FULL = Profile(key_repeats=50, hits=1000, misses=40)
QUICK = Profile(key_repeats=8, hits=150, misses=8)
Models = Mapping[str, CountingModel]


# ---- statistics ------------------------------------------------------------------


@dataclass(frozen=True)
class Latency:
    n: int
    p50: float
    p99: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Latency:
        p50, p99 = np.percentile(np.asarray(samples), [50, 99])
        return cls(len(samples), float(p50), float(p99))


def ratio(peer: float | None, ours: float | None) -> str:
    """How many times longer the peer takes ('12x': ours is 12 times faster)."""
    if peer is None or ours is None or ours <= 0:
        return "n/a"
    value = peer / ours
    return f"{value:.0f}x" if value >= 100 else f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


# ---- key derivation -------------------------------------------------------------------


@dataclass(frozen=True)
class KeyTime:
    label: str
    hash_only: float  # median ms to hash what the system keys on, once it has it
    from_input: float  # median ms from the input as received to the key


@dataclass(frozen=True)
class KeyTimes:
    """Median ms, pooled over every input and repeat of one task."""

    ours_raw: KeyTime
    ours_canonical: KeyTime
    peers: dict[str, KeyTime]  # system name -> its key
    decode: float
    transform: float | None
    forward: float


def pooled_medians(
    fns: Mapping[str, Sequence[Callable[[], object]]], *, repeats: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Median ms per name, pooled over that name's functions (one per input); every
    function of every name is sampled in turn, so they all see the same conditions."""
    flat = {(name, i): fn for name, per_input in fns.items() for i, fn in enumerate(per_input)}
    samples = interleaved_samples(flat, repeats=repeats, warmup=2, sync=sync)
    pooled: dict[str, list[float]] = {name: [] for name in fns}
    for (name, _), values in samples.items():
        pooled[name] += values
    return {name: statistics.median(values) for name, values in pooled.items()}


def _xxh3_key(canonical: CanonicalImage | CanonicalText) -> str:
    return digest_parts(canonical.fingerprint_parts())


def _gradio_key(**kwargs: Any) -> str:
    from gradio.caching import cache_hash

    return cache_hash(kwargs)  # what gr.cache's wrapper hashes: the call's arguments by name


def _decoded_then(model: ImageClassifier, raw: bytes, key: Callable[[CanonicalImage], str]) -> str:
    return key(model.canonicalize(raw))


def image_key_times(models: Models, recipe: CommonRecipe, photos: Sequence[bytes], repeats: int) -> KeyTimes:
    model = models["image"]
    canonicals = [model.canonicalize(raw) for raw in photos]
    tensors = [model.preprocess(c) for c in canonicals]
    batch = image_batch(model, canonicals[:1])
    gradio_from_pixels = functools.partial(_decoded_then, key=lambda c: _gradio_key(image=c.pixels))
    m = pooled_medians(
        {
            "raw": [functools.partial(raw_digest, raw) for raw in photos],
            "xxh3": [functools.partial(_xxh3_key, c) for c in canonicals],
            "xxh3 from input": [functools.partial(_decoded_then, model, raw, _xxh3_key) for raw in photos],
            "md5": [functools.partial(md5_key, t) for t in tensors],
            "md5 from input": [functools.partial(recipe.key_image, raw) for raw in photos],
            "gradio": [functools.partial(_gradio_key, image=c.pixels) for c in canonicals],
            "gradio from input": [functools.partial(gradio_from_pixels, model, raw) for raw in photos],
            "decode": [functools.partial(model.canonicalize, raw) for raw in photos],
            "transform": [functools.partial(model.preprocess, c) for c in canonicals],
            "forward": [functools.partial(image_forward, model, batch)],
        },
        repeats=repeats,
        sync=synchronizer(model.device),
    )
    return KeyTimes(
        ours_raw=KeyTime("ours: raw key, BLAKE3-128 of the upload (every request)", m["raw"], m["raw"]),
        ours_canonical=KeyTime(
            "ours: canonical key, BLAKE3-128 of the pixels (first request)", m["xxh3"], m["xxh3 from input"]
        ),
        peers={
            RECIPE: KeyTime("common recipe: md5 of the float tensor", m["md5"], m["md5 from input"]),
            GRADIO: KeyTime(
                "gr.cache: sha256 of the pixels (cache_hash)", m["gradio"], m["gradio from input"]
            ),
        },
        decode=m["decode"],
        transform=m["transform"],
        forward=m["forward"],
    )


def _cleaned_then(model: TextClassifier, raw: str) -> str:
    return _xxh3_key(model.canonicalize(raw))


def text_key_times(models: Models, recipe: CommonRecipe, messages: Sequence[str], repeats: int) -> KeyTimes:
    model = models["text"]
    canonicals = [model.canonicalize(m) for m in messages]
    ids = [tokenize(model, [c.text])["input_ids"] for c in canonicals]
    encoded = tokenize(model, [canonicals[0].text])
    m = pooled_medians(
        {
            "raw": [functools.partial(raw_digest, raw) for raw in messages],
            "xxh3": [functools.partial(_xxh3_key, c) for c in canonicals],
            "xxh3 from input": [functools.partial(_cleaned_then, model, raw) for raw in messages],
            "md5": [functools.partial(md5_key, t) for t in ids],
            "md5 from input": [functools.partial(recipe.key_text, raw) for raw in messages],
            "gradio": [functools.partial(_gradio_key, text=raw) for raw in messages],
            "decode": [functools.partial(model.canonicalize, raw) for raw in messages],
            "forward": [functools.partial(text_forward, model, encoded)],
        },
        repeats=repeats * 5,  # microseconds each: take more
        sync=synchronizer(model.device),
    )
    return KeyTimes(
        ours_raw=KeyTime("ours: raw key, BLAKE3-128 of the str (every repeat request)", m["raw"], m["raw"]),
        ours_canonical=KeyTime(
            "ours: canonical key, BLAKE3-128 of the cleaned text (first request)",
            m["xxh3"],
            m["xxh3 from input"],
        ),
        peers={
            RECIPE: KeyTime("common recipe: md5 of the token ids", m["md5"], m["md5 from input"]),
            GRADIO: KeyTime("gr.cache: sha256 of the str (cache_hash)", m["gradio"], m["gradio"]),
        },
        decode=m["decode"],
        transform=None,
        forward=m["forward"],
    )


def print_key_times(task: str, times: KeyTimes) -> None:
    keys = [times.ours_raw, times.ours_canonical, *times.peers.values()]
    rows = [
        [
            key.label,
            fmt_ms(key.hash_only),
            fmt_ms(key.from_input),
            f"{100 * key.from_input / times.forward:.2f}%",
        ]
        for key in keys
    ]
    decode_label = "decode (canonicalize)" if task == "image" else "cleaning (canonicalize)"
    rows.append([f"  for reference: {decode_label}", "", fmt_ms(times.decode), ""])
    if times.transform is not None:
        rows.append(["  for reference: transform to the float tensor", "", fmt_ms(times.transform), ""])
    rows.append(["  for reference: model forward, batch 1", "", fmt_ms(times.forward), "100%"])
    headers = [f"{task}: key derivation, median ms", "hash only", "from received input", "of forward"]
    print(format_table(headers, rows))


# ---- tier latencies ------------------------------------------------------------------------


def measure_tiers(
    systems: Sequence[System], task: str, inputs: Sequence[Any], profile: Profile
) -> dict[tuple[str, str], Latency]:
    """Interleaved samples: for each sample, each system in turn on the same input (the
    order rotating, so that no system always runs right after the same other one)."""
    for system in systems:  # fill every tier (and warm every code path) once
        system.drop_all()
        for raw in inputs:
            system.classify(task, raw)
            system.classify(task, raw)
    results: dict[tuple[str, str], Latency] = {}
    plans: tuple[tuple[str, int, Callable[[System], None] | None], ...] = (
        ("l1", profile.hits, None),
        ("l2", profile.hits, lambda s: s.drop_l1()),
        ("miss", profile.misses, lambda s: s.drop_all()),
    )
    for tier, count, prepare in plans:
        taking = [s for s in systems if tier != "l2" or s.has_l2]
        samples: dict[str, list[float]] = {s.name: [] for s in taking}
        gc.collect()  # so one tier does not pay for the previous one's garbage
        for i in range(count):
            raw = inputs[i % len(inputs)]
            first = i % len(taking)
            for system in taking[first:] + taking[:first]:
                samples[system.name].append(_timed_request(system, task, raw, tier, prepare))
        for name, values in samples.items():
            results[(name, tier)] = Latency.of(values)
    for system in systems:  # leave every tier filled again
        for raw in inputs:
            system.classify(task, raw)
    return results


def _timed_request(
    system: System, task: str, raw: Any, tier: str, prepare: Callable[[System], None] | None
) -> float:
    if prepare is not None:
        prepare(system)
    started = time.perf_counter_ns()
    _, answered = system.classify(task, raw)
    elapsed = (time.perf_counter_ns() - started) / 1e6
    if answered != tier:
        raise RuntimeError(f"{system.name}: expected a {tier} answer for {task}, got {answered}")
    return elapsed


def print_tiers(task: str, systems: Sequence[System], results: dict[tuple[str, str], Latency]) -> None:
    rows = []
    for tier in TIERS:
        for system in systems:
            latency = results.get((system.name, tier))
            if latency is None:
                rows.append([TIER_NAMES[tier], system.name, "-", "n/a (no such tier)", ""])
                continue
            rows.append(
                [TIER_NAMES[tier], system.name, str(latency.n), fmt_ms(latency.p50), fmt_ms(latency.p99)]
            )
    print(format_table([f"{task}: tier", "system", "n", "p50 ms", "p99 ms"], rows))


def print_ratios(
    keys: dict[str, KeyTimes], latencies: dict[str, dict[tuple[str, str], Latency]], peers: Sequence[str]
) -> None:
    rows = []
    for task in TASKS:
        times, lat = keys[task], latencies[task]
        for peer in peers:
            cells = [
                f"{task} vs {peer}",
                ratio(times.peers[peer].hash_only, times.ours_canonical.hash_only),
                ratio(times.peers[peer].from_input, times.ours_raw.from_input),
            ]
            for tier in ("l1", "l2"):
                ours, theirs = lat.get(("ours", tier)), lat.get((peer, tier))
                cells.append(ratio(theirs.p50 if theirs else None, ours.p50 if ours else None))
                cells.append(ratio(theirs.p99 if theirs else None, ours.p99 if ours else None))
            rows.append(cells)
    headers = ["peer time / our time", "key: hash", "key: from input", "L1 p50", "L1 p99", "L2 p50", "L2 p99"]
    print(format_table(headers, rows))
    print(
        "key: hash = hashing alone (ours: the canonical pixels or cleaned text).\n"
        "key: from input = from the received bytes or str (ours: the raw-input key, which answers every\n"
        "repeat request; the peers: decode / transform / tokenize, then hash). >1x: ours is faster."
    )


def check_agreement(systems: Sequence[System], task: str, inputs: Sequence[Any]) -> str:
    """Every system should give the same top label for every input."""
    disagreements = 0
    for raw in inputs:
        labels = {system.classify(task, raw)[0].top_label for system in systems}
        disagreements += len(labels) > 1
    return "all systems agree" if not disagreements else f"{disagreements} inputs disagree"


# ---- setup ---------------------------------------------------------------------------------


def start_redis(stack: ExitStack, workdir: Path) -> EmbeddedRedis:
    """A private redis-server on a free loopback port, stopped when `stack` closes."""
    server = EmbeddedRedis(data_dir=workdir / "redis", maxmemory_mb=256, port=free_port(), save=False)
    server.start()
    stack.callback(server.close)
    return server


def start_systems(
    stack: ExitStack, models: Models, server: EmbeddedRedis, workdir: Path, device: str
) -> tuple[Ours, CommonRecipe, GrCache]:
    settings = our_settings(server.url, workdir / "data", device)
    recipe_url = f"{server.url.rsplit('/', 1)[0]}/{RECIPE_REDIS_DB}"
    systems = (
        Ours(models, settings),
        CommonRecipe(models, recipe_url, name=RECIPE),
        GrCache(models, max_memory=settings.cache.l1_max_bytes, name=GRADIO),
    )
    for system in systems:
        stack.callback(system.close)
    return systems


def run(profile: Profile, device: str) -> None:
    image, text = load_real_models(device)
    models = counting({"image": image, "text": text})
    photos = list(load_photos().values())
    inputs: dict[str, Sequence[Any]] = {"image": photos, "text": MESSAGES}
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-cache-")))
        server = start_redis(stack, workdir)
        systems = start_systems(stack, models, server, workdir, device)
        print(
            f"device: {image.device} | torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
            f" | {len(photos)} photos, {len(MESSAGES)} messages | redis-server {server.url}"
            f" | {profile}"
        )
        print(f"at start: {host_load()}")
        keys = {
            "image": image_key_times(models, systems[1], photos, profile.key_repeats),
            "text": text_key_times(models, systems[1], MESSAGES, profile.key_repeats),
        }
        latencies = {task: measure_tiers(systems, task, inputs[task], profile) for task in TASKS}
        print(f"at end:   {host_load()}")
        for task in TASKS:
            print()
            print_key_times(task, keys[task])
            print()
            print_tiers(task, systems, latencies[task])
            print(f"answers: {check_agreement(systems, task, inputs[task])}")
        print()
        print_ratios(keys, latencies, [RECIPE, GRADIO])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"fewer iterations: {QUICK}")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch intra-op threads (default: torch's)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if find_redis_server() is None:
        print("redis-server is not installed: `apt-get install -y redis-server`.", file=sys.stderr)
        return 2
    set_threads(args.threads)
    run(QUICK if args.quick else FULL, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
