"""Entry point (Hugging Face Spaces runs `python app.py`): settings, then serve (which
listens at once and builds the runtime and the UI behind a readiness gate)."""

from __future__ import annotations

import logging

from settings import Settings
from ui.server import serve


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(Settings.from_env())


if __name__ == "__main__":
    main()
