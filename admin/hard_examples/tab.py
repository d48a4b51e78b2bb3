"""The console's Hard examples panel (admin.hard_examples): a tab per task with the kept
examples (message text, image thumbnails), the one being labelled with the model's answer, the
right class to pick (the model's classes, or "none of these"), Save / Skip / Delete, and the
export. Every callback checks the session's sign-in; the actions are audited under it."""

from __future__ import annotations

import base64
import io
import shutil
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import gradio as gr

from admin.console.service import AdminService
from admin.hard_examples.service import HardExampleAdmin
from engine.errors import InvalidInputError
from engine.quality.hard_examples import NONE_OF_THESE

TABLE_HEADERS = ["id", "input", "model's answer", "asked", "why", "status", "label"]
PREVIEW_CHARS = 80
OFF_TEXT = ("**Hard examples are off** (`HARD_EXAMPLES_SIZE=0`, the default, or no Redis): no inputs are "
            "kept, so there is nothing to label or export. To turn them on, set `HARD_EXAMPLES_SIZE` (how "
            "many unsure answers to keep per task, e.g. 500) with Redis on (`REDIS_URL`) and restart the "
            "app.")


def _require(session: str | None) -> str:
    if not session:
        raise gr.Error("Sign in with the admin token first.", print_exception=False)
    return session


def _error(exc: InvalidInputError) -> gr.Error:
    return gr.Error(exc.message, print_exception=False)


def _answer(labels: list[list[Any]]) -> str:
    return ", ".join(f"{name} {score:.2f}" for name, score in labels[:3])


def _when(at: float | None) -> str:
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%d %H:%M") if at else "–"


def example_rows(examples: list[dict[str, Any]]) -> list[list[Any]]:
    return [[e["id"][:12], (e.get("text") or "[image]")[:PREVIEW_CHARS], _answer(e["labels"]), e["asked"],
             e["reason"], e["state"], e.get("label") or ""] for e in examples]  # fmt: skip


def _choice(e: dict[str, Any]) -> tuple[str, str]:
    preview = (e.get("text") or "image")[:40]
    return f"{e['state']} · asked {e['asked']} · {preview}", e["id"]


def summary_text(hard: HardExampleAdmin, listing: dict[str, Any] | None) -> str:
    info = hard.summary()
    if not info["enabled"]:
        return OFF_TEXT
    if listing is None:
        return ""
    counts = ", ".join(f"{n} {state}" for state, n in listing["states"].items() if n) or "none yet"
    seen = info["counters"]
    return (f"**{sum(listing['states'].values())}/{info['size']} kept** ({counts}) · top score below "
            f"{info['max_score']} or margin below {info['min_margin']} · kept "
            f"{info['ttl_s'] / 86400:g} days after the last addition · this replica: "
            f"{seen['candidates']:,} hard answers, {seen['over_budget']:,} over the CPU budget")


def make_hard_example_callbacks(admin: AdminService) -> dict[str, Callable[..., Any]]:
    hard = admin.hard_examples
    exports: list[Path] = []  # this console's export folder (the latest only)

    def refresh(session: str | None, task: str) -> tuple[Any, ...]:
        _require(session)
        if not hard.enabled:
            return summary_text(hard, None), [], [], gr.update(choices=[], value=None)
        try:
            listing = hard.listing(task)
        except InvalidInputError as exc:
            raise _error(exc) from None
        examples = listing["examples"]
        gallery = [(_pil(base64.b64decode(e["thumbnail_png_base64"])), f"{e['state']} · "
                    f"{_answer(e['labels'])}") for e in examples
                   if e.get("thumbnail_png_base64")]  # fmt: skip
        pending = next((e["id"] for e in examples if e["state"] == "pending"), None)
        first = pending or (examples[0]["id"] if examples else None)
        choices = gr.update(choices=[_choice(e) for e in examples], value=first)
        return summary_text(hard, listing), example_rows(examples), gallery, choices

    def show(session: str | None, task: str, ident: str | None) -> tuple[Any, ...]:
        _require(session)
        classes = [*hard.classes(task), NONE_OF_THESE]
        if not ident or not hard.enabled:
            nothing = "Nothing to label: refresh, or wait for unsure answers."
            return "", None, None, nothing, gr.update(choices=classes, value=None)
        try:
            examples = hard.listing(task, thumbnails=False)["examples"]
            example = next((e for e in examples if e["id"] == ident), None)
            if example is None:
                gone = "That example is gone (deleted, evicted or expired)."
                raise InvalidInputError("unknown_example", gone)
            png = hard.image(task, ident) if example.get("kind") == "image" else None
        except InvalidInputError as exc:
            raise _error(exc) from None
        details = (f"Asked **{example['asked']}** times · {example['reason']} · model "
                   f"`{example['model_version']}` · first {_when(example.get('first_seen'))}, "
                   f"last {_when(example.get('last_seen'))}")  # fmt: skip
        if example["state"] != "pending":
            details += f" · **{example['state']}** {example.get('label') or ''} by {example.get('by')}"
        if example.get("cached_labels"):
            details += f" · the cache had served: {_answer(example['cached_labels'])}"
        picture = _pil(png) if png else None
        label_value = {name: score for name, score in example["labels"]}
        current = example.get("label") or (NONE_OF_THESE if example["state"] == "none" else None)
        return (example.get("text") or "", picture, label_value, details,
                gr.update(choices=classes, value=current))  # fmt: skip

    def act(session: str | None, task: str, ident: str | None, label: str | None, action: str) -> str:
        actor = _require(session)
        if not ident:
            raise gr.Error("Choose an example first.", print_exception=False)
        if action == "label" and not label:
            raise gr.Error("Pick the right class (or “none of these”) first.", print_exception=False)
        try:
            chosen = label if action == "label" else None
            result = hard.act(task, ident, action=action, label=chosen, actor=actor)
        except InvalidInputError as exc:
            raise _error(exc) from None
        said = {"label": f"labelled **{result.get('label')}**", "none": "marked **none of these**",
                "skip": "skipped", "delete": "deleted"}[result["action"]]  # fmt: skip
        return f"Example `{ident[:12]}` {said}."

    def export(session: str | None, task: str, fmt: str, include_all: bool) -> str:
        actor = _require(session)
        try:
            include = "all" if include_all else "labelled"
            data, name, _ = hard.export(task, fmt=fmt, include=include, actor=actor)
        except InvalidInputError as exc:
            raise _error(exc) from None
        # Gradio serves a file from a path (and copies it into its cache under a digest of the
        # content). The file holds users' inputs: a private folder (mode 700), and only the
        # latest export of this console stays there.
        for old in exports:
            shutil.rmtree(old, ignore_errors=True)
        exports.clear()
        folder = Path(tempfile.mkdtemp(prefix="hard-examples-"))
        exports.append(folder)
        path = folder / name
        path.write_bytes(data)
        return str(path)

    return {"refresh": refresh, "show": show, "act": act, "export": export}


