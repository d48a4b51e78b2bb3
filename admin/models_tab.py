"""The console's Models panel: each served model with its version, and a live reload
(engine.lifecycle through AdminService.reload_model, audited, reaching every replica)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from admin.replicas_tab import fleet_line
from admin.service import AdminService
from engine.errors import InvalidInputError, ModelLoadError
from engine.lifecycle import ReloadBusyError

MODEL_HEADERS = ["task", "model", "version", "device"]


def model_rows(admin: AdminService) -> list[list[str]]:
    models = admin.cache_state_models()
    return [[task, m["name"], m["version"], m["device"]] for task, m in models.items()]


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
