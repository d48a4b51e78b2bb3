"""Entry point (Hugging Face Spaces runs `python app.py`): settings, then serve (which
listens at once and builds the runtime, with the composition root's `build_runtime`
beside this file, and the UI behind a readiness gate).

The heavy imports (torch, gradio, the app's modules) happen in `main`, each timed in the start
log (common.startup_clock), after malloc's arenas are limited and with Python's garbage
collector paused until the app is ready (process_setup)."""

from __future__ import annotations

import functools
import logging

from common.startup_clock import phase, process_age_s, record
from process_setup import configure_logging, limit_malloc_arenas, pause_collector, resume_collector


def main() -> None:
    limit_malloc_arenas()  # before any thread allocates (see process_setup)
    pause_collector()  # until start-up is over: it builds ~700,000 objects to keep (see process_setup)
    configure_logging()  # the app's lines at INFO, libraries' at WARNING (see process_setup)
    record("interpreter and logging", process_age_s())
    with phase("import torch"):
        import PIL.Image  # noqa: F401 - shared by both threads below: imported once, here
        import torch  # noqa: F401
    with phase("import the composition root (engine, storage, admin)"):
        from engine.models.config import ModelConfigError
        from runtime import ModelsLoading, build_runtime, model_specs
        from settings import Settings, SettingsError
    try:
        settings = Settings.from_env()
        model_specs(settings)  # a bad MODELS_CONFIG entry is named now, before anything starts
    except (SettingsError, ModelConfigError) as exc:  # a bad setting: its message, not a traceback
        logging.getLogger("app").error("refusing to start: %s", exc)
        raise SystemExit(1) from None
    # The models load while gradio is imported and the rest of the runtime is built.
    models = ModelsLoading(settings)
    with phase("import gradio and the UI"):
        from ui.server import serve
    serve(settings, build_runtime=functools.partial(build_runtime, model_factory=models),
          on_started=_resume_collector)  # fmt: skip


def _resume_collector() -> None:
    frozen = resume_collector()  # after the "ready: open ..." line, which stays the log's last
    logging.getLogger("app").debug("start-up over: %d objects frozen out of the garbage collector's scans; "
                                   "the collector runs again", frozen)  # fmt: skip


if __name__ == "__main__":
    main()
