"""What collision-resistant cache keys cost: BLAKE3-128 (the keys now) against xxh3-128 (the
keys before, which can be made to collide: bench/collisions.py), side by side in one run.

Three views, each alternating the two hashes round by round so that both see the same load:

1. hashing alone: a short and a long message, the photos' upload bytes (the raw key every
   repeat request computes), their decoded pixels (the canonical key a first request
   computes) and a decoded 12-megapixel picture (36 MB);
2. in process: `engine.classify` L1 hits (text, image) and image misses, the engine's digest
   function swapped between the two hashes;
3. over HTTP: REST (`/v2/models/{task}/infer`) L1 hits on the served app, the same swap.

    .venv/bin/python -m bench.key_hash [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import blake3
import httpx
import numpy as np
import xxhash

import engine.cache.keys
import engine.pipeline.service
from bench.models import MESSAGES, format_table, interleaved_samples, load_photos
from engine.cache.keys import DIGEST_BYTES, KEY_SCHEME
from runtime import build_runtime, load_models
from settings import Settings
from storage.redis.embedded import free_port
from testing.oip_http import infer_body
from ui.server import serve_runtime

Digest = Callable[[Iterable[bytes | memoryview]], str]


def _xxh3(parts: Iterable[bytes | memoryview]) -> str:
    hasher = xxhash.xxh3_128()
    for part in parts:
        hasher.update(part)
    return "x3" + hasher.hexdigest()


def _blake3(parts: Iterable[bytes | memoryview]) -> str:
    hasher = blake3.blake3()
    for part in parts:
        hasher.update(part)
    return KEY_SCHEME + hasher.hexdigest(length=DIGEST_BYTES)


HASHES: dict[str, Digest] = {"xxh3-128 (before)": _xxh3, "BLAKE3-128 (now)": _blake3}


@contextlib.contextmanager
def keyed_by(digest: Digest) -> Iterator[None]:
    """The engine's keys from `digest` while inside (engine.cache.keys.raw_digest looks it up there)."""
    saved = engine.cache.keys.digest_parts, engine.pipeline.service.digest_parts
    engine.cache.keys.digest_parts = engine.pipeline.service.digest_parts = digest
    try:
        yield
    finally:
        engine.cache.keys.digest_parts, engine.pipeline.service.digest_parts = saved


def side_by_side(cases: dict[str, Callable[[Digest], object]], *, repeats: int) -> list[list[str]]:
    """One row per case: median ms under each hash and the difference, sampled in turn."""
    fns = {}
    for case, run in cases.items():
        for name, digest in HASHES.items():

            def call(run: Callable[[Digest], object] = run, digest: Digest = digest) -> object:
                with keyed_by(digest):
                    return run(digest)

            fns[(case, name)] = call
    samples = interleaved_samples(fns, repeats=repeats, warmup=2)
    rows = []
    for case in cases:
        before, now = (statistics.median(samples[(case, name)]) for name in HASHES)
        rows.append([case, f"{before:.4f}", f"{now:.4f}", f"{now - before:+.4f}", f"{now / before:.2f}x"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    repeats = 30 if args.quick else 200
    headers = ["median ms", *HASHES, "difference", "ratio"]

    photos = list(load_photos().values())
    settings = Settings.from_env({}).changed(
        server__data_dir=Path(tempfile.mkdtemp()), redis__url="off", quality__shadow_sample_rate=0.0,
        server__admin_token="bench-token",
    )  # fmt: skip
    models = load_models(settings)
    pixels = [models["image"].canonicalize(raw) for raw in photos]
    big = np.random.default_rng(0).integers(0, 256, size=(3000, 4000, 3), dtype=np.uint8)
    long_message = (MESSAGES[0] + " ") * (settings.limits.max_text_chars // (len(MESSAGES[0]) + 1))

    def each(item: object, part: Callable[[object], list]) -> Callable[[Digest], object]:
        return lambda digest: digest(part(item))

    def text_parts(message: object) -> list:
        return [b"str:", str(message).encode()]

    print("1. Hashing alone (per input; photos: scikit-image's, as uploaded and as decoded)")
    rows = side_by_side(
        {
            "message, short (raw key)": each(MESSAGES[0], text_parts),
            f"message, {len(long_message)} chars (raw key)": each(long_message, text_parts),
            f"photo upload, {len(photos[0]) // 1000} KB (raw key, every repeat)": each(
                photos[0], lambda b: [b"bytes:", b]
            ),
            "photo decoded pixels (canonical key, first request)": each(
                pixels[0], lambda c: c.fingerprint_parts()
            ),
            "12-megapixel decoded pixels, 36 MB": each(big, lambda p: [b"rgb8:", memoryview(p).cast("B")]),
        },
        repeats=repeats,
    )
    print(format_table(headers, rows))

    runtime = build_runtime(settings, models=models)
    try:
        classify = runtime.engine.classify

        def miss(_: Digest) -> object:
            runtime.engine.flush("l1")  # no L2 here: every round decodes and runs the model
            return classify("image", photos[0])

        print("\n2. In process: engine.classify")
        rows = side_by_side(
            {
                "text L1 hit": lambda _: classify("text", MESSAGES[1]),
                "image L1 hit (upload bytes)": lambda _: classify("image", photos[1]),
            },
            repeats=max(10, repeats // 10),
        )
        rows += side_by_side({"image miss (decode, key, model)": miss}, repeats=max(10, repeats // 10))
        print(format_table(headers, rows))

        server = serve_runtime(runtime, port=free_port())
        try:
            client = httpx.Client(base_url=server.url, timeout=60)

            def rest(task: str, raw: str | bytes) -> Callable[[Digest], object]:
                body = infer_body(raw)
                return lambda _: client.post(f"/v2/models/{task}/infer", json=body).raise_for_status()

            print("\n3. Over HTTP: REST L1 hits, one keep-alive client")
            rows = side_by_side(
                {"REST text hit": rest("text", MESSAGES[2]), "REST image hit": rest("image", photos[2])},
                repeats=repeats,
            )
            print(format_table(headers, rows))
            client.close()
        finally:
            server.close()
    finally:
        runtime.close()


if __name__ == "__main__":
    main()
