"""The console's warm-up panel (engine.lifecycle.warmup): the inputs of the hottest keys recomputed
after a model swap or a generation bump; shows the last run's progress."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from admin.console.service import AdminService

OFF_TEXT = ("**Warm-up is off** (`WARM_SET_SIZE=0`, the default, or no Redis): no user inputs are kept, "
            "and a new version or generation is filled by the requests themselves. To turn it on, set "
            "`WARM_SET_SIZE` (how many hot keys' inputs to keep per model, e.g. 200) with Redis on "
            "(`REDIS_URL`) and restart the app.")


def warmup_text(progress: dict[str, Any]) -> str:
    if not progress.get("enabled"):
        return OFF_TEXT
    bounds = f"keeps the inputs of the {progress['size']} hottest keys per model for {progress['ttl_s']:,} s"
    if not progress.get("runs") and not progress.get("running"):
        return f"Warm-up {bounds}; none has run on this replica yet."
    state = "running" if progress["running"] else "finished"
    line = (f"**Warm-up {state}** ({', '.join(progress['tasks']) or '…'}): {progress['done']:,}/"
            f"{progress['total']:,} inputs done, {progress['computed']:,} computed by the model, "
            f"{progress['failed']:,} failed · {bounds}")  # fmt: skip
    return line + (f" · {progress['error']}" if progress.get("error") else "")


def make_warmup_callback(admin: AdminService) -> Callable[[str | None], str]:
    def refresh(session: str | None) -> str:
        if not session:
            raise gr.Error("Sign in with the admin token first.", print_exception=False)
        return warmup_text(admin.warmup_progress())

    return refresh


def build_warmup_panel(admin: AdminService, session: gr.State) -> None:
    """Call inside the console's column (next to the Models panel)."""
    enabled = bool(admin.warmup_progress().get("enabled"))  # off: says so and how to turn it on
    title = "Warm-up after a swap or a bump" + ("" if enabled else " (off)")
    with gr.Accordion(title, open=False, elem_id="admin-warmup"):
        progress = gr.Markdown(None if enabled else OFF_TEXT, elem_id="admin-warmup-progress")
        button = gr.Button("Refresh progress", size="sm", interactive=enabled, elem_id="admin-warmup-refresh")
    button.click(make_warmup_callback(admin), inputs=session, outputs=progress, api_visibility="private")
