"""Gradio components tuned for a cache in front of a model."""

from __future__ import annotations

from typing import Any

import gradio as gr
from gradio.processing_utils import _check_allowed


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
        # Gradio stores an upload in its upload folder and checks a file reference marked
        # as FileData (`meta`) against it; a reference without the marker skips that check,
        # so apply Gradio's own rule here (InvalidPathError: the app answers 400) before
        # any file is opened. The engine reads and checks the bytes itself.
        if payload.path is not None:
            _check_allowed(payload.path, check_in_upload_folder=True)
        return payload.path
