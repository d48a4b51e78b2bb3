"""MODELS_CONFIG: a user's own classifiers (tiny random models the tests save), served answers equal
to the model's own within 1e-5, and start-up refusing a bad config with the entry named."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from engine.models.config import DEFAULT_SPECS, ModelConfigError, load_config
from engine.models.loader import LoadOptions, load_all
from runtime import Runtime, build_runtime, load_models
from settings import Settings, SettingsError
from testing.tiny_models import IMAGE_LABELS, TEXT_LABELS, make_image_model, make_text_model, write_config


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "text": make_text_model(root / "sentiment"),
        "cased": make_text_model(root / "cased", seed=1, cased=True),
        "image": make_image_model(root / "shapes"),
    }


@pytest.fixture
def config_runtime(base_settings: Settings, tmp_path: Path) -> Iterator[Callable[..., Runtime]]:
    built: list[Runtime] = []

    def start(entries: list[dict[str, Any]], **overrides: Any) -> Runtime:
        config = write_config(tmp_path / f"models{len(built)}.yaml", entries)
        settings = base_settings.changed(
            server__data_dir=tmp_path / f"rt{len(built)}", models__models_config=config, **overrides,
        )
        runtime = build_runtime(settings, model_factory=load_models)
        built.append(runtime)
        return runtime

    yield start
    for runtime in reversed(built):
        runtime.close()


def own_text_scores(folder: Path, text: str) -> dict[str, float]:
    """What the model gives for `text`, computed here without the app."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.inference_mode():
        probs = torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits, dim=1)[0]
    return {model.config.id2label[i]: float(p) for i, p in enumerate(probs)}


def own_image_scores(folder: Path, data: bytes) -> dict[str, float]:
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForImageClassification.from_pretrained(str(folder), local_files_only=True).eval()
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    with torch.inference_mode():
        probs = torch.softmax(model(**processor(images=image, return_tensors="pt")).logits, dim=1)[0]
    return {model.config.id2label[i]: float(p) for i, p in enumerate(probs)}


