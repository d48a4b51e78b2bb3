"""The console's "Busiest clients" table (admin.clients.service): this replica's clients with the most
misses and refusals in the console's window, by label (never an address), under a warning for
each untrusted proxy that forwards many clients (engine.capacity.forwarding)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from admin.clients.service import ClientActivity
from admin.console.service import WINDOWS_S

CLIENT_HEADERS = ["client (prefix #hash)", "misses", "hits", "refused misses"]


def client_rows(activity: ClientActivity, window: str) -> list[list[Any]]:
    window_s = WINDOWS_S.get(window, WINDOWS_S["1h"])
    return [[r.client, r.misses, r.hits, r.refused] for r in activity.busiest(window_s)]


def proxy_notice(activity: ClientActivity) -> str:
    """A warning per untrusted peer that forwarded several clients (engine.capacity.forwarding): they
    all count as one client, sharing one miss budget. Empty when there is none."""
    proxies = activity.forwarding.untrusted_proxies() if activity.forwarding is not None else []
    return "\n".join(
        f"⚠️ **{p.peer}** forwarded {p.clients}+ different clients in `X-Forwarded-For` but is not a "
        "trusted proxy, so every client behind it counts as one and shares one miss budget. If it is "
        "your proxy or load balancer, set `FORWARDED_ALLOW_IPS` to its address or network (or "
        "`FORWARDED_TRUSTED_HOPS=1` where it appends the client's address)."
        for p in proxies
    )


def build_clients_panel(
    activity: ClientActivity, session: gr.State, window: gr.Radio, triggers: list[Any]
) -> Callable[[Any], None]:
    """Call inside the console's column: the table, refreshed by `triggers`; returns
    `after(event)`, which refreshes it after another event (sign-in)."""
    notice = gr.Markdown("", elem_id="admin-proxy-notice")  # filled after sign-in
    table = gr.Dataframe(headers=CLIENT_HEADERS, label="Busiest clients (this replica)", interactive=False,
                         elem_id="admin-clients")  # fmt: skip

    def if_signed_in(session_value: str | None, window_value: str) -> Any:
        if not session_value:
            return gr.skip(), gr.skip()
        return proxy_notice(activity), client_rows(activity, window_value)

    outputs = [notice, table]
    gr.on(triggers, if_signed_in, inputs=[session, window], outputs=outputs, api_visibility="private")

    def after(event: Any) -> None:
        event.then(if_signed_in, inputs=[session, window], outputs=outputs, api_visibility="private")

    return after
