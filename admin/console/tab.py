"""The Admin tab. Callbacks translate widgets <-> AdminService; every one of them
checks the session's sign-in on the server (hidden buttons are not protection)."""

from __future__ import annotations

import html
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import gradio as gr

from admin.auth import AdminAuth, AuthOutcome
from admin.clients.service import ClientActivity
from admin.clients.tab import build_clients_panel
from admin.console.charts import all_figures
from admin.console.service import WINDOWS_S, AdminService, LogUnavailableError
from admin.hard_examples.tab import build_hard_examples_panel
from admin.insights.charts import state_html
from admin.insights.service import Insights
from admin.insights.tab import AUTO_REFRESH_JS, AUTO_REFRESH_S, INSIGHTS_CSS, build_insights_panel
from admin.models.tab import build_models_panel
from admin.replicas.tab import build_replicas_panel, fleet_line
from admin.trust.tab import build_trust_panel
from engine.errors import InvalidInputError

CARD_CSS = """
.stat-cards { display: flex; flex-wrap: wrap; gap: 10px; }
.stat-card { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px 14px;
             min-width: 150px; background: var(--background-fill-secondary); }
.stat-name { font-size: 12px; color: var(--body-text-color-subdued); }
.stat-value { font-size: 20px; font-weight: 600; }
""" + INSIGHTS_CSS
AUDIT_HEADERS = ["time (UTC)", "action", "parameters", "result", "who"]
NOT_SIGNED_IN = "Sign in with the admin token first."


def _client(request: gr.Request | None) -> str:
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "unknown"


def _require(session: str | None) -> str:
    if not session:
        raise gr.Error(NOT_SIGNED_IN, print_exception=False)
    return session


def stat_cards(data: dict[str, Any]) -> str:
    summary, cache = data["summary"], data["cache"]
    rate = "–" if summary["hit_rate"] is None else f"{100 * summary['hit_rate']:.1f}%"
    tiers = summary["by_tier"]
    l2 = cache["l2"]
    l2_detail = l2["state"]
    if l2.get("keys") is not None:
        l2_detail += f" · {l2['keys']:,} keys · {l2.get('memory_bytes', 0) / 1e6:.1f} MB"
    nodes = l2.get("nodes") or []
    if len(nodes) > 1:  # a cluster: keys on each primary ("down" where it did not answer)
        l2_detail += " · " + ", ".join(
            f"{n['node']}: {'down' if n['keys'] is None else format(n['keys'], ',')}" for n in nodes
        )
    rows = [
        ("Requests", f"{summary['total']:,}"),
        ("Hit rate", rate),
        ("L1 / L2 / coalesced / miss", f"{tiers['l1']:,} / {tiers['l2']:,} / {tiers['coalesced']:,} / "
                                       f"{tiers['miss']:,}"),
        ("Model time saved", f"{summary['model_seconds_saved']:.1f} s"),
        ("Rejected inputs / errors", f"{summary['invalid']:,} / {summary['errors']:,}"),
        ("L1", f"{cache['l1']['entries']:,} entries · {cache['l1']['bytes'] / 1e6:.2f} MB"),
        ("L2 (Redis)", l2_detail),
        ("Generation", str(cache["generation"])),
        ("Forward passes · mean batch", _batch_card(cache.get("batches", {}))),
        ("Log rows dropped", f"{data['log_writer']['dropped']:,}"),
    ]  # fmt: skip
    cards = "".join(
        f'<div class="stat-card"><div class="stat-name">{html.escape(name)}</div>'
        f'<div class="stat-value">{html.escape(value)}</div></div>'
        for name, value in rows
    )
    return f'<div class="stat-cards">{cards}</div>'


def _batch_card(batches: dict[str, Any]) -> str:
    parts = [
        f"{task} {b['passes']:,} · {b['mean_size'] if b['mean_size'] is not None else '–'}"
        for task, b in sorted(batches.items())
    ]
    return " / ".join(parts) or "–"


def _audit_table(admin: AdminService) -> list[list[str]]:
    return [
        [datetime.fromtimestamp(r["at"], tz=UTC).strftime("%Y-%m-%d %H:%M:%S"), r["action"], r["params"],
         r["result"], r["actor"]]
        for r in admin.audit_rows()
    ]  # fmt: skip