def png(seed: int, size: tuple[int, int] = (48, 40)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def assert_same(served: dict[str, float], own: dict[str, float]) -> None:
    assert served, "no classes served"
    for label, score in served.items():
        assert abs(score - own[label]) <= 1e-5, (label, score, own[label])
    # top-k: the best classes, best first
    assert list(served) == sorted(own, key=own.__getitem__, reverse=True)[: len(served)]


def test_served_answers_are_the_models_own(
    config_runtime: Callable[..., Runtime], folders: dict[str, Path]
) -> None:
    runtime = config_runtime([
        {"task": "sentiment", "kind": "text-classification", "source": "transformers",
         "path": str(folders["text"]), "top_k": 2},
        {"task": "shapes", "kind": "image-classification", "source": "transformers",
         "path": str(folders["image"])},
    ])  # fmt: skip
    engine = runtime.engine
    assert set(engine.models) == {"sentiment", "shapes"}
    for text in ("Where is my refund?", "Hallo, wie geht's? ﬁne", "x" * 900):
        first = engine.classify("sentiment", text)
        assert first.tier == "miss" and len(first.prediction.labels) == 2
        assert_same(first.prediction.as_label_value(), own_text_scores(folders["text"], text))
        again = engine.classify("sentiment", text)
        assert again.tier == "l1" and again.prediction == first.prediction
    # An uncased tokenizer folds case and ignores spacing: the model sees one input, so one entry.
    a = engine.classify("sentiment", "Where is my refund?")
    b = engine.classify("sentiment", "  where   IS my refund?\t")
    assert a.key == b.key and b.tier == "l1"
    assert_same(b.prediction.as_label_value(), own_text_scores(folders["text"], "  where   IS my refund?\t"))
    for seed in (1, 2):
        data = png(seed)
        result = engine.classify("shapes", data)
        assert result.tier == "miss" and result.model == "shapes"
        assert_same(result.prediction.as_label_value(), own_image_scores(folders["image"], data))
        assert set(result.prediction.as_label_value()) <= set(IMAGE_LABELS)
    # The console, metrics and request log carry the task.
    assert set(runtime.engine.cache_state()["models"]) == {"sentiment", "shapes"}
    assert 'infcache_model_calls_total{task="sentiment"} 3.0' in runtime.metrics.render().decode()


def test_a_cased_tokenizer_keeps_case_apart(
    config_runtime: Callable[..., Runtime], folders: dict[str, Path]
) -> None:
    runtime = config_runtime([
        {"task": "cased", "kind": "text-classification", "source": "transformers",
         "path": str(folders["cased"])},
    ])  # fmt: skip
    upper = runtime.engine.classify("cased", "Refund NOW")
    lower = runtime.engine.classify("cased", "refund now")
    assert upper.key != lower.key and lower.tier == "miss"
    assert_same(upper.prediction.as_label_value(), own_text_scores(folders["cased"], "Refund NOW"))
    assert_same(lower.prediction.as_label_value(), own_text_scores(folders["cased"], "refund now"))
    assert set(upper.prediction.as_label_value()) <= set(TEXT_LABELS)


def test_default_is_the_two_builtins() -> None:
    assert Settings.from_env({}).models.models_config is None
    assert [(s.task, s.source) for s in DEFAULT_SPECS] == [
        ("image", "builtin:efficientnet-lite0"), ("text", "builtin:minilm-intents")
    ]  # fmt: skip


def test_missing_config_file_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="MODELS_CONFIG"):
        Settings.from_env({"MODELS_CONFIG": str(tmp_path / "nope.yaml")})


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (
            [{"task": "a", "kind": "audio-classification", "source": "transformers", "path": "x"}],
            r"entry 1 \(task 'a'\): unknown kind 'audio-classification'",
        ),
        (
            [
                {
                    "task": "a",
                    "kind": "text-classification",
                    "source": "transformers",
                    "path": "/nowhere/at/all",
                }
            ],
            r"entry 1 \(task 'a'\): no model folder at /nowhere/at/all",
        ),
        (
            [
                {"task": "image", "kind": "image-classification", "source": "builtin:efficientnet-lite0"},
                {"task": "image", "kind": "image-classification", "source": "builtin:efficientnet-lite0"},
            ],
            r"entry 2 \(task 'image'\): task 'image' is defined twice",
        ),
        (
            [{"task": "Bad:Name", "kind": "text-classification", "source": "builtin:minilm-intents"}],
            r"entry 1: task 'Bad:Name' must be",
        ),
        (
            [{"task": "t", "kind": "image-classification", "source": "builtin:minilm-intents"}],
            r"entry 1 \(task 't'\): builtin:minilm-intents is an text-classification model",
        ),
        (
            [{"task": "t", "kind": "text-classification", "source": "builtin:minilm-intents", "top_k": 0}],
            r"entry 1 \(task 't'\): top_k must be a positive integer",
        ),
        (
            [{"task": "t", "kind": "text-classification", "source": "huggingface-hub"}],
            r"entry 1 \(task 't'\): unknown source 'huggingface-hub'",
        ),
        ([], r"needs a non-empty list under 'models:'"),
    ],
)
def test_bad_config_names_the_entry(tmp_path: Path, entries: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        load_config(write_config(tmp_path / "models.yaml", entries))


def test_unreadable_weights_fail_at_start_up_naming_the_entry(
    tmp_path: Path, folders: dict[str, Path], base_settings: Settings
) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folders["text"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file at all")
    config = write_config(tmp_path / "models.yaml", [
        {"task": "fine", "kind": "image-classification", "source": "transformers",
         "path": str(folders["image"])},
        {"task": "sentiment", "kind": "text-classification", "source": "transformers", "path": str(broken)},
    ])  # fmt: skip
    with pytest.raises(ModelConfigError, match=r"MODELS_CONFIG entry 2 \(task 'sentiment'\): .*broken"):
        load_all(load_config(config), LoadOptions(device="cpu"))
    settings = base_settings.changed(server__data_dir=tmp_path / "data", models__models_config=config)
    with pytest.raises(ModelConfigError, match="entry 2"):
        build_runtime(settings, model_factory=load_models)


def test_served_by_name_in_gradio_and_rest(
    config_runtime: Callable[..., Runtime], folders: dict[str, Path]
) -> None:
    import base64

    import httpx
    from gradio_client import Client, handle_file

    from storage.redis.embedded import free_port
    from ui.server import serve_runtime

    runtime = config_runtime([
        {"task": "sentiment", "kind": "text-classification", "source": "transformers",
         "path": str(folders["text"])},
        {"task": "shapes", "kind": "image-classification", "source": "transformers",
         "path": str(folders["image"])},
    ])  # fmt: skip
    server = serve_runtime(runtime, port=free_port())
    try:
        client = Client(server.url + "/", verbose=False)
        endpoints = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
        assert {"/classify_sentiment", "/classify_shapes"} <= endpoints
        assert not {"/classify_image", "/classify_text"} & endpoints
        label, info = client.predict("Where is my refund?", api_name="/classify_sentiment")
        own = own_text_scores(folders["text"], "Where is my refund?")
        assert info["model"] == "sentiment" and label["label"] == max(own, key=own.__getitem__)
        data = png(7)
        image_path = folders["image"].parent / "seven.png"
        image_path.write_bytes(data)
        label, info = client.predict(handle_file(str(image_path)), api_name="/classify_shapes")
        assert info["tier"] == "miss"
        assert_same(
            {c["label"]: c["confidence"] for c in label["confidences"]},
            own_image_scores(folders["image"], data),
        )
        body = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES",
                            "parameters": {"content_type": "base64"},
                            "data": [base64.b64encode(data).decode()]}]}  # fmt: skip
        answer = httpx.post(f"{server.url}/v2/models/shapes/infer", json=body, timeout=30).json()
        assert answer["parameters"]["tier"] == "l1" and answer["parameters"]["model"] == "shapes"
        text_body = {
            "inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": ["Where is my refund?"]}]
        }
        answer = httpx.post(f"{server.url}/v2/models/sentiment/infer", json=text_body, timeout=30).json()
        assert answer["parameters"]["tier"] == "l1"
        assert httpx.get(f"{server.url}/v2/models/image", timeout=10).status_code == 404
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["text", "image"])
def test_a_loaded_model_keeps_its_weights_when_the_file_is_overwritten(tmp_path: Path, kind: str) -> None:
    """transformers maps safetensors into memory: without a copy, new weights copied over the
    file in place would be served under the old model_version (the `model_reload` scenario)."""
    import shutil

    from engine.models.hf import HFImageClassifier, HFTextClassifier

    make = make_text_model if kind == "text" else make_image_model
    folder, fresh = make(tmp_path / "model", seed=0), make(tmp_path / "fresh", seed=1)
    if kind == "text":
        model: Any = HFTextClassifier(task="t", folder=folder, device="cpu", max_text_chars=500)
        item = model.canonicalize("where is my parcel?")
    else:
        model = HFImageClassifier(task="i", folder=folder, device="cpu", max_upload_bytes=1 << 20,
                                  max_image_pixels=1 << 22)  # fmt: skip
        item = model.canonicalize(png(3))
    before = model.predict_batch([item])[0]
    shutil.copy(fresh / "model.safetensors", folder / "model.safetensors")  # in place: same inode
    assert model.predict_batch([item])[0] == before
