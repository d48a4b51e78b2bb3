"""What the two real models cost on this machine, step by step.

For the image model (EfficientNet-Lite0): decoding the uploaded bytes into
canonical pixels and the torchvision transform (resize, crop, normalise), per
photo; then the network's forward pass and the whole `predict_batch` at batch 1
and batch 8. For the text model (MiniLM intents): cleaning and tokenization,
then the same forward / `predict_batch` figures. Every figure is the median of
`--repeats` runs after `--warmup` untimed ones; the figures are sampled in turn
(round-robin), so load from other processes spreads over all of them. The load
average is printed before and after: when it exceeds the CPU count, every
figure is inflated.

Inputs are scikit-image's bundled photos and a handful of support messages.

    .venv/bin/python -m bench.models [--repeats 20] [--warmup 3] [--device auto|cpu|cuda] [--threads N]

`bench.cache` reuses the inputs, the timing helpers and the forward helpers below.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.inputs import CanonicalImage, CanonicalText
from engine.models.image import ImageClassifier
from engine.models.text import MAX_TOKENS, TextClassifier
from runtime import load_models
from settings import Settings

# Eight photos, so that batch 8 holds eight different pictures (camera.png is greyscale).
PHOTOS = (
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "astronaut.png",
    "motorcycle_right.png",
    "hubble_deep_field.jpg",
    "ihc.png",
    "camera.png",
)

MESSAGES = (
    "Where is my order? It was supposed to arrive on Monday.",
    "I was charged twice for the same order",
    "Can I talk to a real person please?",
    "The blender arrived with a cracked jar",
    "I forgot my password and can't log in",
    "These shoes don't fit, I'd like to send them back",
    "Please cancel the order I placed this morning",
    "Hello, is anybody there?",
)

BATCH_SIZES = (1, 8)
# Benchmarks and the fault suite count two answers as the same when their labels match and
# their scores are within this: a text miss computed in a batch (engine.capacity.batching) differs from
# its one-at-a-time scores in the last bits.
SCORE_TOLERANCE = 1e-5

K = TypeVar("K", bound=Hashable)
Figure = tuple[str, str, str | int]  # (task, step, photo name or batch size)


# ---- inputs -----------------------------------------------------------------


def photo_dir() -> Path:
    import skimage

    return Path(skimage.__file__).parent / "data"


def load_photos(names: Sequence[str] = PHOTOS) -> dict[str, bytes]:
    """The photos' file bytes, exactly as a user would upload them."""
    folder = photo_dir()
    return {name: (folder / name).read_bytes() for name in names}


def load_real_models(device: str, backend: str = "torch") -> tuple[ImageClassifier, TextClassifier]:
    """Both real models, as the app loads them (with default settings) but by default on torch:
    the benchmarks' baselines are plain torch, as a user's own app runs; `backend="auto"` is
    what the app itself serves with (engine.models.onnx_backend)."""
    _quiet_transformers()
    models = load_models(
        Settings.from_env({}).changed(models__device=device, models__inference_backend=backend),
    )
    image, text = models["image"], models["text"]
    assert isinstance(image, ImageClassifier) and isinstance(text, TextClassifier)
    return image, text


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency of the text model
        pass


# ---- timing -----------------------------------------------------------------


def synchronizer(device: str) -> Callable[[], None]:
    """A call that waits for queued GPU work, so a timer stops when the work is done."""
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def sample_ms(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
) -> list[float]:
    """Run `fn` `warmup` times untimed, then `repeats` times; each run's milliseconds."""
    return interleaved_samples({0: fn}, repeats=repeats, warmup=warmup, sync=sync)[0]


def interleaved_samples(
    fns: Mapping[K, Callable[[], object]],
    *,
    repeats: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[K, list[float]]:
    """Milliseconds per run of each function, taken round-robin (all of them once, `repeats`
    times over), so a burst of load from a neighbour spreads over every figure instead of
    spoiling one."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            sync()
    samples: dict[K, list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            started = time.perf_counter_ns()
            fn()
            sync()
            samples[key].append((time.perf_counter_ns() - started) / 1e6)
    return samples


def median_ms(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
) -> float:
    return statistics.median(sample_ms(fn, repeats=repeats, warmup=warmup, sync=sync))


def host_load() -> str:
    """The 1-minute load average against the CPU count: above it, figures are inflated."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    warning = (
        " (busy: other processes compete for the CPUs; --threads 1 suffers least)"
        if load > cpus * 0.75
        else ""
    )
    return f"load average {load:.2f} on {cpus} CPUs{warning}"


