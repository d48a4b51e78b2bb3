"""The inputs (distinct uploads and support messages from a seed) and the request streams over them."""

from __future__ import annotations

import functools
import hashlib
import io
import multiprocessing
import os
import pickle
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.models import PHOTOS, photo_dir
from bench.workload.config import IMAGES, MESSAGES, SEED, UNIQUE_SHARE, ZIPF_S, Job

INPUTS_VERSION = 1  # bump when the generators below change what they make
IMAGE_SOURCES = (*PHOTOS, "motorcycle_left.png", "retina.jpg", "coins.png", "moon.png")
MAX_SIDE = 640  # derived images are at most this wide or high
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
