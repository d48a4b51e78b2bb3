"""The console's trust panel: inspect or evict one entry (paste a text or upload an image),
and shadow verification's last mismatches and rate. Every callback checks the session."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from admin.console.service import AdminService
from admin.trust.service import MISMATCH_HEADERS, SHADOW_OFF_TEXT, mismatch_rows, shadow_summary
from engine.errors import InvalidInputError

NOT_SIGNED_IN = "Sign in with the admin token first."


def _require(session: str | None) -> str:
    if not session:
        raise gr.Error(NOT_SIGNED_IN, print_exception=False)
    return session


def _raw(task: str, text: str | None, upload: bytes | None) -> Any:
    if upload:
        return bytes(upload)
    if text:
        return text
    raise gr.Error(f"Paste a text or upload a file for the {task} task.", print_exception=False)


def make_trust_callbacks(admin: AdminService) -> dict[str, Callable[..., Any]]:
    def inspect(session: str | None, task: str, text: str | None, upload: bytes | None) -> dict[str, Any]:
        _require(session)
        try:
            return admin.inspect(task, _raw(task, text, upload))
        except InvalidInputError as exc:
            raise gr.Error(exc.message, print_exception=False) from None

    def evict(
        session: str | None, task: str, text: str | None, upload: bytes | None, confirmed: bool
    ) -> dict[str, Any]:
        actor = _require(session)
        if not confirmed:
            raise gr.Error("Tick “I understand” to confirm the eviction.", print_exception=False)
        try:
            return admin.evict(task, _raw(task, text, upload), actor=actor)
        except InvalidInputError as exc:
            raise gr.Error(exc.message, print_exception=False) from None

    def shadow(session: str | None) -> tuple[str, list[list[str]]]:
        _require(session)
        report = admin.shadow_report()
        return shadow_summary(report), mismatch_rows(report)

    return {"inspect": inspect, "evict": evict, "shadow": shadow}


def build_trust_panel(admin: AdminService, session: gr.State) -> None:
    """Call inside the signed-in console column of the Admin tab."""
    cb = make_trust_callbacks(admin)
    private = {"api_visibility": "undocumented"}
    with gr.Accordion("One entry: inspect or evict", open=False, elem_id="admin-entry"):
        tasks = admin.tasks()
        with gr.Row():
            first = tasks[0] if tasks else None
            task = gr.Radio(tasks, value=first, label="Task", elem_id="admin-entry-task")
            text = gr.Textbox(label="Text (paste the message)", lines=2, elem_id="admin-entry-text")
            upload = gr.File(label="…or the image file", type="binary", elem_id="admin-entry-file")
        with gr.Row():
            inspect_btn = gr.Button("Inspect", elem_id="admin-entry-inspect")
            evict_ok = gr.Checkbox(label="I understand: this answer will be recomputed",
                                   elem_id="admin-entry-confirm")  # fmt: skip
            evict_btn = gr.Button("Evict this entry", variant="stop", elem_id="admin-entry-evict")
        entry = gr.JSON(label="Entry", elem_id="admin-entry-result")
    shadow_on = admin.shadow_report()["enabled"]  # off: says so and how to turn it on
    shadow_title = "Shadow verification" + ("" if shadow_on else " (off)")
    with gr.Accordion(shadow_title, open=False, elem_id="admin-shadow"):
        summary = gr.Markdown(None if shadow_on else SHADOW_OFF_TEXT, elem_id="admin-shadow-summary")
        mismatches = gr.Dataframe(headers=MISMATCH_HEADERS, label="Last mismatches", interactive=False,
                                  elem_id="admin-shadow-mismatches")  # fmt: skip
        shadow_btn = gr.Button("Refresh", size="sm", interactive=shadow_on, elem_id="admin-shadow-refresh")
    inspect_btn.click(cb["inspect"], inputs=[session, task, text, upload], outputs=entry,
                      api_name="admin_inspect", **private)  # fmt: skip
    evict_btn.click(cb["evict"], inputs=[session, task, text, upload, evict_ok], outputs=entry,
                    api_name="admin_evict", **private)  # fmt: skip
    shadow_btn.click(cb["shadow"], inputs=session, outputs=[summary, mismatches],
                     api_name="admin_shadow", **private)  # fmt: skip
