"""The console's answers panel: the verdict (is caching worth it), Redis and GPU health, the
sizing curves of L1 and L2, and CSV downloads of the request log and the audit log. Callbacks
check the session, call admin.insights.service, and hand plain data to admin.insights.charts."""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gradio as gr

from admin.console.service import LogUnavailableError
from admin.insights.charts import gpu_figure, health_html, sizing_figure, sizing_sentence, worth_html
from admin.insights.service import Insights
from engine.errors import InvalidInputError

# The console ticks its Refresh button itself: no request at all while the browser tab is hidden,
# the Admin tab is not shown, or the operator turned auto-refresh off.
AUTO_REFRESH_S = 10.0
AUTO_REFRESH_JS = """() => {
  const console_ = document.querySelector('#admin-console');
  const auto = document.querySelector('#admin-auto-refresh input');
  if (document.visibilityState !== 'visible' || !console_ || !console_.offsetParent) return;
  if (auto && !auto.checked) return;
  document.querySelector('#admin-refresh')?.click();
}"""
CSV_KEEP_S = 600  # a prepared download stays this long, then the next export removes it
INSIGHTS_CSS = """
.stat-card.stat-warn { border-color: #dc2626; background: #fef2f2; }
.health-warning { color: #b91c1c; font-weight: 600; margin: 4px 0; }
.health-note { color: var(--body-text-color-subdued); margin: 4px 0; }
.verdict { font-size: 16px; margin: 6px 0 10px; }
"""


class CsvFiles:
    """Where the console writes a CSV for Gradio to hand out: one private folder, each file
    removed CSV_KEEP_S after it was made (Gradio keeps its own copy to serve)."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.gettempdir()) / "infcache-csv"

    def write(self, name: str, lines: Iterator[str]) -> str:
        self._dir.mkdir(mode=0o700, exist_ok=True)
        cutoff = time.time() - CSV_KEEP_S
        for old in self._dir.glob("*.csv"):
            if old.stat().st_mtime < cutoff:
                old.unlink(missing_ok=True)
        path = self._dir / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}.csv"
        with path.open("w", encoding="utf-8", newline="") as out:
            out.writelines(lines)
        return str(path)


def _guarded(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except (InvalidInputError, LogUnavailableError) as exc:
        message = exc.message if isinstance(exc, InvalidInputError) else str(exc)
        raise gr.Error(message, print_exception=False) from None


def make_insights_callbacks(insights: Insights) -> dict[str, Callable[..., Any]]:
    csv_files = CsvFiles()

    def require(session: str | None) -> None:
        if not session:
            raise gr.Error("Sign in with the admin token first.", print_exception=False)

    def refresh(session: str | None, window: str) -> tuple[Any, ...]:
        require(session)
        nodes = insights.redis_nodes()  # one INFO round per primary for both answers
        worth = _guarded(lambda: insights.worth(window))
        sizing = _guarded(lambda: insights.sizing(window, nodes=nodes))
        health = insights.health(nodes=nodes)
        overall = sizing.get("overall")
        sentences = [sizing_sentence(overall, "l1")]
        if overall and overall.get("l2") is not None:
            sentences.append(sizing_sentence(overall, "l2"))
        return (
            worth_html(worth),
            health_html(health),
            # The trend only where there is a GPU; on the CPU the health cards say there is none.
            gr.update(value=gpu_figure(health["gpu"]), visible=health["gpu"]["enabled"]),
            "  \n".join(sentences),
            sizing_figure(sizing, "l1"),
            sizing_figure(sizing, "l2"),
        )

    def requests_csv(session: str | None, window: str) -> str:
        require(session)
        return csv_files.write("requests", _guarded(lambda: insights.requests_csv(window)))

    def audit_csv(session: str | None) -> str:
        require(session)
        return csv_files.write("audit", insights.audit_csv())

    return {"refresh": refresh, "requests_csv": requests_csv, "audit_csv": audit_csv}


def build_insights_panel(
    insights: Insights, session: gr.State, window: gr.Radio, triggers: list[Any]
) -> Callable[[Any], None]:
    """Call inside the console's column. Refreshed by `triggers` (Refresh, the window, the
    auto-refresh that clicks Refresh); returns `after(event)` to refresh after sign-in."""
    cb = make_insights_callbacks(insights)
    private = {"api_visibility": "private"}
    with gr.Accordion("Is caching worth it · health · sizing", open=True, elem_id="admin-insights"):
        verdict = gr.HTML(elem_id="admin-verdict")
        health = gr.HTML(elem_id="admin-health")
        gpu_plot = gr.Plot(label="GPU", elem_id="admin-gpu", visible=False)
        sizing_text = gr.Markdown(elem_id="admin-sizing-text")
        with gr.Row():
            l1_plot = gr.Plot(label="L1 sizing", elem_id="admin-sizing-l1")
            l2_plot = gr.Plot(label="L2 sizing", elem_id="admin-sizing-l2")
        with gr.Row():
            requests_btn = gr.Button(
                "Export request log (CSV, this window)", size="sm", elem_id="admin-csv-requests"
            )
            audit_btn = gr.Button("Export audit log (CSV)", size="sm", elem_id="admin-csv-audit")
        csv_file = gr.File(label="CSV download", interactive=False, elem_id="admin-csv-file")
    outputs = [verdict, health, gpu_plot, sizing_text, l1_plot, l2_plot]

    def if_signed_in(session_value: str | None, window_value: str) -> Any:
        if not session_value:
            return tuple(gr.skip() for _ in outputs)
        return cb["refresh"](session_value, window_value)

    gr.on(triggers, if_signed_in, inputs=[session, window], outputs=outputs, **private)
    requests_btn.click(cb["requests_csv"], inputs=[session, window], outputs=csv_file, **private)
    audit_btn.click(cb["audit_csv"], inputs=session, outputs=csv_file, **private)

    def after(event: Any) -> None:
        event.then(if_signed_in, inputs=[session, window], outputs=outputs, **private)

    return after