def _pil(png: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(png))
    image.load()
    return image


def build_hard_examples_panel(admin: AdminService, session: gr.State) -> None:
    """Call inside the signed-in console column of the Admin tab."""
    cb = make_hard_example_callbacks(admin)
    private = {"api_visibility": "private"}
    enabled = admin.hard_examples.enabled  # off: the panel says so, how to turn it on, buttons disabled
    title = "Hard examples: label what the model was unsure of" + ("" if enabled else " (off)")
    with gr.Accordion(title, open=False, elem_id="admin-hard-examples"):
        for task in admin.tasks():
            with gr.Tab(task, elem_id=f"admin-hard-{task}"):
                _task_tab(cb, task, admin.hard_examples.takes_image(task), session, private, enabled)


def _task_tab(
    cb: dict[str, Callable[..., Any]], task: str, image: bool, session: gr.State, private: dict[str, Any],
    enabled: bool = True,
) -> None:  # fmt: skip
    task_state = gr.State(task)
    summary = gr.Markdown(None if enabled else OFF_TEXT, elem_id=f"admin-hard-{task}-summary")
    refresh_btn = gr.Button("Refresh", size="sm", interactive=enabled, elem_id=f"admin-hard-{task}-refresh")
    table = gr.Dataframe(headers=TABLE_HEADERS, interactive=False, label="Kept examples",
                         elem_id=f"admin-hard-{task}-table")  # fmt: skip
    gallery = gr.Gallery(label="Images", columns=8, height=140, visible=image,
                         elem_id=f"admin-hard-{task}-gallery")  # fmt: skip
    example = gr.Dropdown(label="Example to label", choices=[], elem_id=f"admin-hard-{task}-example")
    with gr.Row():
        text = gr.Textbox(label="Message as typed", interactive=False, lines=3, visible=not image,
                          elem_id=f"admin-hard-{task}-text")  # fmt: skip
        picture = gr.Image(label="Image (its decoded pixels)", type="pil", interactive=False, height=220,
                           visible=image, elem_id=f"admin-hard-{task}-image")  # fmt: skip
        answer = gr.Label(label="The model's answer", num_top_classes=5,
                          elem_id=f"admin-hard-{task}-answer")  # fmt: skip
    details = gr.Markdown(elem_id=f"admin-hard-{task}-details")
    with gr.Row():
        label = gr.Dropdown(label="The right class", choices=[], elem_id=f"admin-hard-{task}-label")
        save_btn = gr.Button("Save label", variant="primary", interactive=enabled,
                             elem_id=f"admin-hard-{task}-save")  # fmt: skip
        skip_btn = gr.Button("Skip", interactive=enabled, elem_id=f"admin-hard-{task}-skip")
        delete_btn = gr.Button("Delete", variant="stop", interactive=enabled,
                               elem_id=f"admin-hard-{task}-delete")  # fmt: skip
    result = gr.Markdown(elem_id=f"admin-hard-{task}-result")
    with gr.Row():
        fmt = gr.Radio(["parquet", "imagefolder"], value="parquet", label="Export format",
                       elem_id=f"admin-hard-{task}-format")  # fmt: skip
        include_all = gr.Checkbox(label="Include unlabelled examples", elem_id=f"admin-hard-{task}-all")
        export_btn = gr.Button("Export", interactive=enabled, elem_id=f"admin-hard-{task}-export")
        exported = gr.File(label="Data set", elem_id=f"admin-hard-{task}-file")

    listing = [summary, table, gallery, example]
    shown = [text, picture, answer, details, label]
    refreshed = refresh_btn.click(cb["refresh"], inputs=[session, task_state], outputs=listing, **private)
    refreshed.then(cb["show"], inputs=[session, task_state, example], outputs=shown, **private)
    example.input(cb["show"], inputs=[session, task_state, example], outputs=shown, **private)
    picked = [session, task_state, example, label]
    for button, action in ((save_btn, "label"), (skip_btn, "skip"), (delete_btn, "delete")):
        # After an action the list is read again and the next pending example shown.
        done = button.click(lambda s, t, i, lab, a=action: cb["act"](s, t, i, lab, a), inputs=picked,
                            outputs=result, **private)  # fmt: skip
        done.success(cb["refresh"], inputs=[session, task_state], outputs=listing, **private).then(
            cb["show"], inputs=picked[:3], outputs=shown, **private
        )
    export_btn.click(cb["export"], inputs=[session, task_state, fmt, include_all], outputs=exported,
                     **private)  # fmt: skip