def fmt_ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value < 1:
        return f"{value:#.3g}"  # three significant digits: microseconds stay visible
    if value < 100:
        return f"{value:.2f}"
    return f"{value:.0f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(cells[0]).ljust(widths[0])]
        parts += [str(cell).rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


# ---- the models' steps --------------------------------------------------------
# The Classifier interface has no "forward only" entry point; these helpers reach
# into the loaded modules so the network can be timed apart from preprocessing.


def image_batch(model: ImageClassifier, canonicals: Sequence[CanonicalImage]) -> torch.Tensor:
    """The (N, 3, 224, 224) float batch `predict_batch` feeds the network."""
    return torch.stack([model.preprocess(image) for image in canonicals])


def image_forward(model: ImageClassifier, batch: torch.Tensor) -> torch.Tensor:
    """The network alone on a ready batch (including the copy to the device); logits."""
    with torch.inference_mode():
        return model._model(batch.to(model._torch_device, dtype=model._dtype))


def tokenize(model: TextClassifier, texts: Sequence[str]) -> Any:
    """Tokenization exactly as `TextClassifier` does it (padded to the longest message)."""
    return model._tokenizer(
        list(texts), padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
    )


def text_forward(model: TextClassifier, encoded: Any) -> torch.Tensor:
    """The transformer alone on tokenized input (including the copy to the device)."""
    with torch.inference_mode():
        return model._model(**encoded.to(model._torch_device)).last_hidden_state


# ---- the benchmark ------------------------------------------------------------


def image_figures(model: ImageClassifier, photos: Mapping[str, bytes]) -> dict[Figure, Callable[[], object]]:
    figures: dict[Figure, Callable[[], object]] = {}
    canonicals = []
    for name, raw in photos.items():
        canonical = model.canonicalize(raw)
        canonicals.append(canonical)
        figures[("image", "decode", name)] = functools.partial(model.canonicalize, raw)
        figures[("image", "transform", name)] = functools.partial(model.preprocess, canonical)
    for size in BATCH_SIZES:
        batch = image_batch(model, canonicals[:size])
        figures[("image", "forward", size)] = functools.partial(image_forward, model, batch)
        figures[("image", "predict", size)] = functools.partial(model.predict_batch, canonicals[:size])
    return figures


def text_figures(model: TextClassifier, messages: Sequence[str]) -> dict[Figure, Callable[[], object]]:
    figures: dict[Figure, Callable[[], object]] = {}
    for size in BATCH_SIZES:
        raw = list(messages[:size])
        texts = [model.canonicalize(message).text for message in raw]
        canonicals = [CanonicalText(text) for text in texts]
        figures[("text", "clean", size)] = functools.partial(_clean_each, model, raw)
        figures[("text", "tokenize", size)] = functools.partial(tokenize, model, texts)
        figures[("text", "forward", size)] = functools.partial(text_forward, model, tokenize(model, texts))
        figures[("text", "predict", size)] = functools.partial(model.predict_batch, canonicals)
    return figures


def _clean_each(model: TextClassifier, messages: Sequence[str]) -> list[CanonicalText]:
    return [model.canonicalize(message) for message in messages]


def image_tables(model: ImageClassifier, photos: Mapping[str, bytes], medians: Mapping[Figure, float]) -> str:
    photo_rows = []
    for name, raw in photos.items():
        height, width, _ = model.canonicalize(raw).shape
        photo_rows.append(
            [
                name,
                f"{width}x{height}",
                f"{len(raw) / 1024:.0f}",
                fmt_ms(medians[("image", "decode", name)]),
                fmt_ms(medians[("image", "transform", name)]),
            ]
        )
    headers = ["photo", "size", "KiB", "decode (canonicalize)", "transform (to 3x224x224)"]
    batch_rows = [
        ["forward (network only)", *per_batch_cells(medians, "image", "forward")],
        ["predict_batch (transform + forward + top-5)", *per_batch_cells(medians, "image", "predict")],
    ]
    return "\n\n".join(
        [
            format_table(headers, photo_rows),
            format_table(["step", "batch 1", "batch 8", "per image at 8"], batch_rows),
        ]
    )


def text_table(medians: Mapping[Figure, float]) -> str:
    rows = [
        ["cleaning (NFKC, controls, whitespace; one by one)", *per_batch_cells(medians, "text", "clean")],
        ["tokenization", *per_batch_cells(medians, "text", "tokenize")],
        ["forward (transformer only)", *per_batch_cells(medians, "text", "forward")],
        ["predict_batch (tokenize + forward + pool + top-5)", *per_batch_cells(medians, "text", "predict")],
    ]
    return format_table(["step", "batch 1", "batch 8", "per message at 8"], rows)


def per_batch_cells(medians: Mapping[Figure, float], task: str, step: str) -> list[str]:
    """batch 1 ms, batch 8 ms, and batch 8's cost per item."""
    one, many = (medians[(task, step, size)] for size in BATCH_SIZES)
    return [fmt_ms(one), fmt_ms(many), fmt_ms(many / BATCH_SIZES[1])]


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads (None: torch's default, what the app runs with).

    On a loaded machine several threads wait on each other at every op and the
    forward pass can slow down tenfold; one thread degrades gracefully."""
    if threads is not None:
        torch.set_num_threads(threads)


def run(repeats: int, warmup: int, device: str) -> None:
    image, text = load_real_models(device)
    photos = load_photos()
    figures = {**image_figures(image, photos), **text_figures(text, MESSAGES)}
    print(
        f"device: {image.device} | torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
        f" | median of {repeats} runs after {warmup} warm-up runs, all figures interleaved | times in ms"
    )
    print(f"at start: {host_load()}")
    samples = interleaved_samples(figures, repeats=repeats, warmup=warmup, sync=synchronizer(image.device))
    medians = {figure: statistics.median(values) for figure, values in samples.items()}
    print(f"at end:   {host_load()}")
    print()
    print(f"Image model: {image.name} (version {image.version})")
    print()
    print(image_tables(image, photos, medians))
    print()
    print(f"Text model: {text.name} (version {text.version}), {len(MESSAGES)} support messages")
    print()
    print(text_table(medians))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per figure (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before each figure (default 3)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1):
        parser.error("--repeats and --threads must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    run(args.repeats, args.warmup, args.device)


if __name__ == "__main__":
    main()


def positive_int(text: str) -> int:
    """argparse type for counts such as --threads: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value
