"""The hard examples' JSON API (admin.hard_examples.service), added to the admin router:

    GET  /admin/api/hard-examples?task=<task>[&state=all|pending|labelled|none|skipped][&limit=100]
    POST /admin/api/hard-examples/{id}/label   {"task": ..., "label": "<class>" | "none of these"}
                                               or {"task": ..., "action": "skip" | "delete"}
    GET  /admin/api/hard-examples/export?task=<task>&format=parquet|imagefolder[&include=labelled|all]

Bearer token as every admin call; errors are `{"error": ...}` with 400, 404 (task or example),
409 (collection off) or 503 (Redis), and a log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from admin.bodies import BodySpec
from admin.hard_examples.service import HardExampleAdmin
from engine.errors import InvalidInputError

log = logging.getLogger(__name__)

_STATUS = {"unknown_task": 404, "unknown_example": 404, "hard_examples_off": 409, "redis_unavailable": 503}
_LABEL_DOCS = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["task"], "properties": {
        "task": {"type": "string"}, "label": {"type": "string", "description": "a class, or 'none of these'"},
        "action": {"enum": ["label", "none", "skip", "delete"]}}}}}}}  # fmt: skip


LABEL_BODY = BodySpec({"task": "string", "label": "string", "action": "string"})

def _refused(what: str, exc: InvalidInputError) -> JSONResponse:
    status = _STATUS.get(exc.code, 400)
    log.info("admin %s refused (%s): %s", what, status, exc.message)
    return JSONResponse({"error": exc.message}, status_code=status)


def add_hard_example_routes(
    router: APIRouter,
    hard: HardExampleAdmin,
    *,
    authorize: Callable[[Request], JSONResponse | None],
    actor: Callable[[Request], str],
    strict_body: Callable[[Request, BodySpec], Awaitable[dict[str, Any] | JSONResponse]],
) -> None:
    @router.get("/admin/api/hard-examples")
    async def hard_examples(request: Request, task: str | None = None, state: str = "all",
                            limit: str = "100") -> Response:  # fmt: skip
        """The kept examples of a task with the model's answer, times asked and the label."""
        if (refused := authorize(request)) is not None:
            return refused
        try:
            # ASCII digits only: "²".isdigit() is true, and int() refuses it.
            if not (limit.isascii() and limit.isdigit()) or len(limit) > 6:
                raise InvalidInputError("bad_limit", "limit must be a whole number")
            body = await asyncio.to_thread(hard.listing, task, state=state, limit=int(limit))
        except InvalidInputError as exc:
            return _refused("hard-examples list", exc)
        return Response(json.dumps(body, ensure_ascii=False), media_type="application/json")

    @router.get("/admin/api/hard-examples/export")
    async def hard_examples_export(request: Request, task: str | None = None, format: str = "parquet",
                                   include: str = "labelled") -> Response:  # fmt: skip
        """The labelled examples as Parquet or a zip (imagefolder / text-classification layout)."""
        if (refused := authorize(request)) is not None:
            return refused
        try:
            data, name, media = await asyncio.to_thread(hard.export, task, fmt=format, include=include,
                                                        actor=actor(request))  # fmt: skip
        except InvalidInputError as exc:
            return _refused("hard-examples export", exc)
        disposition = f'attachment; filename="{name}"'
        return Response(data, media_type=media, headers={"Content-Disposition": disposition})

    @router.post("/admin/api/hard-examples/{ident}/label", openapi_extra=_LABEL_DOCS)
    async def hard_example_label(request: Request, ident: str) -> JSONResponse:
        """Label one example (a class of the model, or "none of these"), skip it or delete it."""
        if (refused := authorize(request)) is not None:
            return refused
        body = await strict_body(request, LABEL_BODY)
        if isinstance(body, JSONResponse):
            return body
        task, label, action = body.get("task"), body.get("label"), body.get("action")
        if action is None and label is None:
            return _refused("hard-example label", InvalidInputError(
                "bad_request", 'the body needs "label" (a class or "none of these") or "action"'))
        try:
            result = await asyncio.to_thread(hard.act, task, ident, action=action, label=label,
                                             actor=actor(request))  # fmt: skip
        except InvalidInputError as exc:
            return _refused("hard-example label", exc)
        return JSONResponse(result)
