"""Gradio components tuned for a cache in front of a model."""

from __future__ import annotations

from typing import Any

import gradio as gr


class UploadedImage(gr.Image):
    """`gr.Image` that hands the callback the uploaded file untouched.

    The stock component decodes, converts and re-encodes every upload before the
    callback runs. The engine needs the original bytes: to key an identical
    re-upload without decoding, to apply its own size and pixel limits before
    any decoding (decompression bombs), and to give bad files a clear error.
    """

    # Use the stock Image widget in the browser: without this, Gradio treats a
    # subclass as a custom component and the page asks for a bundle that does not exist.
    is_template = True

    def preprocess(self, payload: Any) -> str | None:  # type: ignore[override]
        if payload is None:
            return None
        # Gradio has already stored the file in its upload folder (and applied its own
        # allowed/blocked-path rules); the engine reads and checks the bytes itself.
        return payload.path
