"""The labelled hard examples as a data set (admin.hard_examples.service): a Parquet file that
`datasets.load_dataset("parquet", ...)` reads with typed columns, or a zip in the folder layout
Hugging Face tools read (`imagefolder` for images; `train.jsonl` of text and label for text).

Parquet columns: `id`, `text` (text tasks) or `image` (HF Image: PNG bytes of the decoded
pixels), `label` (ClassLabel over the model's classes; -1 when the operator said "none of
these" or has not labelled it), `operator_label`, `status`, `model_label`, `model_scores`
(the model's top classes, best first), `model_version`, `times_asked`, `reason`,
`first_seen`, `last_seen`, `labelled_by`, `labelled_at`.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Sequence
from typing import Any

NO_LABEL = -1


def rows(records: Sequence[dict[str, Any]], classes: Sequence[str]) -> list[dict[str, Any]]:
    """One plain row per example (its stored input under `input`)."""
    index = {name: i for i, name in enumerate(classes)}
    out = []
    for r in records:
        operator = r.get("label") if r["state"] == "labelled" else None
        out.append({
            "id": r["id"], "input": r["input"], "kind": r.get("kind", "text"),
            "label": index.get(operator, NO_LABEL) if operator is not None else NO_LABEL,
            "operator_label": operator, "status": r["state"],
            "model_label": r["labels"][0][0] if r.get("labels") else None,
            "model_scores": [{"label": str(n), "score": float(s)} for n, s in r.get("labels") or []],
            "model_version": r.get("model_version"), "times_asked": int(r.get("asked", 0)),
            "reason": r.get("reason"), "first_seen": r.get("first_seen"), "last_seen": r.get("last_seen"),
            "labelled_by": r.get("by"), "labelled_at": r.get("at"),
        })  # fmt: skip
    return out


def to_parquet(table_rows: Sequence[dict[str, Any]], classes: Sequence[str], *, image: bool) -> bytes:
    import pyarrow as pa  # imported here: only an export needs it
    import pyarrow.parquet as pq

    column = "image" if image else "text"
    if image:
        inputs = pa.array([{"bytes": r["input"], "path": f"{r['id']}.png"} for r in table_rows],
                          type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))  # fmt: skip
    else:
        inputs = pa.array([r["input"] for r in table_rows], type=pa.string())
    scores = pa.list_(pa.struct([("label", pa.string()), ("score", pa.float64())]))
    columns = {
        "id": pa.array([r["id"] for r in table_rows], type=pa.string()),
        column: inputs,
        "label": pa.array([r["label"] for r in table_rows], type=pa.int64()),
        **{name: pa.array([r[name] for r in table_rows], type=pa.string())
           for name in ("operator_label", "status", "model_label")},
        "model_scores": pa.array([r["model_scores"] for r in table_rows], type=scores),
        "model_version": pa.array([r["model_version"] for r in table_rows], type=pa.string()),
        "times_asked": pa.array([r["times_asked"] for r in table_rows], type=pa.int64()),
        "reason": pa.array([r["reason"] for r in table_rows], type=pa.string()),
        **{name: pa.array([r[name] for r in table_rows], type=pa.float64())
           for name in ("first_seen", "last_seen", "labelled_at")},
        "labelled_by": pa.array([r["labelled_by"] for r in table_rows], type=pa.string()),
    }  # fmt: skip
    # The `datasets` library reads its column types from this metadata: the image column
    # decodes to a PIL image, `label` to a ClassLabel over the model's classes.
    features: dict[str, Any] = {"label": {"_type": "ClassLabel", "names": list(classes)}}
    if image:
        features["image"] = {"_type": "Image"}
    table = pa.table(columns).replace_schema_metadata(
        {"huggingface": json.dumps({"info": {"features": features}})}
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


def to_folder_zip(table_rows: Sequence[dict[str, Any]], *, task: str, image: bool) -> bytes:
    """Images: `train/<label>/<id>.png` (datasets' imagefolder infers the ClassLabel from the
    folders) and, beside `train/` so the loader keeps its labels, `hard_examples.jsonl` with
    each file's model answer and times asked; text: `train.jsonl` with `text` and `label` (what
    transformers' text-classification examples take). Only examples given a class."""
    labelled = [r for r in table_rows if r["operator_label"] is not None]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        if image:
            lines = []
            for r in labelled:
                name = f"{_safe(r['operator_label'])}/{r['id']}.png"
                archive.writestr(f"train/{name}", r["input"])
                lines.append(json.dumps({"file_name": f"train/{name}", "label": r["operator_label"],
                                         **_extra(r)}, ensure_ascii=False))  # fmt: skip
            archive.writestr("hard_examples.jsonl", "\n".join(lines) + ("\n" if lines else ""))
        else:
            lines = [json.dumps({"text": r["input"], "label": r["operator_label"], **_extra(r)},
                                ensure_ascii=False) for r in labelled]  # fmt: skip
            archive.writestr("train.jsonl", "\n".join(lines) + ("\n" if lines else ""))
        archive.writestr("README.md", _card(task, len(labelled), image=image))
    return out.getvalue()


def _extra(r: dict[str, Any]) -> dict[str, Any]:
    return {"model_label": r["model_label"], "model_version": r["model_version"],
            "times_asked": r["times_asked"], "id": r["id"]}  # fmt: skip


def _safe(label: str) -> str:
    """A class name as a folder name (no path separators, never empty)."""
    cleaned = "".join("_" if c in '/\\:*?"<>|\0' else c for c in label).strip(". ")
    return cleaned or "_"


def _card(task: str, count: int, *, image: bool) -> str:
    how = ('load_dataset("imagefolder", data_dir="<this folder>")' if image
           else 'load_dataset("json", data_files="train.jsonl")')  # fmt: skip
    return (f"# Hard examples of task `{task}`\n\n{count} inputs the served model was unsure of, "
            f"labelled by an operator.\n\nLoad with `datasets`: `{how}`.\n\nThese are users' inputs: "
            "handle them as the privacy notice of the service says.\n")  # fmt: skip
