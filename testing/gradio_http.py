"""One client of Gradio's HTTP API, for the benchmark, the fault suite and the tests.

The protocol `gradio_client` speaks and Gradio's "Use via API" page shows: an image goes up
first (`POST /gradio_api/upload`, multipart; the answer lists the server's paths), then
`POST /gradio_api/call/<api_name>` with `{"data": [...]}` queues the call and answers its
`event_id`, and `GET /gradio_api/call/<api_name>/<event_id>` streams server-sent events until a
`complete` event (the outputs) or an `error` event (`{"error": "<message>"}` or `null`).

A client may send a `session_hash` with every call, as `gradio_client` and a browser tab keep
one; without it (curl style) Gradio builds a new session for each call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

FILE_META = {"_type": "gradio.FileData"}
FINAL_EVENTS = ("complete", "error")


@dataclass(frozen=True)
class Reply:
    """What one call got back: refused before it was queued (`status` is not 200 and `body` is
    the refusal), or the stream's final event (`event` "complete" or "error", `data` its JSON)."""

    status: int  # of the POST that queues the call
    event: str | None = None  # None: refused, or the stream ended without a final event
    data: Any = None
    body: str = ""  # the refusal's text, or the whole event stream
    # A 503 with Retry-After: the replica is not ready yet (still loading); a load balancer
    # that checks /readyz would not have sent the call there.
    not_ready: bool = False

    @property
    def outputs(self) -> list[Any]:
        """The outputs of a `complete` event; GradioCallError for anything else."""
        if self.event != "complete" or not isinstance(self.data, list):
            raise GradioCallError(self)
        return self.data

    @property
    def error_message(self) -> str | None:
        """The message of an `error` event, when it carries one."""
        if self.event == "error" and isinstance(self.data, dict) and isinstance(self.data.get("error"), str):
            return self.data["error"]
        return None


class GradioCallError(RuntimeError):
    """A call that did not complete: refused, answered with an error event, or a broken stream."""

    def __init__(self, reply: Reply) -> None:
        if reply.status != 200:
            what = f"HTTP {reply.status}: {reply.body[:300]}"
        elif reply.event == "error":
            what = f"error event: {reply.data!r}"[:400]
        else:
            what = f"no complete event in the stream: {reply.body[:300]!r}"
        super().__init__(what)
        self.reply = reply


def parse_event_stream(text: str) -> tuple[str, Any] | None:
    """The last `complete` or `error` event of a result stream and its data (decoded JSON; None
    for an empty payload), or None when the stream holds neither."""
    event, final = None, None
    for line in text.splitlines():
        if line.startswith("event:"):
            event = line[len("event:") :].strip()
        elif line.startswith("data:") and event in FINAL_EVENTS:
            final = (event, line[len("data:") :].strip())
    if final is None:
        return None
    event, payload = final
    return event, json.loads(payload) if payload else None


def not_ready(response: httpx.Response) -> bool:
    """The app's answer while it starts (see ui/startup.py): 503 with Retry-After."""
    return response.status_code == 503 and "retry-after" in response.headers


def file_data(path: str, orig_name: str | None = None) -> dict[str, Any]:
    """The FileData a call passes for an uploaded file (or, to test the server, any path)."""
    value: dict[str, Any] = {"path": path, "meta": dict(FILE_META)}
    if orig_name is not None:
        value["orig_name"] = orig_name
    return value


class GradioHttpClient:
    """A keep-alive HTTP client of one Gradio app. Not thread-safe: one per client thread."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 60.0,
        session_hash: str | None = None,
        local_address: str | None = None,
        headers: dict[str, str] | None = None,  # on every request (X-Forwarded-For: a client behind a proxy)
    ) -> None:
        transport = httpx.HTTPTransport(local_address=local_address) if local_address else None
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport,
                                 headers=headers)  # fmt: skip
        self.session_hash = session_hash

    def upload(self, name: str, data: bytes, mime: str = "application/octet-stream") -> httpx.Response:
        """`POST /gradio_api/upload`; the caller judges the status (a 413 is an answer too)."""
        return self.http.post("/gradio_api/upload", files={"files": (name, data, mime)})

    def upload_file(self, name: str, data: bytes, mime: str = "application/octet-stream") -> dict[str, Any]:
        """Upload, and the FileData that names the upload in a call; HTTPStatusError if refused."""
        response = self.upload(name, data, mime)
        response.raise_for_status()
        return file_data(response.json()[0], name)

    def call(self, api_name: str, data: list[Any]) -> Reply:
        """Queue one call and read its result stream. Transport errors and a failed result
        stream raise httpx errors; a refusal or an error event is a Reply."""
        body: dict[str, Any] = {"data": data}
        if self.session_hash is not None:
            body["session_hash"] = self.session_hash
        # ensure_ascii: a lone surrogate travels as a \udXXX escape, as a browser's JSON sends it.
        content = json.dumps(body, ensure_ascii=True).encode("ascii")
        queued = self.http.post(
            f"/gradio_api/call/{api_name}", content=content, headers={"content-type": "application/json"}
        )
        if queued.status_code != 200:
            return Reply(queued.status_code, body=queued.text.strip(), not_ready=not_ready(queued))
        event_id = queued.json()["event_id"]
        stream = self.http.get(f"/gradio_api/call/{api_name}/{event_id}")
        stream.raise_for_status()
        final = parse_event_stream(stream.text)
        if final is None:
            return Reply(200, body=stream.text)
        return Reply(200, final[0], final[1], stream.text)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> GradioHttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
