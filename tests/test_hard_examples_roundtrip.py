"""The hard-example loop end to end with tiny user models (testing.tiny_models, random weights, so
every answer is unsure): requests over REST, the unsure ones kept, labelled by the operator
through the API, exported, fine-tuned with docs/MODELS.md's own example, copied into the task's
folder, reloaded live, and the labelled messages (and, with its image example, the
labelled pictures) now get the operator's labels."""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from admin.hard_examples.tab import make_hard_example_callbacks
from runtime import Runtime, build_runtime, load_models
from settings import Settings
from storage.redis.embedded import EmbeddedRedis, free_port
from testing.tiny_models import IMAGE_LABELS, TEXT_LABELS, make_image_model, make_text_model, write_config

pytestmark = pytest.mark.redis
TOKEN = "roundtrip-operator-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODELS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "MODELS.md"
MESSAGES = ("where is my money", "the box came broken", "hello there friend", "refund me now please",
            "my parcel is late again", "good morning to the team")  # fmt: skip


def readme_finetune_example(marker: str = "hard-examples-finetune") -> str:
    """A fine-tune code block of docs/MODELS.md, as users copy it."""
    text = MODELS_PAGE.read_text(encoding="utf-8")
    match = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"docs/MODELS.md's fine-tune example ({marker}) is missing"
    return match.group(1)


def run_readme_example(marker: str, export: Path, model_dir: Path, readme_paths: str) -> None:
    """The page's example with its two paths replaced by these, run from the current folder."""
    code = readme_finetune_example(marker).replace(readme_paths, f"export, model_dir = {str(export)!r}, "
                                                                 f"{str(model_dir)!r}")  # fmt: skip
    assert str(export) in code
    exec(compile(code, f"docs/MODELS.md ({marker})", "exec"), {"__name__": "readme_example"})


def reload(url: str, task: str) -> str:
    answer = httpx.post(f"{url}/admin/api/models/{task}/reload", json={"note": "hard examples"},
                        headers=AUTH, timeout=60)  # fmt: skip
    assert answer.status_code == 200 and answer.json()["changed"], answer.text
    return answer.json()["version"]


@pytest.fixture
def served(
    base_settings: Settings, tmp_path: Path, redis_server: EmbeddedRedis
) -> Iterator[tuple[str, Runtime]]:
    from ui.server import serve_runtime

    config = write_config(tmp_path / "models.yaml", [
        {"task": "sentiment", "kind": "text-classification", "source": "transformers",
         "path": str(make_text_model(tmp_path / "sentiment", seed=3)), "backend": "torch"},
        {"task": "photo", "kind": "image-classification", "source": "transformers",
         "path": str(make_image_model(tmp_path / "photo", seed=3)), "backend": "torch"},
    ])  # fmt: skip
    settings = base_settings.changed(
        server__data_dir=tmp_path / "rt", models__models_config=config, server__admin_token=TOKEN,
        redis__url=redis_server.url, quality__hard_examples_size=50,
    )  # fmt: skip
    runtime = build_runtime(settings, model_factory=load_models)
    server = serve_runtime(runtime, port=free_port())
    try:
        yield server.url, runtime
    finally:
        server.close()
        runtime.close()


