"""A user's own Hugging Face classifier, from a folder written by `save_pretrained`.

Text: `AutoModelForSequenceClassification` + `AutoTokenizer`; image:
`AutoModelForImageClassification` + `AutoImageProcessor`; class names from `id2label`;
local files only (nothing is downloaded).

The served answer must be what the model itself gives for the input, so canonicalisation
never changes what the model sees:
- text: the key hashes the token ids the tokenizer makes of the message as typed (the
  model's whole input). Two messages share an entry exactly when the model cannot tell
  them apart: case folds only where the tokenizer is uncased, spacing only where the
  tokenizer ignores it.
- image: decoded and EXIF-oriented RGB pixels as for the built-in model (engine.inputs),
  then the model's own image processor.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import InvalidInputError, ModelError, ModelLoadError
from engine.inputs import CanonicalImage, canonicalize_image
from engine.models.base import TOP_K, Prediction, top_predictions
from engine.models.device import describe, in_owned_memory, select_device
from engine.models.onnx_backend import BackendSeam, ExportPlan, NamedOutput

log = logging.getLogger(__name__)

# Files that never change what the model computes (docs, training leftovers).
_IGNORED = {"README.md", "training_args.bin", ".gitattributes"}
_DEFAULT_MAX_TOKENS = 512  # when neither the tokenizer nor the config says
# What a tokenizer is saved as (any one). Without them transformers still makes one: the
# model type's class with only its special tokens, so every word would be the unknown token.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")  # fmt: skip


def folder_digest(folder: Path, *extra: str) -> str:
    """sha256 over every file in the folder (names and bytes, sorted) and the serving settings."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name in _IGNORED or name.startswith("."):
            continue
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes())
    digest.update("|".join(extra).encode())
    return digest.hexdigest()[:16]


def _labels(config: Any, count: int, folder: Path) -> tuple[str, ...]:
    id2label = getattr(config, "id2label", None) or {}
    names = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(count))
    if len(set(names)) != len(names):
        raise ModelLoadError(f"{folder}: id2label has duplicate class names")
    return names


def _position_offset(model: torch.nn.Module) -> int:
    """Positions a RoBERTa-style model never gives a token: it numbers them from padding_idx + 1
    (roberta-base: 514 position embeddings, 512 tokens)."""
    embeddings = getattr(getattr(model, "base_model", None), "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    index = getattr(table, "padding_idx", None)
    return index + 1 if isinstance(table, torch.nn.Embedding) and isinstance(index, int) else 0


@dataclass(frozen=True)
class TokenizedText:
    """A message as typed and the token ids the model sees for it (what the key hashes)."""

    text: str
    ids: tuple[int, ...]

    def fingerprint_parts(self) -> tuple[bytes, bytes]:
        return b"tokens:", np.asarray(self.ids, dtype=np.int64).tobytes()


PROBE_MESSAGES = ("Hello, is this thing on?", "Where is my refund?", "The parcel never arrived at my house.",
                  "  Hallo, wie geht's? ﬁne ☃", "ok", "the parcel never arrived " * 40)  # fmt: skip


class _Base(BackendSeam):
    kind: str
    name: str
    version: str
    device: str

    def __init__(self, *, task: str, folder: Path, device: str, top_k: int | None,
                 max_batch: int | None, ttl_s: int | None) -> None:  # fmt: skip
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"no model folder at {folder} (config.json not found)")
        self.task = task
        self.folder = folder
        self.name = folder.name
        self._torch_device = select_device(device)
        self.device = describe(self._torch_device)
        self.top_k = top_k or TOP_K
        self.max_batch = max_batch
        self.ttl_s = ttl_s

    def _finish_load(self, model: torch.nn.Module) -> None:
        self._model = in_owned_memory(model.eval().to(self._torch_device))
        count = int(getattr(model.config, "num_labels", 0) or 0)
        if count < 1:
            raise ModelLoadError(f"{self.folder}: the model has no classes (num_labels)")
        self.labels = _labels(model.config, count, self.folder)
        self.version = folder_digest(self.folder, self.kind, f"top_k={self.top_k}", "fp32")

    def _top(self, logits: torch.Tensor) -> list[Prediction]:
        return top_predictions(logits.detach().float().cpu().numpy(), self.labels, self.top_k)

    def _check_serving(self) -> None:
        if self._model.training:
            raise ModelError("refusing to serve a model in training mode")


