"""The console's "Busiest clients" table (admin.clients): this replica's clients with the most
misses and refusals in the console's window, by label (never an address)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from admin.clients import ClientActivity
from admin.service import WINDOWS_S

CLIENT_HEADERS = ["client (prefix #hash)", "misses", "hits", "refused misses"]


def client_rows(activity: ClientActivity, window: str) -> list[list[Any]]:
    window_s = WINDOWS_S.get(window, WINDOWS_S["1h"])
    return [[r.client, r.misses, r.hits, r.refused] for r in activity.busiest(window_s)]


def build_clients_panel(
    activity: ClientActivity, session: gr.State, window: gr.Radio, triggers: list[Any]
) -> Callable[[Any], None]:
    """Call inside the console's column: the table, refreshed by `triggers`; returns
    `after(event)`, which refreshes it after another event (sign-in)."""
    table = gr.Dataframe(headers=CLIENT_HEADERS, label="Busiest clients (this replica)", interactive=False,
                         elem_id="admin-clients")  # fmt: skip

    def if_signed_in(session_value: str | None, window_value: str) -> Any:
        return client_rows(activity, window_value) if session_value else gr.skip()

    gr.on(triggers, if_signed_in, inputs=[session, window], outputs=table, api_visibility="private")

    def after(event: Any) -> None:
        event.then(if_signed_in, inputs=[session, window], outputs=table, api_visibility="private")

    return after
