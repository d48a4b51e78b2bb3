"""One-file uploads stored and answered without Gradio's routing (ui.lean_uploads): the same
bytes and headers as Gradio's own answer, the file stored as Gradio stores it, the path usable
in a call, and everything else left to Gradio."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from storage.redis.embedded import free_port
from ui.cached_calls import CachedCalls
from ui.lean_uploads import NEW_FILE_BYTES
from ui.server import BackgroundServer, build_app

UPLOAD = "/gradio_api/upload"


@pytest.fixture
def served(make_runtime) -> Iterator[tuple[httpx.Client, CachedCalls]]:
    app = build_app(make_runtime())
    with (
        BackgroundServer(app, port=free_port()) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        yield http, app.state.cached_calls


def answer(response: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    headers = [(k, v) for k, v in response.headers.multi_items() if k != "date"]
    return response.status_code, headers, response.content


def upload(http: httpx.Client, name: str, data: bytes, **kwargs: Any) -> httpx.Response:
    return http.post(UPLOAD, files={"files": (name, data, "image/png")}, **kwargs)


def test_an_upload_is_stored_and_answered_as_gradio_does(served) -> None:
    http, shortcut = served
    uploads = shortcut.uploads
    data = b"\x89PNG not really " + secrets.token_bytes(64 * 1024)  # new to the upload folder
    shortcut.enabled = False
    by_gradio = upload(http, "cat photo.png", data, headers={"origin": "http://localhost:3000"})
    shortcut.enabled = True
    gradio_path = Path(by_gradio.json()[0])
    gradio_path.unlink()
    assert uploads.answered == 0
    new = upload(http, "cat photo.png", data, headers={"origin": "http://localhost:3000"})
    assert uploads.answered == uploads.stored == 1
    assert answer(new) == answer(by_gradio) and "access-control-allow-origin" in new.headers
    # Stored as Gradio stores it: its content's address, the bytes, a temporary file's mode.
    assert gradio_path.read_bytes() == data and gradio_path.stat().st_mode & 0o777 == 0o600
    os.utime(gradio_path, (1_000_000, 1_000_000))
    again = upload(http, "cat photo.png", data, headers={"origin": "http://localhost:3000"})
    assert uploads.answered == 2 and uploads.stored == 1  # found, not written again
    assert answer(again) == answer(by_gradio)
    assert gradio_path.stat().st_mtime > 1_000_000  # touched, as Gradio's rename of a new copy would
    # The path answered here is one a call may name (Blocks.upload_file_set).
    blocks = shortcut._blocks
    blocks.upload_file_set.discard(str(gradio_path))
    upload(http, "cat photo.png", data)
    assert uploads.answered == 3 and str(gradio_path) in blocks.upload_file_set


def test_anything_but_the_common_form_is_gradios(served) -> None:
    http, shortcut = served
    uploads = shortcut.uploads
    data = secrets.token_bytes(4096)
    stored = Path(upload(http, "a.png", data).json()[0])
    assert upload(http, "b.png", data).json() == [str(stored.with_name("b.png"))]
    assert uploads.answered == uploads.stored == 2
    stored.write_bytes(data[:100])  # not what its address says: written again
    assert upload(http, "a.png", data).json() == [str(stored)] and stored.read_bytes() == data
    assert uploads.answered == 3 and uploads.stored == 3
    two = http.post(UPLOAD, files=[("files", ("a.png", data)), ("files", ("c.png", data))])
    assert two.status_code == 200 and len(two.json()) == 2
    tracked = http.post(UPLOAD, params={"upload_id": "abc"}, files={"files": ("a.png", data)})
    assert tracked.status_code == 200
    other_field = http.post(UPLOAD, files={"file": ("a.png", data)})
    assert other_field.status_code == 200 and other_field.json() == []
    broken = http.post(UPLOAD, content=b"--x\r\nnot a form",
                       headers={"content-type": "multipart/form-data; boundary=x"})  # fmt: skip
    assert broken.status_code in (400, 413)  # Gradio's refusal
    big = secrets.token_bytes(NEW_FILE_BYTES + 1)
    assert upload(http, "big.png", big).status_code == 200  # written by Gradio
    assert uploads.answered == 3
    assert upload(http, "big.png", big).status_code == 200 and uploads.answered == 4  # found
    shortcut._blocks.max_file_size = 1000
    assert upload(http, "a.png", data).status_code == 413 and uploads.answered == 4
