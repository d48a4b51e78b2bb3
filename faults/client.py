"""Talking to the apps: classify calls sorted into outcomes, admin JSON calls, /metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from faults.config import SERVER_FAULT_WORDS, TOKEN
from testing.gradio_http import GradioHttpClient, Reply, file_data, not_ready


@dataclass
class Outcome:
    kind: str  # "answer" | "input_error" | "failure" | "unreachable"
    label: dict[str, Any] | None = None
    info: dict[str, Any] | None = None
    message: str | None = None
    status: int | None = None


@dataclass(frozen=True)
class ForgedPath:
    """An image "upload" that names a path on the server instead of uploading a file."""

    path: str


_TRANSPORT_ERRORS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class FaultClient:
    """Gradio's HTTP API for one replica, each request's result sorted into an Outcome."""

    def __init__(self, base_url: str, *, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self._gradio = GradioHttpClient(base_url, timeout_s=timeout_s, headers=headers)

    def close(self) -> None:
        self._gradio.close()

    def classify(self, task: str, raw: Any, name: str = "upload.png") -> Outcome:
        try:
            if task == "text":
                return outcome_of(self._gradio.call("classify_text", [raw]))
            if isinstance(raw, ForgedPath):
                return outcome_of(self._gradio.call("classify_image", [file_data(raw.path)]))
            uploaded = self._gradio.upload(name, raw)
            if not_ready(uploaded):
                return Outcome("unreachable", message="not ready (503)", status=503)
            if uploaded.status_code >= 500:
                return Outcome(
                    "failure", message=f"upload: HTTP {uploaded.status_code}", status=uploaded.status_code
                )
            if uploaded.status_code != 200:  # refused at the door (e.g. 413): a clear input error
                return Outcome(
                    "input_error", message=uploaded.text.strip()[:300], status=uploaded.status_code
                )
            uploaded_file = file_data(uploaded.json()[0], name)
            return outcome_of(self._gradio.call("classify_image", [uploaded_file]))
        except _TRANSPORT_ERRORS as exc:
            return Outcome("unreachable", message=f"{type(exc).__name__}: {exc}")
        except httpx.TimeoutException as exc:
            return Outcome("failure", message=f"no answer within the request timeout ({type(exc).__name__})")
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            return Outcome("failure", message=f"{type(exc).__name__}: {exc}"[:300])


def outcome_of(reply: Reply) -> Outcome:
    """A call's reply judged as a client sees it: an answer, a clear input error, a failure,
    or (a replica still starting) unreachable, as a load balancer checking /readyz sees it."""
    if reply.not_ready:
        return Outcome("unreachable", message="not ready (503)", status=reply.status)
    if 400 <= reply.status < 500:  # refused before queueing: the client's mistake
        return Outcome("input_error", message=reply.body[:300], status=reply.status)
    if reply.status != 200:
        return Outcome(
            "failure", message=f"call: HTTP {reply.status} {reply.body[:200]}", status=reply.status
        )
    if reply.event is None:
        return Outcome("failure", message=f"no result event in the stream: {reply.body[:200]!r}")
    if reply.event == "complete":
        label, info = reply.data[0], reply.data[1]
        if not isinstance(label, dict) or not isinstance(info, dict):
            return Outcome("failure", message=f"malformed answer: {str(reply.data)[:200]}")
        return Outcome("answer", label=label, info=info)
    message = reply.error_message
    if message is None or not message.strip():
        return Outcome("failure", message=f"error without a message: {str(reply.data)[:200]}")
    if any(word in message for word in SERVER_FAULT_WORDS):
        return Outcome("failure", message=message[:300])
    return Outcome("input_error", message=message)


def http_json(
    client: httpx.Client,
    method: str,
    path: str,
    *,
    token: str | None = TOKEN,
    body: dict[str, Any] | None = None,
    headers: dict[str, Any] | None = None,
) -> tuple[int, Any]:
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    if method == "GET":
        response = client.get(path, headers=sent)
    else:
        response = client.post(
            path,
            content=json.dumps(body or {}).encode(),
            headers={**sent, "content-type": "application/json"},
        )
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def read_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10.0).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample in (name, name + "_total") and set(labels.items()) <= set(sample_labels)
    )
