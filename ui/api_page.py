"""The "Use via API" page's snippets, made to run as printed.

Gradio 6.31 builds each endpoint's Python, JavaScript, bash and CLI snippets on the server
(gradio_client.snippet, called by routes.prepare_api_info) and sends them in `GET
/gradio_api/info` as `code_snippets`; the page shows them as they come. Two of the bash
snippet's lines do not run as printed:

- `... | awk ... | read EVENT_ID; curl -N .../$EVENT_ID`: bash runs each part of a pipeline
  in a subshell, so the `read` sets EVENT_ID in a shell that is gone when the second curl
  runs (zsh runs the last part in the shell itself, where it works). Grouping the read and
  the curl, `| { read EVENT_ID; curl -N .../$EVENT_ID; }`, runs both in one shell: it works in
  bash, zsh and sh alike.
- an endpoint that takes a file uploads `files=@/path/to/your/file`, a placeholder; the
  example file the endpoint's component names (ui.components.UploadedImage) is put there, so
  the bash snippet sends the same file as the Python one.

`ApiSnippets` is a middleware of the mounted Gradio app that rewrites those lines of the
info answer (each snippet Gradio built; nothing else changes). A snippet that does not have
the line, as a later Gradio may write it, is left as it is.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from starlette.routing import get_route_path

from ui.asgi import ASGIApp, Message, Receive, Scope, Send

INFO_PATHS = ("/gradio_api/info", "/gradio_api/info/")
_READ_IN_SUBSHELL = re.compile(r"\| read EVENT_ID; curl -N (\S+)/\$EVENT_ID[ \t]*$", re.MULTILINE)
_UPLOAD_PLACEHOLDER = "-F 'files=@/path/to/your/file'"


def fixed_bash(snippet: str, example_file: str | None = None) -> str:
    """Gradio's bash snippet with the two fixes of the module docstring."""
    snippet = _READ_IN_SUBSHELL.sub(r"| { read EVENT_ID; curl -N \1/$EVENT_ID; }", snippet)
    if example_file is not None and _UPLOAD_PLACEHOLDER in snippet:
        snippet = snippet.replace(_UPLOAD_PLACEHOLDER, "-F " + shlex.quote(f"files=@{example_file}"))
    return snippet


def fixed_info(info: Any) -> Any:
    """The info answer with each named endpoint's bash snippet fixed (in place)."""
    endpoints = info.get("named_endpoints") if isinstance(info, dict) else None
    if not isinstance(endpoints, dict):
        return info
    for endpoint in endpoints.values():
        snippets = endpoint.get("code_snippets") if isinstance(endpoint, dict) else None
        if isinstance(snippets, dict) and isinstance(snippets.get("bash"), str):
            snippets["bash"] = fixed_bash(snippets["bash"], _example_file(endpoint))
    return info


def _example_file(endpoint: dict[str, Any]) -> str | None:
    """The local file of the endpoint's one file parameter's example, if it has exactly one."""
    files = [
        p["example_input"]["path"]
        for p in endpoint.get("parameters") or ()
        if isinstance(p, dict) and isinstance(p.get("example_input"), dict)
        and isinstance(p["example_input"].get("path"), str)
        and "://" not in p["example_input"]["path"]
    ]  # fmt: skip
    return files[0] if len(files) == 1 else None


class ApiSnippets:
    """ASGI middleware of the Gradio app: `GET /gradio_api/info` with its bash snippets fixed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or get_route_path(scope) not in INFO_PATHS:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        parts: list[bytes] = []

        async def held(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await _send_fixed(send, start, b"".join(parts))

        await self.app(scope, receive, held)


async def _send_fixed(send: Send, start: Message, body: bytes) -> None:
    headers = list(start.get("headers") or [])
    if start.get("status") == 200 and not any(k == b"content-encoding" for k, _ in headers):
        try:
            fixed = fixed_info(json.loads(body))
            body = json.dumps(fixed, ensure_ascii=False, separators=(",", ":")).encode()
        except (ValueError, RecursionError):
            pass  # not JSON: as Gradio wrote it
        headers = [(k, v) for k, v in headers if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body})