class HFTextClassifier(_Base):
    kind = "text-classification"
    cheap_canonicalize = True  # a fast tokenizer: tens of microseconds
    batch_misses = True

    def __init__(self, *, task: str, folder: Path, device: str = "auto", max_text_chars: int,
                 top_k: int | None = None, max_batch: int | None = None,
                 ttl_s: int | None = None) -> None:  # fmt: skip
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        super().__init__(
            task=task, folder=folder, device=device, top_k=top_k, max_batch=max_batch, ttl_s=ttl_s
        )
        self._max_text_chars = max_text_chars
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            raise ModelLoadError(f"{folder}: no tokenizer saved there (tokenizer.save_pretrained)")
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # transformers raises many types for a broken folder
            raise ModelLoadError(f"{folder}: cannot load a text classifier: {exc}") from exc
        positions = getattr(model.config, "max_position_embeddings", None)
        if isinstance(positions, int):
            positions -= _position_offset(model)
        limits = [getattr(self._tokenizer, "model_max_length", None), positions]
        usable = [n for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
        self._max_tokens = min(usable) if usable else _DEFAULT_MAX_TOKENS
        # Misses share one padded forward pass only where padding cannot change an answer: padded
        # on the right with the token the model itself takes for padding (a GPT-2 style classifier
        # reads the last token that is not it; GPT-2 ships with none). Otherwise one input a pass.
        pad = self._tokenizer.pad_token_id
        self._pads = pad is not None and pad == getattr(model.config, "pad_token_id", None)
        self._finish_load(model)
        log.info("loaded %s (%s) %s on %s", self.task, self.folder, self.version, self.device)

    def canonicalize(self, raw: Any) -> TokenizedText:
        if not isinstance(raw, str):
            raise InvalidInputError("not_text", "Please type a message.")
        if not raw.strip():
            raise InvalidInputError("empty_text", "Please type a message.")
        if len(raw) > self._max_text_chars:
            raise InvalidInputError(
                "text_too_long",
                f"The message has {len(raw):,} characters; the limit is {self._max_text_chars:,}.",
            )
        ids = self._tokenizer(raw, truncation=True, max_length=self._max_tokens)["input_ids"]
        return TokenizedText(raw, tuple(int(i) for i in ids))

    def predict_batch(self, inputs: Sequence[TokenizedText]) -> list[Prediction]:
        self._check_serving()
        if not inputs:
            return []
        if len(inputs) > 1 and not self._pads:
            return [answer for item in inputs for answer in self.predict_batch([item])]
        encoded = self._tokenizer(
            [item.text for item in inputs], padding=self._pads, padding_side="right", truncation=True,
            max_length=self._max_tokens, return_tensors="pt",
        ).to(self._torch_device)  # fmt: skip
        with torch.inference_mode():
            return self._top(self._pass(encoded))

    def _torch_pass(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._model(**tensors).logits

    def export_plan(self) -> ExportPlan:
        texts = ["probe", "a longer probe message"] if self._pads else ["a probe message"]
        encoded = self._tokenizer(texts, padding=self._pads, padding_side="right", return_tensors="pt")
        names = list(encoded.keys())
        dynamic = {name: {0: "batch", 1: "tokens"} for name in [*names, "output"]}
        return ExportPlan(NamedOutput(self._model, names, "logits"), dict(encoded), dynamic)

    def probe_inputs(self) -> list[TokenizedText]:
        return [self.canonicalize(m[: self._max_text_chars]) for m in PROBE_MESSAGES]


class HFImageClassifier(_Base):
    kind = "image-classification"
    cheap_canonicalize = False  # decoding is real work

    def __init__(self, *, task: str, folder: Path, device: str = "auto", max_upload_bytes: int,
                 max_image_pixels: int, top_k: int | None = None, max_batch: int | None = None,
                 ttl_s: int | None = None) -> None:  # fmt: skip
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        super().__init__(
            task=task, folder=folder, device=device, top_k=top_k, max_batch=max_batch, ttl_s=ttl_s
        )
        self.batch_misses = self._torch_device.type == "cuda"  # as the built-in (engine.capacity.batching)
        self._max_upload_bytes = max_upload_bytes
        self._max_image_pixels = max_image_pixels
        try:
            self._processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
            model = AutoModelForImageClassification.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:
            raise ModelLoadError(f"{folder}: cannot load an image classifier: {exc}") from exc
        self._finish_load(model)
        log.info("loaded %s (%s) %s on %s", self.task, self.folder, self.version, self.device)

    def canonicalize(self, raw: Any) -> CanonicalImage:
        return canonicalize_image(raw, max_bytes=self._max_upload_bytes, max_pixels=self._max_image_pixels)

    def predict_batch(self, inputs: Sequence[CanonicalImage]) -> list[Prediction]:
        self._check_serving()
        if not inputs:
            return []
        # A copy each: the canonical pixels are read-only (the key, the warm set and shadow checks
        # share them) and a user's processor may work in place on what it is given.
        # Channels last, said: left to guess, a processor takes an image 1 or 3 pixels high for
        # channels first.
        pixels = self._processor(
            images=[image.pixels.copy() for image in inputs], input_data_format="channels_last",
            return_tensors="pt",
        )["pixel_values"]  # fmt: skip
        with torch.inference_mode():
            return self._top(self._pass({"pixel_values": pixels.to(self._torch_device)}))

    def _torch_pass(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._model(**tensors).logits

    def export_plan(self) -> ExportPlan:
        pixels = self._processor(images=[np.zeros((64, 64, 3), dtype=np.uint8)] * 2,
                                 input_data_format="channels_last", return_tensors="pt")["pixel_values"]
        # Height and width too: a processor that resizes without cropping gives each image its size.
        dynamic = {"pixel_values": {0: "batch", 2: "height", 3: "width"}, "output": {0: "batch"}}
        return ExportPlan(NamedOutput(self._model, ["pixel_values"], "logits"), {"pixel_values": pixels},
                          dynamic)  # fmt: skip

    def probe_inputs(self) -> list[CanonicalImage]:
        from engine.models.image import probe_images

        return probe_images(self.canonicalize)
