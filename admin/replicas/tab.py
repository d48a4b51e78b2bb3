"""The console's Replicas table (the replica registry, engine.fleet.member) and the line that says
how far a flush or a bump reached."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import gradio as gr

from admin.console.service import AdminService, FleetUnavailableError

REPLICA_HEADERS = ["replica", "state", "host", "started (UTC)", "last seen", "generation", "flush epoch",
                   "L1 entries", "L1 MB", "hit rate", "L1 served", "L2", "models"]  # fmt: skip


def _when(at: Any) -> str:
    if not isinstance(at, int | float):
        return "–"
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def replica_rows(replicas: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for r in replicas:
        rate = r.get("hit_rate")
        rows.append([
            str(r.get("id", "?")) + (" (this one)" if r.get("self") else ""), r.get("state", "?"),
            r.get("host", "–"),
            _when(r.get("started_at")), f"{r.get('seen_s_ago', 0):.1f} s ago", r.get("generation"),
            r.get("flush_epoch"), r.get("l1_entries"), round((r.get("l1_bytes") or 0) / 1e6, 2),
            "–" if rate is None else f"{100 * rate:.1f}%",
            {True: "yes", False: "no (generation unconfirmed)"}.get(r.get("l1_readable", True), "–"),
            r.get("l2", "–"), ", ".join(f"{t} {v[:12]}" for t, v in sorted((r.get("models") or {}).items())),
        ])  # fmt: skip
    return rows


def fleet_line(result: dict[str, Any]) -> str:
    """Markdown: which replicas confirmed an action, and by name those that did not."""
    fleet = result.get("fleet")
    if not fleet:
        return ""
    if fleet.get("error"):
        return f" · **Other replicas not reached:** {fleet['error']}"
    parts = [f"confirmed by {len(fleet['confirmed'])} replica(s) in {fleet['waited_s']:.2f} s"]
    if fleet["unconfirmed"]:
        names = ", ".join(fleet["unconfirmed"])
        parts.append(f"**not confirmed within {fleet['timeout_s']:.0f} s: {names}**")
    if fleet["left"]:
        parts.append(f"**left the registry meanwhile: {', '.join(fleet['left'])}**")
    if fleet["lost"]:
        parts.append(f"without a heartbeat (dead or cut off from Redis): {', '.join(fleet['lost'])}")
    return " · " + " · ".join(parts)


def make_replicas_callback(admin: AdminService) -> Callable[[str | None], list[list[Any]]]:
    def replicas(session: str | None) -> list[list[Any]]:
        if not session:
            raise gr.Error("Sign in with the admin token first.", print_exception=False)
        try:
            return replica_rows(admin.replicas())
        except FleetUnavailableError as exc:
            raise gr.Error(str(exc), print_exception=False) from None

    return replicas


def build_replicas_panel(admin: AdminService, session: gr.State, triggers: list[Any]) -> Callable[..., Any]:
    """Call inside the console's column: the table, refreshed by `triggers` (e.g. the
    Refresh button's click). Returns the refresh for events that must run it after another
    (sign-in): `event.then(*returned)`-style, as `(fn, inputs, outputs)` keyword arguments."""
    table = gr.Dataframe(headers=REPLICA_HEADERS, label="Replicas", interactive=False,
                         elem_id="admin-replicas")  # fmt: skip
    refresh = make_replicas_callback(admin)

    def if_signed_in(session_value: str | None) -> Any:
        return refresh(session_value) if session_value else gr.skip()

    gr.on(triggers, if_signed_in, inputs=session, outputs=table, api_visibility="private")

    def after(event: Any) -> None:
        event.then(if_signed_in, inputs=session, outputs=table, api_visibility="private")

    return after
