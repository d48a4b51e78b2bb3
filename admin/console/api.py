"""The admin JSON API: every call needs `Authorization: Bearer $ADMIN_TOKEN`.

Wrong or missing token: 401 and nothing changes. Repeated failures from one
client: 429 for a while. Health and metrics endpoints live here too.

A body is read only once the token is checked (its size is bounded in front of the app,
`ui.limits`), and strictly (admin.bodies): anything but a JSON object of the endpoint's
documented fields is a 400 and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from admin.auth import AdminAuth, AuthOutcome, bearer_token
from admin.bodies import BodySpec, parse_body
from admin.console.service import AdminService, FleetUnavailableError, LogUnavailableError
from admin.hard_examples.api import add_hard_example_routes
from admin.monitoring.metrics import Metrics
from admin.trust.service import entry_input
from engine.errors import InvalidInputError, ModelLoadError
from engine.lifecycle.reload import ReloadBusyError
from engine.pipeline.service import InferenceEngine

log = logging.getLogger(__name__)


def _body_docs(**properties: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI for a JSON body of these fields (the /docs page; the schema fuzzing)."""
    schema = {"type": "object", "properties": properties}
    return {"requestBody": {"required": False, "content": {"application/json": {"schema": schema}}}}


_NOTE = {"type": "string", "description": "recorded in the audit log"}
_ENTRY_DOCS = _body_docs(
    task={"type": "string"},
    input={"type": "string", "description": "a text input"},
    input_base64={"type": "string", "description": "a file's bytes (an image), base64"},
)


FLUSH_BODY = BodySpec({"tier": "string"}, required=("tier",))
NOTE_BODY = BodySpec({"note": "string"}, empty_ok=True)  # bump, reload: the note is optional
CLEANUP_BODY = BodySpec({"dry_run": "boolean"}, empty_ok=True)
ENTRY_BODY = BodySpec({"task": "string", "input": "string", "input_base64": "string"}, required=("task",))


def _fleet_status(result: dict[str, Any]) -> int:
    """200 once every live replica confirmed; 202 (done here and in Redis, not confirmed
    everywhere) when some did not within the timeout: `fleet` names them."""
    fleet = result.get("fleet") or {}
    return 200 if fleet.get("complete", True) else 202


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _refusal(outcome: AuthOutcome) -> JSONResponse:
    if outcome is AuthOutcome.RATE_LIMITED:
        return JSONResponse({"error": "too many failed attempts; try again later"}, status_code=429,
                            headers={"Retry-After": "60"})  # fmt: skip
    return JSONResponse({"error": "missing or wrong admin token"}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})  # fmt: skip


