"""Entry point (Hugging Face Spaces runs `python app.py`): settings, runtime, UI, serve."""

from __future__ import annotations

import logging

from engine.runtime import build_runtime
from settings import Settings
from ui.server import serve


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    with build_runtime(settings) as runtime:
        serve(runtime)


if __name__ == "__main__":
    main()
