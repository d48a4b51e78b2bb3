"""What trust costs, side by side in one run: signing L2 values (HMAC) against the unsigned
checksum; cache hits with shadow verification off and on; and how far the real models'
numerics move on this machine (batch size, intra-op threads), against the tolerance
shadow verification applies.

    .venv/bin/python -m bench.trust            # ~1-2 min on 2 CPUs
    .venv/bin/python -m bench.trust --hits 4000 --values 20000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.models import MESSAGES, load_photos
from engine.cache.codec import CHECKSUM_CODEC, CachedResult, ValueCodec
from engine.models.base import Classifier, Prediction
from engine.quality.shadow import SCORE_TOLERANCE
from settings import Settings

PACE_S = 0.001
KEY = "infcache:text:0123456789abcdef:0:" + "ab" * 16


def _per_value_us(fn: Callable[[], Any], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def codec_cost(values: int, rounds: int = 5) -> None:
    value = CachedResult(
        Prediction(tuple((f"class_{i}", 0.5 / (i + 1)) for i in range(5))), "0123456789abcdef", time.time()
    )
    signed = ValueCodec([b"bench-signing-key-" + b"k" * 32, b"bench-old-key-" + b"o" * 32])
    blobs = {"checksum": CHECKSUM_CODEC.encode(value, key=KEY), "hmac": signed.encode(value, key=KEY)}
    codecs = {"checksum": CHECKSUM_CODEC, "hmac": signed}
    best: dict[tuple[str, str], float] = {}
    for _ in range(rounds):  # interleaved, best of rounds: the two see the same machine
        for name, codec in codecs.items():
            blob = blobs[name]
            for op, fn in (("encode", lambda c=codec: c.encode(value, key=KEY)),
                           ("decode", lambda c=codec, b=blob: c.decode(b, key=KEY))):  # fmt: skip
                us = _per_value_us(fn, values)
                best[(name, op)] = min(us, best.get((name, op), us))
    print(f"L2 value codec, per value (best of {rounds} x {values:,}; value {len(blobs['hmac'])} B signed, "
          f"{len(blobs['checksum'])} B unsigned):")  # fmt: skip
    for op in ("encode", "decode"):
        c, h = best[("checksum", op)], best[("hmac", op)]
        print(f"  {op}: checksum {c:.2f} us   hmac-sha256 {h:.2f} us   ratio {h / c:.2f}   (+{h - c:.2f} us)")


def shadow_hits(model: Classifier, hits: int, rates: Sequence[float]) -> None:
    """L1 hits one after another (the engine idle between them, so a sampled hit's check
    runs beside the next request), p50/p99 with each SHADOW_SAMPLE_RATE, interleaved."""
    from runtime import build_runtime

    defaults = Settings.from_env({})
    base = defaults.changed(redis__url="off", server__data_dir=defaults.server.data_dir / "bench-trust")
    texts = list(MESSAGES)
    results: dict[float, list[float]] = {rate: [] for rate in rates}
    checks: dict[float, int] = {}
    runtimes = {rate: build_runtime(base.changed(quality__shadow_sample_rate=rate), models={"text": model})
                for rate in rates}  # fmt: skip
    try:
        for runtime in runtimes.values():
            for text in texts:
                runtime.engine.classify("text", text)  # warm: every later request is an L1 hit
        for block in range(10):
            for rate, runtime in runtimes.items():
                for i in range(hits // 10):
                    started = time.perf_counter()
                    runtime.engine.classify("text", texts[(block + i) % len(texts)])
                    results[rate].append((time.perf_counter() - started) * 1e3)
                    time.sleep(PACE_S)  # a paced client: the gaps are when sampled checks run
        for rate, runtime in runtimes.items():
            shadow = runtime.engine.shadow
            stats = None if shadow is None else shadow.stats()
            checks[rate] = 0 if stats is None else sum(stats.checks.values()) + stats.dropped
    finally:
        for runtime in runtimes.values():
            runtime.close()
    print(f"L1 hits with shadow verification ({hits:,} per rate, real text model, one client):")
    base_p99 = None
    for rate, ms in results.items():
        q = statistics.quantiles(ms, n=100)
        base_p99 = base_p99 or q[98]
        print(f"  SHADOW_SAMPLE_RATE={rate:<5} p50 {q[49]:.3f} ms  p99 {q[98]:.3f} ms  "
              f"(p99 ratio {q[98] / base_p99:.2f})  sampled {checks[rate]}")  # fmt: skip


def numerics(models: dict[str, Classifier]) -> None:
    """Largest score difference between ways of computing the same answer on this device."""
    import torch

    from engine.quality.shadow import agree

    text = models["text"]
    canon = [text.canonicalize(t) for t in MESSAGES[:8]]
    one = [text.predict_batch([c])[0] for c in canon]
    batched = text.predict_batch(canon)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single_thread = [text.predict_batch([c])[0] for c in canon]
    finally:
        torch.set_num_threads(threads)
    image = models["image"]
    photos = [image.canonicalize(data) for data in load_photos().values()][:4]
    img_one = [image.predict_batch([p])[0] for p in photos]
    img_batched = image.predict_batch(photos)
    print(f"Numerics on {text.device} (tolerance {SCORE_TOLERANCE:g}):")
    pairs = (("text batch 1 vs 8", one, batched), (f"text threads {threads} vs 1", one, single_thread),
             ("image batch 1 vs 4", img_one, img_batched))  # fmt: skip
    for name, a, b in pairs:
        diff = max(_max_diff(x, y) for x, y in zip(a, b, strict=True))
        same = all(agree(x, y) for x, y in zip(a, b, strict=True))
        print(f"  {name}: max |score difference| {diff:.2e}, agree within tolerance: {same}")


def _max_diff(a: Prediction, b: Prediction) -> float:
    sb = dict(b.labels)
    return max(abs(score - sb.get(name, 0.0)) for name, score in a.labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=20_000, help="values per codec timing")
    parser.add_argument("--hits", type=int, default=3_000, help="hits per shadow rate")
    args = parser.parse_args()
    codec_cost(args.values)
    from runtime import load_models

    models = load_models(Settings.from_env({}).changed(models__device="cpu"))
    numerics(models)
    shadow_hits(models["text"], args.hits, (0.0, 0.01, 0.1))


if __name__ == "__main__":
    main()
