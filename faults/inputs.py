"""The load's inputs and their reference answers, computed with the real models."""

from __future__ import annotations

import io
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from bench.models import MESSAGES, PHOTOS, load_photos
from engine.errors import InvalidInputError
from engine.models.base import Classifier


@dataclass(frozen=True)
class Expect:
    kind: str  # "answer" | "error" (this message) | "any_error" (a clear refusal) | "any" (either)
    labels: tuple[tuple[str, float], ...] = ()
    message: str | None = None
    model_s: float = 0.0  # the reference's forward time, here


@dataclass(frozen=True)
class Case:
    id: str
    task: str
    raw: Any
    expect: Expect
    name: str = "upload.png"
    group: str = ""


class Oracle:
    """Reference answers from the real models, computed the way the engine computes a miss."""

    def __init__(self, models: dict[str, Classifier]) -> None:
        self.models = models
        self.versions = {task: model.version for task, model in models.items()}
        self._lock = threading.Lock()

    def expect(self, task: str, raw: Any) -> Expect:
        model = self.models[task]
        if task == "text":
            # What the callback receives: the JSON round trip, then Textbox's str(), None as "".
            raw = json.loads(json.dumps(raw))
            raw = "" if raw is None else str(raw)
        try:
            canonical = model.canonicalize(raw)
        except InvalidInputError as exc:
            return Expect("error", message=exc.message)
        with self._lock:
            started = time.perf_counter()
            prediction = model.predict_batch([canonical])[0]
            elapsed = time.perf_counter() - started
        return Expect("answer", labels=prediction.labels, model_s=elapsed)

    def case(self, case_id: str, task: str, raw: Any, *, name: str = "upload.png", group: str = "") -> Case:
        return Case(case_id, task, raw, self.expect(task, raw), name=name, group=group)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def image_variants(count: int, seed: int, side: int = 112) -> list[tuple[str, bytes]]:
    """Distinct small PNGs: random square crops of the bundled photos."""
    rng = random.Random(seed)
    photos = {name: Image.open(io.BytesIO(data)).convert("RGB") for name, data in load_photos().items()}
    seen: set[bytes] = set()
    out = []
    while len(out) < count:
        name = PHOTOS[len(out) % len(PHOTOS)]
        photo = photos[name]
        width, height = photo.size
        crop = rng.randint(min(width, height) // 3, min(width, height))
        x, y = rng.randint(0, width - crop), rng.randint(0, height - crop)
        data = png_bytes(photo.crop((x, y, x + crop, y + crop)).resize((side, side)))
        if data not in seen:
            seen.add(data)
            out.append((f"{Path(name).stem}-{len(out)}.png", data))
    return out


TEXT_SUFFIXES = (
    "",
    " Thanks.",
    " Order {n}.",
    " It's urgent!",
    " (ticket #{n})",
    " Please help.",
    " Ref {n}",
    " I have been waiting {n} days.",
    " Can you check?",
    " My account is {n}.",
)


def text_variants(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    extra = (
        "My parcel never arrived",
        "How do I reset my password?",
        "I want my money back",
        "The app keeps crashing on login",
        "Do you ship to Canada?",
        "Thank you so much, bye",
    )
    stems = list(MESSAGES) + list(extra)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < count:
        text = rng.choice(stems) + rng.choice(TEXT_SUFFIXES).format(n=rng.randint(1, 99_999))
        if text.lower() not in seen:
            seen.add(text.lower())
            out.append(text)
    return out


def probe_texts() -> Iterator[str]:
    """Texts never sent before (a counter in each), for recovery probes."""
    stems = [*MESSAGES, "My parcel never arrived", "How do I reset my password?"]
    for n in range(10**9):
        yield f"{stems[n % len(stems)]} (probe {n})"
