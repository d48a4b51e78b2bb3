"""The console's Models panel: each served model with its version, a live reload
(engine.lifecycle.reload through AdminService.reload_model, audited, reaching every replica), and the
L2 entries of old versions (engine.lifecycle.cleanup): a sampled count, a dry run, a background deletion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from admin.console.service import AdminService
from admin.models.warmup_tab import build_warmup_panel
from admin.replicas.tab import fleet_line
from engine.errors import InvalidInputError, ModelLoadError
from engine.lifecycle.reload import ReloadBusyError

MODEL_HEADERS = ["task", "model", "version", "device", "backend"]


def model_rows(admin: AdminService) -> list[list[str]]:
    models = admin.cache_state_models()
    return [[task, m["name"], m["version"], m["device"], _backend(m)] for task, m in models.items()]


def _backend(model: dict[str, Any]) -> str:
    """The backend, and why torch where onnxruntime was asked for and refused."""
    reason = model.get("backend_reason")
    return f"{model['backend']} ({reason})" if reason else model["backend"]


def reload_message(result: dict[str, Any]) -> str:
    if not result["changed"]:
        return (f"**{result['task']}: the source holds version `{result['version']}` already**; "
                "nothing swapped." + fleet_line(result))  # fmt: skip
    return (f"**{result['task']} reloaded:** version `{result['version_before']}` → `{result['version']}` "
            f"(loaded and checked in {result['load_s']:.1f} s)" + fleet_line(result))  # fmt: skip


def make_reload_callback(admin: AdminService) -> Callable[..., tuple[str, list[list[str]]]]:
    def reload(session: str | None, task: str | None, note: str | None) -> tuple[str, list[list[str]]]:
        if not session:
            raise gr.Error("Sign in with the admin token first.", print_exception=False)
        if not task:
            raise gr.Error("Choose the model to reload.", print_exception=False)
        try:
            result = admin.reload_model(task, actor=session, note=note)
        except InvalidInputError as exc:
            raise gr.Error(exc.message, print_exception=False) from None
        except (ReloadBusyError, ModelLoadError) as exc:
            return f"**Not reloaded; the old model keeps serving.** {exc}", model_rows(admin)
        return reload_message(result), model_rows(admin)

    return reload


def build_models_panel(admin: AdminService, session: gr.State) -> None:
    """Call inside the console's column."""
    tasks = admin.tasks()
    with gr.Accordion("Models", open=False, elem_id="admin-models"):
        table = gr.Dataframe(headers=MODEL_HEADERS, value=model_rows(admin), label="Served models",
                             interactive=False, elem_id="admin-models-table")  # fmt: skip
        with gr.Row():
            task = gr.Dropdown(tasks, value=tasks[0] if tasks else None, label="Model",
                               elem_id="admin-reload-task")  # fmt: skip
            note = gr.Textbox(label="Note for the audit log (optional)", elem_id="admin-reload-note")
            button = gr.Button("Reload from its source", variant="stop", elem_id="admin-reload")
        gr.Markdown("<small>Loads the model's files again beside the serving one, checks it with one "
                    "forward pass and swaps it in on every replica; on failure the old one keeps "
                    "serving.</small>")  # fmt: skip
        result = gr.Markdown(elem_id="admin-reload-result")
    button.click(make_reload_callback(admin), inputs=[session, task, note], outputs=[result, table],
                 api_name="admin_reload", api_visibility="undocumented")  # fmt: skip
    build_warmup_panel(admin, session)
    build_cleanup_panel(admin, session)


CENSUS_HEADERS = ["task", "model version", "generation", "entries", "served now"]


def cleanup_text(progress: dict[str, Any] | None) -> str:
    if progress is None:
        return "No clean-up has run on this replica yet."
    what = "Counted (dry run)" if progress["dry_run"] else "Deleted"
    done = progress["deleted"] if not progress["dry_run"] else progress["matched"]
    line = (f"**{what}: {done:,}** old entries of {progress['scanned']:,} keys examined · "
            f"{progress['primaries_done']}/{progress['primaries']} primaries · "
            f"{progress['state']}")  # fmt: skip
    return line + (f" · {progress['error']}" if progress.get("error") else "")


def make_cleanup_callbacks(admin: AdminService) -> dict[str, Callable[..., Any]]:
    def signed_in(session: str | None) -> str:
        if not session:
            raise gr.Error("Sign in with the admin token first.", print_exception=False)
        return session

    def census(session: str | None) -> tuple[list[list[Any]], str]:
        signed_in(session)
        try:
            data = admin.l2_versions()
        except InvalidInputError as exc:
            raise gr.Error(exc.message, print_exception=False) from None
        rows = [[r["task"], r["model_version"], r["generation"], r["entries"],
                 "yes" if r["current"] else "no"] for r in data["rows"]]  # fmt: skip
        how = "exact" if data["exact"] else f"estimated from {data['scanned']:,} sampled keys"
        return rows, f"About **{data['old_estimate']:,}** entries of old versions or generations ({how})."

    def start(session: str | None, dry_run: bool, confirmed: bool) -> str:
        actor = signed_in(session)
        if not dry_run and not confirmed:
            raise gr.Error(
                "Count first (dry run), then tick “I understand” to delete.", print_exception=False
            )
        try:
            return cleanup_text(admin.start_cleanup(dry_run=dry_run, actor=actor))
        except InvalidInputError as exc:
            raise gr.Error(exc.message, print_exception=False) from None

    def progress(session: str | None) -> str:
        signed_in(session)
        return cleanup_text(admin.cleanup_progress())

    return {"census": census, "start": start, "progress": progress}


def build_cleanup_panel(admin: AdminService, session: gr.State) -> None:
    cb = make_cleanup_callbacks(admin)
    private = {"api_visibility": "private"}
    with gr.Accordion("Old versions in Redis", open=False, elem_id="admin-cleanup"):
        census_btn = gr.Button("Count L2 entries by version", elem_id="admin-census")
        census_table = gr.Dataframe(headers=CENSUS_HEADERS, interactive=False, elem_id="admin-census-table")
        census_note = gr.Markdown(elem_id="admin-census-note")
        with gr.Row():
            dry_btn = gr.Button("Count old entries (dry run)", elem_id="admin-cleanup-dry")
            confirm = gr.Checkbox(label="I understand: entries of old versions and generations are deleted",
                                  elem_id="admin-cleanup-confirm")  # fmt: skip
            delete_btn = gr.Button("Delete old entries", variant="stop", elem_id="admin-cleanup-delete")
            progress_btn = gr.Button("Refresh progress", size="sm", elem_id="admin-cleanup-refresh")
        progress = gr.Markdown(elem_id="admin-cleanup-progress")
    census_btn.click(cb["census"], inputs=session, outputs=[census_table, census_note], **private)
    dry_btn.click(lambda s: cb["start"](s, True, False), inputs=session, outputs=progress, **private)
    delete_btn.click(
        lambda s, c: cb["start"](s, False, c), inputs=[session, confirm], outputs=progress, **private
    )
    progress_btn.click(cb["progress"], inputs=session, outputs=progress, **private)
