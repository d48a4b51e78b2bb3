"""A one-file upload stored and answered without Gradio's routing.

An API client classifying an image uploads it first (`POST /gradio_api/upload`, one file in
a multipart form) and then names the path Gradio answers. Gradio stores a file under its
content's address, `<upload folder>/<sha256(seed + bytes)>/<file name>`: it parses the form,
writes the bytes to a temporary file in the upload folder while hashing them, and renames it
to that address (over the same bytes, when the file was sent before), after walking its
hundred routes to find the upload route: about two thirds of a cached image's server CPU
through Gradio's API (Gradio 6.31). `LeanUploads` does the same for the common form, exactly
one file in the field `files` (up to NEW_FILE_BYTES when new): a file already at its address
(with the bytes' size) is not written again, only its modification time set to now, as
Gradio's rename would leave it (whatever expires old uploads sees a fresh one); a new one is
written as Gradio writes it (a temporary file, mode 0600, renamed). The answer is Gradio's
(`["<the path>"]`) and the path is added to `Blocks.upload_file_set` as Gradio adds it.
Anything else (another form, a query such as `upload_id`, a body that is not a well-formed
form, a file past the size limit, a rename that fails) goes on to Gradio as it came.

The address of a body seen before is remembered by its BLAKE3 digest and file name (a small
LRU), so a repeat costs a BLAKE3 pass over the bytes instead of SHA-256 (five to eight times
slower here); the digest is collision-resistant, as the cache's own keys are.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from tempfile import NamedTemporaryFile
from typing import Any

import orjson
from blake3 import blake3
from gradio import processing_utils
from gradio.utils import DeveloperPath, UserProvidedPath, safe_join
from gradio_client.utils import strip_invalid_filename_characters
from python_multipart.multipart import MultipartParser, parse_options_header

from api.repeats import Lru
from ui.asgi import Receive, Scope, Send, read_body, replay

UPLOAD_PATH = "/gradio_api/upload"
# Forms up to this size are read whole here (a photo); a larger one streams to Gradio untouched.
MAX_REPEAT_UPLOAD_BYTES = 8 * 1024 * 1024
PART_HEADER_BYTES = 4 * 1024  # part headers past this: Gradio's to judge (its own limit is larger)
ADDRESSES = 1024  # bodies whose upload path is remembered
# A new file up to this size is written here, on the event loop (a photo: tens of microseconds);
# a larger one is Gradio's to write (in its thread pool).
NEW_FILE_BYTES = 1024 * 1024


class LeanUploads:
    """Stores and answers one-file uploads for the Gradio app `gradio_app` (see the module)."""

    def __init__(self, gradio_app: Any) -> None:
        self._blocks = gradio_app.get_blocks()
        self._folder = Path(gradio_app.uploaded_file_dir)
        self._addresses = Lru(ADDRESSES)  # (blake3 digest, file name) -> path in the upload folder
        self.answered = 0  # uploads answered here (for tests and the curious)
        self.stored = 0  # of which new files written here

    async def __call__(self, scope: Scope, receive: Receive, send: Send, app: Any) -> None:
        """Serve `POST /gradio_api/upload`: answered here when it is the common form, else by `app`."""
        content_type, declared = _form_headers(scope)
        if (
            content_type is None
            or declared is None
            or declared > MAX_REPEAT_UPLOAD_BYTES
            or scope.get("query_string")
        ):
            await app(scope, receive, send)
            return
        messages, body = await read_body(receive, MAX_REPEAT_UPLOAD_BYTES)
        path = self._stored_path(content_type, body) if isinstance(body, bytes) else None
        if path is None:
            await app(scope, replay(messages, receive), send)
            return
        self._blocks.upload_file_set.add(path)
        self.answered += 1
        # As the route's list of paths is rendered (Gradio's default response class, ORJSONResponse).
        payload = orjson.dumps([path])
        headers = [(b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    def _stored_path(self, content_type: bytes, body: bytes) -> str | None:
        """The upload folder's path of the form's one file, stored there as Gradio stores it
        (or found there, its modification time set to now), else None."""
        part = _one_file(content_type, body)
        if part is None:
            return None
        filename, data = part
        limit = self._blocks.max_file_size
        if limit is not None and len(data) > limit:
            return None  # Gradio's 413
        name = strip_invalid_filename_characters(Path(filename).name) if filename else None
        if not name:
            return None  # Gradio names it at random: a new file each time
        key = (blake3(data).digest(), name)
        path = self._addresses.get(key)
        if path is None or not _touched(path, len(data)):
            # As Gradio addresses it (route_utils.upload_fn, GradioUploadFile's sha).
            sha = hashlib.sha256(processing_utils.hash_seed)
            sha.update(data)
            try:
                path = str(
                    safe_join(DeveloperPath(str(self._folder / sha.hexdigest())), UserProvidedPath(name))
                )
            except Exception:  # an invalid name: Gradio's 400
                return None
            if not _touched(path, len(data)) and (len(data) > NEW_FILE_BYTES or not self._stored(path, data)):
                return None
        self._addresses.put(key, path)
        return path

    def _stored(self, path: str, data: bytes) -> bool:
        """`data` stored at `path` as Gradio stores an upload: a temporary file in the upload
        folder (its mode 0600, as Gradio's), renamed into its content's folder."""
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with NamedTemporaryFile(delete=False, dir=self._folder) as temp:
                temp.write(data)
        except OSError:
            return False
        try:
            os.rename(temp.name, path)
        except OSError:  # Gradio copies it in the background then: its answer
            with contextlib.suppress(OSError):
                os.unlink(temp.name)
            return False
        self.stored += 1
        return True


def _touched(path: str, size: int) -> bool:
    """Whether `path` is a file of `size` bytes; if so its modification time is set to now."""
    try:
        if not os.path.isfile(path) or os.stat(path).st_size != size:
            return False
        os.utime(path)
    except OSError:
        return False
    return True


def _form_headers(scope: Scope) -> tuple[bytes | None, int | None]:
    """The request's Content-Type when it is a multipart form, and its declared length."""
    content_type = declared = None
    for name, value in scope.get("headers") or ():
        if name == b"content-type":
            if content_type is not None:
                return None, None
            content_type = value
        elif name == b"content-length":
            if declared is not None or not value.isdigit():
                return None, None
            declared = int(value)
        elif name == b"transfer-encoding":
            return None, None
    if content_type is None or parse_options_header(content_type)[0] != b"multipart/form-data":
        return None, None
    return content_type, declared


def _one_file(content_type: bytes, body: bytes) -> tuple[str, bytes] | None:
    """(file name, bytes) of a form of exactly one part, a file in the field `files`, parsed
    as Gradio's parser reads it (python_multipart); None for anything else."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    charset = params.get(b"charset", b"utf-8")
    if not boundary or charset.lower() not in (b"utf-8", b"utf8"):
        return None
    parts: list[tuple[list[tuple[bytes, bytes]], list[bytes]]] = []
    field = [b"", b""]

    def part_begin() -> None:
        parts.append(([], []))

    def header_field(data: bytes, start: int, end: int) -> None:
        field[0] += data[start:end]

    def header_value(data: bytes, start: int, end: int) -> None:
        field[1] += data[start:end]

    def header_end() -> None:
        parts[-1][0].append((field[0].lower(), field[1]))
        field[0] = field[1] = b""

    def part_data(data: bytes, start: int, end: int) -> None:
        parts[-1][1].append(data[start:end])

    callbacks = {
        "on_part_begin": part_begin,
        "on_header_field": header_field,
        "on_header_value": header_value,
        "on_header_end": header_end,
        "on_part_data": part_data,
    }
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        if parser.write(body) != len(body):
            return None
        parser.finalize()
    except Exception:  # not a well-formed form: Gradio's to answer
        return None
    if len(parts) != 1:
        return None
    headers, chunks = parts[0]
    dispositions = [value for name, value in headers if name == b"content-disposition"]
    if len(dispositions) != 1 or sum(len(n) + len(v) for n, v in headers) > PART_HEADER_BYTES:
        return None
    kind, options = parse_options_header(dispositions[0])
    filename = options.get(b"filename")
    if kind != b"form-data" or options.get(b"name") != b"files" or filename is None:
        return None
    try:
        return filename.decode("utf-8"), b"".join(chunks)
    except UnicodeDecodeError:
        return None