def infer(url: str, task: str, text: str) -> tuple[str, dict[str, Any]]:
    body = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    answer = httpx.post(f"{url}/v2/models/{task}/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    label = next(o for o in reply["outputs"] if o["name"] == "label")["data"][0]
    return label, reply["parameters"]


def test_label_export_finetune_reload(served: tuple[str, Runtime], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    url, runtime = served
    assert runtime.hard_examples is not None
    before = {text: infer(url, "sentiment", text)[0] for text in MESSAGES}
    runtime.hard_examples.flush()
    listing = httpx.get(f"{url}/admin/api/hard-examples", params={"task": "sentiment"}, headers=AUTH).json()
    assert listing["classes"] == list(TEXT_LABELS)
    kept = {e["text"]: e for e in listing["examples"]}
    assert set(kept) == set(MESSAGES)  # random weights: every answer is unsure
    # The operator's labels: each one a class the model did not answer.
    wanted = {}
    for text in MESSAGES:
        wanted[text] = next(c for c in TEXT_LABELS if c != before[text])
        done = httpx.post(f"{url}/admin/api/hard-examples/{kept[text]['id']}/label",
                          json={"task": "sentiment", "label": wanted[text]}, headers=AUTH)  # fmt: skip
        assert done.status_code == 200, done.text
    export = httpx.get(f"{url}/admin/api/hard-examples/export", headers=AUTH, timeout=30,
                       params={"task": "sentiment", "format": "parquet"})  # fmt: skip
    assert export.status_code == 200, export.text
    parquet = tmp_path / "hard-examples-sentiment.parquet"
    parquet.write_bytes(export.content)

    model_dir = runtime.settings.models.models_config.parent / "sentiment"  # type: ignore[union-attr]
    monkeypatch.chdir(tmp_path)  # the Trainer's output folder
    run_readme_example("hard-examples-finetune", parquet, model_dir,
                       'export, model_dir = "hard-examples-sentiment.parquet", "/data/models/sentiment"')

    version = reload(url, "sentiment")
    for text in MESSAGES:
        label, info = infer(url, "sentiment", text)
        assert info["model_version"] == version
        assert label == wanted[text], (text, label, wanted[text])
    runtime.hard_examples.flush()  # the console now shows the new model's answer beside the label
    after = {e["text"]: e for e in runtime.admin.hard_examples.listing("sentiment")["examples"]}
    assert {t: (e["labels"][0][0], e["label"], e["model_version"]) for t, e in after.items()} == {
        t: (wanted[t], wanted[t], version) for t in MESSAGES}
    assert all(e["asked"] == 2 and e["state"] == "labelled" for e in after.values())


def test_images_kept_as_png_exported_and_fine_tuned(
    served: tuple[str, Runtime], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    import numpy as np
    from PIL import Image
    url, runtime = served
    assert runtime.hard_examples is not None
    pictures = []
    for seed in range(3):
        pixels = np.random.default_rng(seed).integers(0, 255, (40, 48, 3), dtype=np.uint8)
        out = io.BytesIO()
        exif = Image.Exif()
        exif[0x010F] = "PhoneMaker"  # metadata that must not be kept
        Image.fromarray(pixels).save(out, format="JPEG", exif=exif)
        pictures.append(out.getvalue())
        assert runtime.engine.classify("photo", out.getvalue()).tier == "miss"
    runtime.hard_examples.flush()
    examples = runtime.admin.hard_examples.listing("photo")["examples"]
    assert len(examples) == 3 and all(e["kind"] == "image" and e["thumbnail_png_base64"] for e in examples)
    stored = runtime.admin.hard_examples.image("photo", examples[0]["id"])
    assert stored is not None and stored.startswith(b"\x89PNG") and b"PhoneMaker" not in stored
    console = make_hard_example_callbacks(runtime.admin)  # the console panel shows them
    _, rows, gallery, choices = console["refresh"]("token:test ui", "photo")
    assert len(gallery) == 3 and {r[1] for r in rows} == {"[image]"}
    _, picture, answer, _, classes = console["show"]("token:test ui", "photo", choices["value"])
    assert picture.size == (48, 40) and set(answer) <= set(IMAGE_LABELS)
    assert classes["choices"] == [*IMAGE_LABELS, "none of these"]
    hard = runtime.admin.hard_examples
    # The operator's labels: classes the model did not answer, so the fine-tune has to learn them.
    preferred = ((examples[0], IMAGE_LABELS[1:3]), (examples[1], (IMAGE_LABELS[3], IMAGE_LABELS[0])))
    wanted = {e["id"]: next(c for c in prefer if c != e["labels"][0][0]) for e, prefer in preferred}
    for ident, label in wanted.items():
        hard.act("photo", ident, action=None, label=label, actor="test")
    hard.act("photo", examples[2]["id"], action="none", label=None, actor="test")
    answer = httpx.get(f"{url}/admin/api/hard-examples/export", headers=AUTH, timeout=30,
                       params={"task": "photo", "format": "imagefolder"})  # fmt: skip
    assert answer.status_code == 200
    folder = tmp_path / "photo-set"
    with zipfile.ZipFile(io.BytesIO(answer.content)) as archive:
        archive.extractall(folder)
    data = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    assert data.num_rows == 2  # "none of these" has no folder to go in
    names = data.features["label"].names
    assert sorted(names[r["label"]] for r in data) == sorted(wanted.values())
    assert {r["image"].size for r in data} == {(48, 40)}

    parquet = httpx.get(f"{url}/admin/api/hard-examples/export", params={"task": "photo"}, headers=AUTH)
    (tmp_path / "photo.parquet").write_bytes(parquet.content)
    table = datasets.load_dataset("parquet", data_files=str(tmp_path / "photo.parquet"), split="train")
    assert table.num_rows == 3 and table.features["label"].names == list(IMAGE_LABELS)
    assert sorted(r["image"].size for r in table) == [(48, 40)] * 3

    # The page's image example on the labelled ones; reloaded, the model answers the labels.
    labelled = httpx.get(f"{url}/admin/api/hard-examples/export", params={"task": "photo"}, headers=AUTH)
    export = tmp_path / "hard-examples-photo.parquet"
    export.write_bytes(labelled.content)
    model_dir = runtime.settings.models.models_config.parent / "photo"  # type: ignore[union-attr]
    monkeypatch.chdir(tmp_path)  # the Trainer's output folder
    run_readme_example("hard-examples-finetune-image", export, model_dir,
                       'export, model_dir = "hard-examples-photo.parquet", "/data/models/photo"')
    version = reload(url, "photo")
    for picture in pictures:
        ident = runtime.engine.entry_key("photo", picture).rsplit(":", 1)[-1]
        if ident in wanted:
            answer = runtime.engine.classify("photo", picture)
            assert answer.tier == "miss" and answer.model_version == version
            assert answer.prediction.labels[0][0] == wanted[ident]