def make_callbacks(admin: AdminService, auth: AdminAuth) -> dict[str, Callable[..., Any]]:
    def sign_in(token: str | None, request: gr.Request) -> tuple[Any, ...]:
        outcome = auth.check(_client(request), (token or "").strip() or None)
        if outcome is AuthOutcome.OK:
            session = f"{auth.fingerprint} ui {_client(request)}"[:64]
            return session, gr.update(visible=False), gr.update(visible=True), "", ""
        message = ("Too many failed attempts. Wait a minute and try again."
                   if outcome is AuthOutcome.RATE_LIMITED else "That token is not right.")  # fmt: skip
        return None, gr.update(visible=True), gr.update(visible=False), f"**{message}**", ""

    def sign_out() -> tuple[Any, ...]:
        return None, gr.update(visible=True), gr.update(visible=False)

    def refresh(session: str | None, window: str) -> tuple[Any, ...]:
        _require(session)
        try:
            data = admin.stats(window)
        except InvalidInputError as exc:
            raise gr.Error(exc.message, print_exception=False) from None
        except LogUnavailableError as exc:
            raise gr.Error(str(exc), print_exception=False) from None
        figures = all_figures(data)
        state = data["cache"]
        return (stat_cards(data), figures["hit_rate"], figures["tiers"], figures["latency"],
                figures["hot_keys"], state_html(state), state, _audit_table(admin))  # fmt: skip

    def flush(session: str | None, tier: str, confirmed: bool) -> str:
        actor = _require(session)
        if not confirmed:
            raise gr.Error("Tick “I understand” to confirm the flush.", print_exception=False)
        try:
            result = admin.flush(tier, actor=actor)
        except InvalidInputError as exc:
            raise gr.Error(exc.message, print_exception=False) from None
        parts = [f"L1: {result['l1_removed']:,} removed"]
        if tier in ("l2", "all"):
            parts.append(f"L2: {result['l2_removed']:,} removed" if result["l2_removed"] is not None
                         else f"L2: not flushed ({result['l2_error']})")  # fmt: skip
        return f"**Flushed {tier}.** " + " · ".join(parts) + fleet_line(result)

    def bump(session: str | None, note: str | None, confirmed: bool) -> str:
        actor = _require(session)
        if not confirmed:
            raise gr.Error("Tick “I understand” to confirm the version bump.", print_exception=False)
        result = admin.bump_version(actor=actor, note=note)
        if not result["ok"]:
            return f"**Version not bumped:** {result['error']}"
        return (f"**Cache version bumped** from {result['generation_before']} to {result['generation']}."
                + fleet_line(result))  # fmt: skip

    return {"sign_in": sign_in, "sign_out": sign_out, "refresh": refresh, "flush": flush, "bump": bump}


