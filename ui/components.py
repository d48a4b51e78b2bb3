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

    def preprocess(self, payload: Any) -> str | None:  # type: ignore[override]
        if payload is None:
            return None
        return payload.path
