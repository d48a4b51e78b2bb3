"""Gradio components tuned for a cache in front of a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr
from gradio.processing_utils import _check_allowed

EXAMPLE_UPLOAD = "cat.jpg"  # the API page's example file when the app has no example photo


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

    # The API page's example file: set on the instance before the app is served (not an
    # __init__ argument: Gradio builds a component's config from its __init__'s signature).
    example_path: str = EXAMPLE_UPLOAD

    def example_payload(self) -> Any:
        """The file the "Use via API" page's snippets send (gradio_client.snippet renders a
        FileData with a `url` as `handle_file('<url>')` in Python and uploads it in bash).
        Gradio's own example is a URL to a photo on GitHub, which this app refuses: it never
        fetches URLs. A local file the client uploads instead: the app's example photo
        where it has one (a path that works as printed on the machine serving the app)."""
        name = Path(self.example_path).name
        return {"path": self.example_path, "url": self.example_path, "orig_name": name,
                "meta": {"_type": "gradio.FileData"}}  # fmt: skip

    def example_value(self) -> Any:
        return self.example_path

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
