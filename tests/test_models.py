"""Tests with the real models: known photos, held-out support messages, determinism,
versions, eval mode, device choice and the weight-mapping guard.

`real_models` is shared by the whole session: tests here never mutate it; anything
that must be changed is done on a copy.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from engine.errors import ModelError, ModelLoadError
from engine.models.base import TOP_K, Classifier, Prediction
from engine.models.device import describe, select_device
from engine.models.image import ImageClassifier, default_weights_path, map_state_dict
from engine.models.text import DEFAULT_INTENTS_PATH, TextClassifier

SUPPORT_MESSAGES_PATH = Path(__file__).resolve().parent / "data" / "support_messages.yaml"
CAT_CLASSES = frozenset({"tabby", "tiger cat", "Egyptian cat", "Persian cat", "Siamese cat", "lynx"})
MIN_INTENT_ACCURACY = 0.90


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def image_model(real_models: dict[str, Any]) -> ImageClassifier:
    return real_models["image"]


@pytest.fixture(scope="module")
def text_model(real_models: dict[str, Any]) -> TextClassifier:
    return real_models["text"]


@pytest.fixture(scope="module")
def classify_photo(
    image_model: ImageClassifier, photo_bytes: Callable[[str], bytes]
) -> Callable[[str], Prediction]:
    def classify(name: str) -> Prediction:
        (prediction,) = image_model.predict_batch([image_model.canonicalize(photo_bytes(name))])
        return prediction

    return classify


@pytest.fixture(scope="module")
def support_messages() -> dict[str, list[str]]:
    doc = yaml.safe_load(SUPPORT_MESSAGES_PATH.read_text(encoding="utf-8"))
    assert isinstance(doc, dict) and doc, f"{SUPPORT_MESSAGES_PATH} must map intents to messages"
    return {str(intent): [str(m) for m in messages] for intent, messages in doc.items()}


@pytest.fixture(scope="module")
def intent_file() -> dict[str, Any]:
    return yaml.safe_load(DEFAULT_INTENTS_PATH.read_text(encoding="utf-8"))["intents"]


@pytest.fixture(scope="module")
def edited_intents_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the intent file with one extra example phrase, nothing else changed."""
    original = DEFAULT_INTENTS_PATH.read_text(encoding="utf-8")
    anchor = "      - hello\n"
    assert original.count(anchor) == 1, "the intent file changed: update the anchor of this fixture"
    path = tmp_path_factory.mktemp("intents") / "intents.yaml"
    path.write_text(original.replace(anchor, anchor + "      - hello there, friend\n"), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def edited_text_model(edited_intents_path: Path) -> TextClassifier:
    """A second real text model (loaded again from disk) on the edited intent file."""
    return TextClassifier(max_text_chars=2000, device="cpu", intents_path=edited_intents_path)


@pytest.fixture
def throwaway(real_models: dict[str, Any]) -> Callable[[str], Any]:
    """A shallow copy of a shared model with its own deep-copied torch module."""

    def make(task: str) -> Any:
        clone = copy.copy(real_models[task])
        clone._model = copy.deepcopy(real_models[task]._model)
        return clone

    return make


@pytest.fixture(scope="module")
def timm_model() -> torch.nn.Module:
    import timm

    return timm.create_model("efficientnet_lite0", pretrained=False, num_classes=1000)


@pytest.fixture(scope="module")
def source_weights() -> dict[str, torch.Tensor]:
    return torch.load(default_weights_path(), map_location="cpu", weights_only=True)


def assert_well_formed(prediction: Prediction, *, k: int = TOP_K) -> None:
    assert isinstance(prediction, Prediction)
    assert len(prediction.labels) == k, prediction.labels
    names = [name for name, _ in prediction.labels]
    scores = [score for _, score in prediction.labels]
    assert all(isinstance(n, str) and n for n in names), names
    assert len(set(names)) == k, f"duplicate classes: {names}"
    assert all(type(s) is float for s in scores), "scores must be plain Python floats"
    assert all(0.0 < s <= 1.0 for s in scores), scores
    assert scores == sorted(scores, reverse=True), f"not sorted best first: {scores}"
    assert sum(scores) <= 1.0 + 1e-6, f"top-{k} probabilities sum to {sum(scores)}"
    assert Prediction.from_plain(prediction.to_plain()) == prediction


def top_names(prediction: Prediction, n: int) -> list[str]:
    return [name for name, _ in prediction.labels[:n]]


# --------------------------------------------------------------------------- image model


def test_chelsea_is_a_cat(classify_photo: Callable[[str], Prediction]) -> None:
    prediction = classify_photo("chelsea.png")
    assert_well_formed(prediction)
    assert CAT_CLASSES & set(top_names(prediction, 3)), f"no cat class in top 3: {prediction.labels}"


def test_coffee_is_espresso(classify_photo: Callable[[str], Prediction]) -> None:
    prediction = classify_photo("coffee.png")
    assert_well_formed(prediction)
    assert prediction.top_label == "espresso", prediction.labels


def test_rocket_is_a_missile(classify_photo: Callable[[str], Prediction]) -> None:
    prediction = classify_photo("rocket.jpg")
    assert_well_formed(prediction)
    assert {"missile", "projectile"} & set(top_names(prediction, 3)), prediction.labels


def test_image_batch_matches_its_items(
    image_model: ImageClassifier,
    classify_photo: Callable[[str], Prediction],
    photo_bytes: Callable[[str], bytes],
) -> None:
    names = ("chelsea.png", "coffee.png", "rocket.jpg")
    batch = image_model.predict_batch([image_model.canonicalize(photo_bytes(n)) for n in names])
    assert len(batch) == len(names)
    for name, prediction in zip(names, batch, strict=True):
        assert_well_formed(prediction)
        single = classify_photo(name)
        assert top_names(prediction, 3) == top_names(single, 3), name
        for (_, a), (_, b) in zip(prediction.labels, single.labels, strict=True):
            assert a == pytest.approx(b, abs=1e-4), name
    assert image_model.predict_batch([]) == []


# --------------------------------------------------------------------------- text model


def test_support_message_file_is_what_the_tests_expect(
    support_messages: dict[str, list[str]], text_model: TextClassifier
) -> None:
    assert sum(len(m) for m in support_messages.values()) == 36
    assert all(len(m) == 4 for m in support_messages.values()), support_messages
    assert set(support_messages) == set(text_model.intent_names), "test intents must match the model's"


def test_intent_file_is_large_enough(intent_file: dict[str, Any]) -> None:
    assert len(intent_file) >= 8, f"only {len(intent_file)} intents"
    for name, spec in intent_file.items():
        assert len(spec["examples"]) >= 6, f"intent {name!r} has {len(spec['examples'])} examples"


def test_support_messages_are_not_intent_examples(
    support_messages: dict[str, list[str]], intent_file: dict[str, Any]
) -> None:
    def key(text: str) -> str:
        return " ".join(text.casefold().split())

    examples = {key(str(p)) for spec in intent_file.values() for p in spec["examples"]}
    leaked = [m for messages in support_messages.values() for m in messages if key(m) in examples]
    assert not leaked, f"test messages copied from the intent file: {leaked}"


def test_support_messages_are_classified(
    support_messages: dict[str, list[str]], text_model: TextClassifier
) -> None:
    cases = [(intent, message) for intent, messages in support_messages.items() for message in messages]
    predictions = text_model.predict_batch([text_model.canonicalize(m) for _, m in cases])
    assert len(predictions) == len(cases)
    misses = []
    for (intent, message), prediction in zip(cases, predictions, strict=True):
        assert_well_formed(prediction, k=min(TOP_K, len(text_model.intent_names)))
        if prediction.top_label != intent:
            misses.append(f"{message!r}: expected {intent}, got {prediction.labels[:2]}")
    accuracy = 1 - len(misses) / len(cases)
    assert accuracy >= MIN_INTENT_ACCURACY, f"top-1 accuracy {accuracy:.0%}; misses:\n" + "\n".join(misses)


def test_case_variants_share_a_canonical_form(text_model: TextClassifier) -> None:
    if not text_model._lower_case:
        pytest.skip("the tokenizer is cased")
    assert text_model.canonicalize("Where IS my Order?") == text_model.canonicalize("where is my order?")


# --------------------------------------------------------------------------- determinism


def test_image_prediction_is_deterministic(
    image_model: ImageClassifier, photo_bytes: Callable[[str], bytes]
) -> None:
    data = photo_bytes("astronaut.png")
    first = image_model.predict_batch([image_model.canonicalize(data)])
    second = image_model.predict_batch([image_model.canonicalize(bytes(data))])
    assert first == second


def test_text_prediction_is_deterministic(text_model: TextClassifier) -> None:
    message = "my card was charged twice for the same order"
    first = text_model.predict_batch([text_model.canonicalize(message)])
    second = text_model.predict_batch([text_model.canonicalize(message)])
    assert first == second
    assert_well_formed(first[0])


def test_text_batches_give_each_message_its_own_answer(
    text_model: TextClassifier, support_messages: dict[str, list[str]]
) -> None:
    """What engine.capacity.batching relies on: in a batch (padded to its longest message) each
    message keeps its labels, in order, and its scores to well within 1e-5."""
    assert text_model.batch_misses
    messages = [m for group in support_messages.values() for m in group]
    canonical = [text_model.canonicalize(m) for m in messages]
    singles = [text_model.predict_batch([c])[0] for c in canonical]
    for size in (2, 3, 8):
        for start in range(0, len(canonical), size):
            batch = text_model.predict_batch(canonical[start : start + size])
            for offset, prediction in enumerate(batch):
                single = singles[start + offset]
                assert top_names(prediction, 5) == top_names(single, 5), messages[start + offset]
                for (_, a), (_, b) in zip(prediction.labels, single.labels, strict=True):
                    assert a == pytest.approx(b, abs=1e-6), messages[start + offset]


# --------------------------------------------------------------------------- versions


def test_versions_are_distinct_non_empty_strings(real_models: dict[str, Any]) -> None:
    versions = {task: model.version for task, model in real_models.items()}
    for task, version in versions.items():
        assert isinstance(version, str) and version.strip(), f"{task} version {version!r}"
        assert re.fullmatch(r"[0-9a-f]{16}", version), f"{task} version {version!r}"
    assert versions["image"] != versions["text"]


def test_text_version_changes_with_the_intent_file(
    text_model: TextClassifier, edited_text_model: TextClassifier
) -> None:
    assert len(edited_text_model.intents.examples[0]) == len(text_model.intents.examples[0]) + 1
    assert edited_text_model.version != text_model.version, "an edited intent file must change the version"


def test_text_version_depends_on_content_not_on_path(text_model: TextClassifier, tmp_path: Path) -> None:
    copy_path = tmp_path / "same-intents.yaml"
    copy_path.write_bytes(DEFAULT_INTENTS_PATH.read_bytes())
    same = TextClassifier(max_text_chars=2000, device=text_model.device, intents_path=copy_path)
    assert same.version == text_model.version


def test_models_follow_the_classifier_interface(real_models: dict[str, Any]) -> None:
    assert set(real_models) == {"image", "text"}
    for task, model in real_models.items():
        assert isinstance(model, Classifier)
        assert model.task == task
        assert isinstance(model.name, str) and model.name


# --------------------------------------------------------------------------- eval mode


@pytest.mark.parametrize("task", ["image", "text"])
def test_models_are_in_eval_mode(real_models: dict[str, Any], task: str) -> None:
    module = real_models[task]._model
    training = [name for name, sub in module.named_modules() if sub.training]
    assert not training, f"{task} modules in training mode: {training[:5]}"


@pytest.mark.parametrize("task", ["image", "text"])
def test_training_mode_model_is_refused(
    real_models: dict[str, Any],
    throwaway: Callable[[str], Any],
    task: str,
    photo_bytes: Callable[[str], bytes],
) -> None:
    shared = real_models[task]
    clone = throwaway(task)
    assert clone._model is not shared._model
    raw = photo_bytes("coffee.png") if task == "image" else "where is my parcel"
    item = clone.canonicalize(raw)
    assert clone.predict_batch([item]) == shared.predict_batch([item]), (
        "the copy must behave like the original"
    )
    clone._model.train()
    with pytest.raises(ModelError, match="training mode"):
        clone.predict_batch([item])
    assert not shared._model.training, "the shared session model must stay in eval mode"


# --------------------------------------------------------------------------- device


DEVICE_NAME = re.compile(r"cpu|cuda:\d+")


def test_device_matches_cuda_availability(real_models: dict[str, Any], base_settings: Any) -> None:
    assert base_settings.models.device == "auto"
    expected_type = "cuda" if torch.cuda.is_available() else "cpu"
    for task, model in real_models.items():
        assert DEVICE_NAME.fullmatch(model.device), f"{task} device {model.device!r}"
        assert model.device.split(":")[0] == expected_type, f"{task} on {model.device}"
        parameter = next(model._model.parameters())
        assert describe(parameter.device) == model.device, f"{task} weights on {parameter.device}"


def test_select_device() -> None:
    assert select_device("cpu") == torch.device("cpu")
    assert describe(select_device("cpu")) == "cpu"
    auto = describe(select_device("auto"))
    assert DEVICE_NAME.fullmatch(auto)
    if torch.cuda.is_available():
        assert select_device("cuda").type == "cuda"
        assert auto.startswith("cuda:")
    else:
        assert auto == "cpu"
        with pytest.raises(ModelLoadError, match="CUDA"):
            select_device("cuda")


def test_describe() -> None:
    assert describe(torch.device("cpu")) == "cpu"
    assert describe(torch.device("cuda")) == "cuda:0"
    assert describe(torch.device("cuda", 1)) == "cuda:1"


# --------------------------------------------------------------------------- weight mapping


def test_real_weights_map_onto_timm(
    source_weights: dict[str, torch.Tensor], timm_model: torch.nn.Module
) -> None:
    mapped = map_state_dict(source_weights, timm_model)
    assert list(mapped) == list(timm_model.state_dict())


@pytest.fixture(params=["first", "middle", "last"])
def dropped_name(request: pytest.FixtureRequest, source_weights: dict[str, torch.Tensor]) -> str:
    names = list(source_weights)
    return {"first": names[0], "middle": names[len(names) // 2], "last": names[-1]}[request.param]


def test_missing_tensor_fails_loudly(
    source_weights: dict[str, torch.Tensor], timm_model: torch.nn.Module, dropped_name: str
) -> None:
    broken = {name: t for name, t in source_weights.items() if name != dropped_name}
    with pytest.raises(ModelLoadError, match="tensors"):
        map_state_dict(broken, timm_model)


def test_missing_tensor_replaced_by_another_fails_loudly(
    source_weights: dict[str, torch.Tensor], timm_model: torch.nn.Module
) -> None:
    """Same count, but a weight is gone and an unrelated one appended: the shapes no longer line up."""
    names = [n for n, t in source_weights.items() if t.ndim == 4]
    victim = names[len(names) // 2]
    broken = {n: t for n, t in source_weights.items() if n != victim}
    broken["extra.bias"] = torch.zeros(7)
    with pytest.raises(ModelLoadError, match="does not fit"):
        map_state_dict(broken, timm_model)


@pytest.mark.parametrize("which", ["first", "classifier", "middle-conv"])
def test_shape_mismatch_fails_loudly(
    source_weights: dict[str, torch.Tensor], timm_model: torch.nn.Module, which: str
) -> None:
    names = list(source_weights)
    conv_names = [n for n in names if source_weights[n].ndim == 4]
    matrix_names = [n for n in names if source_weights[n].ndim == 2]
    target = {
        "first": names[0],
        "classifier": matrix_names[-1],
        "middle-conv": conv_names[len(conv_names) // 2],
    }[which]
    broken = dict(source_weights)
    original = broken[target]
    broken[target] = torch.zeros(original.shape[0] + 1, *original.shape[1:])
    with pytest.raises(ModelLoadError, match=re.escape(target)):
        map_state_dict(broken, timm_model)


def test_wrong_weights_file_fails_to_load(tmp_path: Path, source_weights: dict[str, torch.Tensor]) -> None:
    broken = dict(source_weights)
    broken.pop(next(iter(broken)))
    path = tmp_path / "broken.pth"
    torch.save(broken, path)
    with pytest.raises(ModelLoadError):
        ImageClassifier(
            device="cpu", max_upload_bytes=1_000_000, max_image_pixels=1_000_000, weights_path=path
        )


def test_missing_weights_file_fails_to_load(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        ImageClassifier(
            device="cpu",
            max_upload_bytes=1_000_000,
            max_image_pixels=1_000_000,
            weights_path=tmp_path / "x.pth",
        )


# --------------------------------------------------------------------------- preprocessing, no torchvision


def test_the_image_preprocessing_is_torchvisions_bit_for_bit() -> None:
    """engine.models.image computes torchvision.transforms.v2's pipeline itself (importing
    torchvision costs seconds of a start): the same tensors, strides included, on odd sizes, and
    the same class names."""
    import numpy as np
    from torchvision.models import ResNet50_Weights
    from torchvision.transforms import v2

    from engine.models.image import (
        CROP,
        IMAGENET_MEAN,
        IMAGENET_STD,
        RESIZE,
        imagenet_categories,
        imagenet_transform,
    )

    assert imagenet_categories() == list(ResNet50_Weights.IMAGENET1K_V2.meta["categories"])
    steps = [v2.Resize(RESIZE, antialias=True), v2.CenterCrop(CROP), v2.ToDtype(torch.float32, scale=True),
             v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]  # fmt: skip
    reference = v2.Compose(steps)
    rng = np.random.default_rng(7)
    shapes = [(1, 1), (224, 224), (256, 256), (255, 257), (97, 131), (1000, 250), (250, 1000), (4, 16)]
    shapes += [(int(rng.integers(50, 1200)), int(rng.integers(50, 1200))) for _ in range(12)]
    for height, width in shapes:
        if max(height, width) > 4 * min(height, width):  # preprocess crops such strips first
            continue
        chw = torch.from_numpy(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).permute(2, 0, 1)
        want, got = reference(chw), imagenet_transform(chw)
        assert torch.equal(want, got) and want.stride() == got.stride(), (height, width)