def build_admin_tab(
    admin: AdminService, auth: AdminAuth, clients: ClientActivity | None = None,
    insights: Insights | None = None,
) -> None:  # fmt: skip
    """Call inside a `gr.Blocks` context (within `gr.Tabs`). `clients`: the Busiest clients table;
    `insights`: the answers panel (sizing, worth, health, CSV); each absent when None."""
    cb = make_callbacks(admin, auth)
    private = {"api_visibility": "undocumented"}  # callable (and refused) without sign-in, not listed
    with gr.Tab("Admin", id="admin"):
        session = gr.State(None)  # server-side per browser session: the signed-in actor
        with gr.Column(visible=True) as login_box:
            token = gr.Textbox(label="Admin token", type="password", elem_id="admin-token")
            sign_in_btn = gr.Button("Sign in", elem_id="admin-signin")
            login_msg = gr.Markdown(elem_id="admin-login-msg")
        with gr.Column(visible=False, elem_id="admin-console") as console:
            with gr.Row():
                window = gr.Radio(list(WINDOWS_S), value="1h", label="Window", elem_id="admin-window")
                auto_refresh = gr.Checkbox(value=True, label=f"Auto-refresh every {AUTO_REFRESH_S:.0f} s",
                                           elem_id="admin-auto-refresh")  # fmt: skip
                refresh_btn = gr.Button("Refresh", elem_id="admin-refresh")
                sign_out_btn = gr.Button("Sign out", size="sm")
            ticker = gr.Timer(AUTO_REFRESH_S)
            cards = gr.HTML(elem_id="admin-cards")
            with gr.Row():
                hit_plot = gr.Plot(label="Hit rate", elem_id="admin-hit-rate")
                tier_plot = gr.Plot(label="Requests by tier", elem_id="admin-tiers")
            with gr.Row():
                latency_plot = gr.Plot(label="Latency", elem_id="admin-latency")
                hot_plot = gr.Plot(label="Hot keys", elem_id="admin-hot-keys")
            state_cards = gr.HTML(label="Live cache state", elem_id="admin-state-cards")
            with gr.Accordion("Live cache state (raw JSON)", open=False, elem_id="admin-state-raw"):
                state_json = gr.JSON(label="Live cache state", elem_id="admin-state")
            with gr.Row():
                with gr.Column():
                    flush_tier = gr.Radio(["l1", "l2", "all"], value="all", label="Flush tier",
                                          elem_id="admin-flush-tier")  # fmt: skip
                    flush_ok = gr.Checkbox(label="I understand: cached answers will be recomputed",
                                           elem_id="admin-flush-confirm")  # fmt: skip
                    flush_btn = gr.Button("Flush cache", variant="stop", elem_id="admin-flush")
                with gr.Column():
                    note = gr.Textbox(label="Note for the audit log (optional)", elem_id="admin-bump-note")
                    bump_ok = gr.Checkbox(label="I understand: every cached answer becomes unreachable",
                                          elem_id="admin-bump-confirm")  # fmt: skip
                    bump_btn = gr.Button("Bump cache version", variant="stop", elem_id="admin-bump")
            action_result = gr.Markdown(elem_id="admin-action-result")
            audit = gr.Dataframe(headers=AUDIT_HEADERS, label="Audit log", interactive=False,
                                 elem_id="admin-audit")  # fmt: skip
            refreshes = [refresh_btn.click, window.change]
            replicas_after = build_replicas_panel(admin, session, refreshes)
            if clients is not None:
                clients_after = build_clients_panel(clients, session, window, refreshes)
            build_trust_panel(admin, session)
            build_models_panel(admin, session)
            build_hard_examples_panel(admin, session)
            insights_after = (build_insights_panel(insights, session, window, refreshes)
                              if insights is not None else None)  # fmt: skip

        refresh_outputs = [cards, hit_plot, tier_plot, latency_plot, hot_plot, state_cards, state_json, audit]
        sign_in_event = gr.on(
            [sign_in_btn.click, token.submit], cb["sign_in"], inputs=token,
            outputs=[session, login_box, console, login_msg, token], api_name="admin_sign_in", **private,
        )  # fmt: skip
        sign_in_event.then(_refresh_if_signed_in(cb["refresh"]), inputs=[session, window],
                           outputs=refresh_outputs, api_visibility="private")  # fmt: skip
        replicas_after(sign_in_event)
        if clients is not None:
            clients_after(sign_in_event)
        if insights_after is not None:
            insights_after(sign_in_event)
        # Auto-refresh clicks Refresh in the browser (admin.insights.tab): nothing is sent while
        # the page is hidden; the toggle stops the timer itself.
        ticker.tick(None, js=AUTO_REFRESH_JS, api_visibility="private")
        auto_refresh.change(lambda on: gr.Timer(active=on), auto_refresh, ticker, api_visibility="private")
        sign_out_btn.click(cb["sign_out"], outputs=[session, login_box, console], api_visibility="private")
        gr.on([refresh_btn.click, window.change], cb["refresh"], inputs=[session, window],
              outputs=refresh_outputs, api_name="admin_refresh", **private)  # fmt: skip
        flush_btn.click(cb["flush"], inputs=[session, flush_tier, flush_ok], outputs=action_result,
                        api_name="admin_flush", **private).success(
            cb["refresh"], inputs=[session, window], outputs=refresh_outputs, api_visibility="private"
        )  # fmt: skip
        bump_btn.click(cb["bump"], inputs=[session, note, bump_ok], outputs=action_result,
                       api_name="admin_bump", **private).success(
            cb["refresh"], inputs=[session, window], outputs=refresh_outputs, api_visibility="private"
        )  # fmt: skip


def _refresh_if_signed_in(refresh: Callable[..., Any]) -> Callable[..., Any]:
    def after_sign_in(session: str | None, window: str) -> Any:
        if not session:
            return tuple(gr.skip() for _ in range(8))
        return refresh(session, window)

    return after_sign_in
