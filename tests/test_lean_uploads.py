"""A repeated upload answered without Gradio (ui.lean_uploads): the same bytes and headers as
Gradio's own answer, the path usable in a call, and everything else left to Gradio."""

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


def test_a_repeated_upload_is_answered_as_gradio_answers_it(served) -> None:
    http, shortcut = served
    data = b"\x89PNG not really " + secrets.token_bytes(64 * 1024)  # new to the upload folder
    first = upload(http, "cat photo.png", data)  # stored by Gradio
    assert first.status_code == 200 and shortcut.uploads.answered == 0
    path = Path(first.json()[0])
    os.utime(path, (1_000_000, 1_000_000))
    again = upload(http, "cat photo.png", data, headers={"origin": "http://localhost:3000"})
    assert shortcut.uploads.answered == 1
    assert path.stat().st_mtime > 1_000_000  # touched, as Gradio's rename of a new copy would
    shortcut.enabled = False
    gradio = upload(http, "cat photo.png", data, headers={"origin": "http://localhost:3000"})
    shortcut.enabled = True
    assert shortcut.uploads.answered == 1
    assert answer(again) == answer(gradio) and answer(first)[2] == answer(gradio)[2]
    assert "access-control-allow-origin" in again.headers  # Gradio's CORS middleware is outside
    # The path answered here is one a call may name (Blocks.upload_file_set).
    blocks = shortcut._blocks
    blocks.upload_file_set.discard(str(path))
    upload(http, "cat photo.png", data)
    assert shortcut.uploads.answered == 2 and str(path) in blocks.upload_file_set
    assert path.read_bytes() == data


def test_anything_but_a_stored_file_is_gradios(served) -> None:
    http, shortcut = served
    data = secrets.token_bytes(4096)
    stored = Path(upload(http, "a.png", data).json()[0])
    upload(http, "b.png", data)  # the same bytes under another name: a new file, Gradio's
    assert shortcut.uploads.answered == 0
    stored.write_bytes(data[:100])  # not what its address says: Gradio writes it again
    assert upload(http, "a.png", data).json() == [str(stored)] and shortcut.uploads.answered == 0
    assert stored.read_bytes() == data
    two = http.post(UPLOAD, files=[("files", ("a.png", data)), ("files", ("c.png", data))])
    assert two.status_code == 200 and len(two.json()) == 2
    tracked = http.post(UPLOAD, params={"upload_id": "abc"}, files={"files": ("a.png", data)})
    assert tracked.status_code == 200
    other_field = http.post(UPLOAD, files={"file": ("a.png", data)})
    assert other_field.status_code == 200 and other_field.json() == []
    broken = http.post(UPLOAD, content=b"--x\r\nnot a form",
                       headers={"content-type": "multipart/form-data; boundary=x"})  # fmt: skip
    assert broken.status_code in (400, 413)  # Gradio's refusal
    assert shortcut.uploads.answered == 0
    assert upload(http, "a.png", data).json() == [str(stored)] and shortcut.uploads.answered == 1