def build_router(
    *, engine: InferenceEngine, admin: AdminService, auth: AdminAuth, metrics: Metrics
) -> APIRouter:
    router = APIRouter()

    def authorize(request: Request) -> JSONResponse | None:
        outcome = auth.check(client_address(request), bearer_token(request.headers.get("authorization")))
        return None if outcome is AuthOutcome.OK else _refusal(outcome)

    def actor(request: Request) -> str:
        return f"{auth.fingerprint} api {client_address(request)}"[:64]

    async def strict_body(request: Request, spec: BodySpec) -> dict[str, Any] | JSONResponse:
        """The body's documented fields, or the 400 that refuses it (admin.bodies)."""
        try:
            return parse_body(await request.body(), spec)
        except InvalidInputError as exc:
            log.info("admin %s refused: %s", request.url.path, exc.message)
            return JSONResponse({"error": exc.message}, status_code=400)

    @router.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/readyz")
    def readyz() -> JSONResponse:
        state = engine.cache_state()
        ready = bool(engine.models)
        body = {
            "status": "ready" if ready else "starting",
            "models": state["models"],
            "l2": state["l2"]["state"],
            "l2_notice": state["l2"].get("notice"),
            "generation": state["generation"],
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @router.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/admin/api/stats")
    def admin_stats(request: Request, window: str | None = None) -> JSONResponse:
        if (refused := authorize(request)) is not None:
            return refused
        try:
            return JSONResponse(admin.stats(window))
        except InvalidInputError as exc:
            return JSONResponse({"error": exc.message}, status_code=400)
        except LogUnavailableError as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)

    @router.post("/admin/api/flush", openapi_extra=_body_docs(tier={"enum": ["l1", "l2", "all"]}))
    async def admin_flush(request: Request) -> JSONResponse:
        if (refused := authorize(request)) is not None:
            return refused
        body = await strict_body(request, FLUSH_BODY)
        if isinstance(body, JSONResponse):
            return body
        try:
            tier = body["tier"]  # an unknown tier is refused, naming the tiers
            result = await asyncio.to_thread(admin.flush, tier, actor=actor(request))
        except InvalidInputError as exc:
            return JSONResponse({"error": exc.message}, status_code=400)
        return JSONResponse(result, status_code=_fleet_status(result))

    @router.post("/admin/api/bump-version", openapi_extra=_body_docs(note=_NOTE))
    async def admin_bump(request: Request) -> JSONResponse:
        if (refused := authorize(request)) is not None:
            return refused
        body = await strict_body(request, NOTE_BODY)
        if isinstance(body, JSONResponse):
            return body
        result = await asyncio.to_thread(admin.bump_version, actor=actor(request), note=body.get("note"))
        return JSONResponse(result, status_code=_fleet_status(result) if result["ok"] else 503)

    @router.get("/admin/api/replicas")
    def admin_replicas(request: Request) -> JSONResponse:
        if (refused := authorize(request)) is not None:
            return refused
        try:
            return JSONResponse({"replicas": admin.replicas()})
        except FleetUnavailableError as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)

    @router.post("/admin/api/models/{task}/reload", openapi_extra=_body_docs(note=_NOTE))
    async def admin_reload(request: Request, task: str) -> JSONResponse:
        """Load the task's model again from its source, check it, swap it in on every replica.
        404 unknown task, 409 a reload already running, 422 the new files do not load or do not
        pass the check (the old model keeps serving); 202 when some replica did not confirm."""
        if (refused := authorize(request)) is not None:
            return refused
        body = await strict_body(request, NOTE_BODY)
        if isinstance(body, JSONResponse):
            return body
        try:
            result = await asyncio.to_thread(admin.reload_model, task, actor=actor(request),
                                             note=body.get("note"))  # fmt: skip
        except InvalidInputError as exc:
            return JSONResponse({"ok": False, "error": exc.message}, status_code=404)
        except ReloadBusyError as exc:
            return JSONResponse({"ok": False, "error": str(exc)}, status_code=409)
        except ModelLoadError as exc:
            log.warning("reload of %s refused: %s", task, exc)
            body = {"ok": False, "error": f"{exc} (the old model keeps serving)"}
            return JSONResponse(body, status_code=422)
        return JSONResponse(result, status_code=_fleet_status(result))

    @router.get("/admin/api/l2/versions")
    def admin_l2_versions(request: Request) -> JSONResponse:
        """L2 entries per task, model version and generation (a sampled estimate, `exact` when
        the sample covered everything), with `current` false for those never read again."""
        if (refused := authorize(request)) is not None:
            return refused
        try:
            return JSONResponse(admin.l2_versions())
        except InvalidInputError as exc:
            return JSONResponse({"error": exc.message}, status_code=503)

    @router.post("/admin/api/l2/cleanup", openapi_extra=_body_docs(dry_run={"type": "boolean"}))
    async def admin_cleanup(request: Request) -> JSONResponse:
        """Start counting (`{"dry_run": true}`, the default) or deleting the entries of old
        versions and generations in the background: 202 with the progress; 409 while one runs."""
        if (refused := authorize(request)) is not None:
            return refused
        body = await strict_body(request, CLEANUP_BODY)
        if isinstance(body, JSONResponse):
            return body
        dry_run = body.get("dry_run") is not False  # a dry run unless told otherwise
        try:
            progress = admin.start_cleanup(dry_run=dry_run, actor=actor(request))
        except InvalidInputError as exc:
            status = 409 if exc.code == "cleanup_running" else 503
            return JSONResponse({"error": exc.message}, status_code=status)
        return JSONResponse(progress, status_code=202)

    @router.get("/admin/api/l2/cleanup")
    def admin_cleanup_progress(request: Request) -> JSONResponse:
        if (refused := authorize(request)) is not None:
            return refused
        progress = admin.cleanup_progress()
        return JSONResponse(progress if progress is not None else {"state": "never run"})

    @router.get("/admin/api/warmup")
    def admin_warmup(request: Request) -> JSONResponse:
        """The last warm-up after a swap or a bump (engine.lifecycle.warmup): total, done, failed, running."""
        if (refused := authorize(request)) is not None:
            return refused
        return JSONResponse(admin.warmup_progress())

    async def entry_call(request: Request, action: str) -> JSONResponse:
        if (refused := authorize(request)) is not None:
            return refused
        body = await strict_body(request, ENTRY_BODY)
        if isinstance(body, JSONResponse):
            return body
        try:
            task, raw = entry_input(body)
            if action == "inspect":
                result = await run_in_threadpool(admin.inspect, task, raw)  # may decode an image
            else:
                result = await run_in_threadpool(admin.evict, task, raw, actor=actor(request))
        except InvalidInputError as exc:
            log.info("admin %s refused: %s", action, exc.message)
            status = 404 if exc.code == "unknown_task" else 400
            return JSONResponse({"error": exc.message}, status_code=status)
        return JSONResponse(result, status_code=_fleet_status(result))

    @router.post("/admin/api/inspect", openapi_extra=_ENTRY_DOCS)
    async def admin_inspect(request: Request) -> JSONResponse:
        return await entry_call(request, "inspect")

    @router.post("/admin/api/evict", openapi_extra=_ENTRY_DOCS)
    async def admin_evict(request: Request) -> JSONResponse:
        return await entry_call(request, "evict")

    add_hard_example_routes(router, admin.hard_examples, authorize=authorize, actor=actor,
                            strict_body=strict_body)  # fmt: skip
    return router
