"""Trust in one cached answer, for the operator: which input an inspect/evict call names,
and the shadow verification report the console shows."""

from __future__ import annotations

import binascii
from base64 import b64decode
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from engine.errors import InvalidInputError
from engine.pipeline.service import InferenceEngine

MISMATCH_HEADERS = ["time (UTC)", "task", "key", "cached answer", "recomputed", "versions", "evicted"]


def entry_input(body: dict[str, Any]) -> tuple[str, Any]:
    """`{"task": ..., "input": "<text>"}` or `{"task": ..., "input_base64": "<file bytes>"}`
    -> (task, the raw input as a request carries it). Raises InvalidInputError."""
    task = body.get("task")
    if not isinstance(task, str) or not task:
        raise InvalidInputError("bad_request", 'the body needs "task": the task name, e.g. "text" or "image"')
    has_text, has_b64 = "input" in body, "input_base64" in body
    if has_text == has_b64:
        raise InvalidInputError(
            "bad_request", 'give exactly one of "input" (text) or "input_base64" (file bytes)'
        )
    if has_text:
        text = body["input"]
        if not isinstance(text, str):
            raise InvalidInputError("bad_request", '"input" must be a string')
        return task, text
    encoded = body["input_base64"]
    if not isinstance(encoded, str):
        raise InvalidInputError("bad_request", '"input_base64" must be a base64 string')
    try:
        return task, b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInputError("bad_request", '"input_base64" is not valid base64') from None


def shadow_report(engine: InferenceEngine) -> dict[str, Any]:
    """Shadow verification so far: rate, checks and mismatches by task, the last mismatches."""
    shadow = engine.shadow
    if shadow is None:
        return {"enabled": False, "rate": 0.0, "checks": {}, "mismatches": {}, "dropped": 0, "recent": []}
    stats = shadow.stats()
    return {"enabled": True, **asdict(stats)}


def mismatch_rows(report: dict[str, Any]) -> list[list[str]]:
    return [
        [datetime.fromtimestamp(m["at"], tz=UTC).strftime("%Y-%m-%d %H:%M:%S"), m["task"], m["key"],
         _answer(m["cached"]), _answer(m["fresh"]), f"{m['cached_version']} / {m['fresh_version']}",
         "yes" if m["evicted"] else "no"]
        for m in report["recent"]
    ]  # fmt: skip


SHADOW_OFF_TEXT = ("**Shadow verification is off** (`SHADOW_SAMPLE_RATE=0`): no cached answer is checked "
                   "against the model. To turn it on, set `SHADOW_SAMPLE_RATE` (the share of hits "
                   "recomputed while the model is idle, e.g. 0.01) and restart the app.")


def shadow_summary(report: dict[str, Any]) -> str:
    if not report["enabled"]:
        return SHADOW_OFF_TEXT
    checks, mismatches = sum(report["checks"].values()), sum(report["mismatches"].values())
    rate = f"{100 * mismatches / checks:.2f}%" if checks else "–"
    by_task = ", ".join(
        f"{task} {report['mismatches'].get(task, 0)}/{n}" for task, n in sorted(report["checks"].items())
    )
    return (
        f"Shadow verification: {100 * report['rate']:g}% of hits recomputed while the model is idle. "
        f"**{mismatches} mismatches in {checks} checks ({rate})**"
        + (f" — {by_task}" if by_task else "")
        + f"; {report['dropped']} samples not checked (model busy)."
    )


def _answer(labels: list[list[Any]]) -> str:
    return ", ".join(f"{name} {score:.4f}" for name, score in labels[:3])
