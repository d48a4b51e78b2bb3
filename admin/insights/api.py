"""The operator's questions over the admin JSON API (every call: `Authorization: Bearer`):

- `GET /admin/api/sizing?window=1h`: miss-ratio curves of L1 and L2 per task (admin.insights.sizing)
- `GET /admin/api/worth?window=24h`: repeat ratio, hit ratio, model time and cost saved, verdict
- `GET /admin/api/health`: Redis memory, limit, policy, evictions per primary; GPU figures
- `GET /admin/api/requests.csv?window=1h`, `GET /admin/api/audit.csv`: CSV downloads

A bad `window` is a 400 `{"error": ...}`; an unreadable request log a 503.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from admin.auth import AdminAuth, AuthOutcome, bearer_token
from admin.console.api import _refusal, client_address
from admin.console.service import LogUnavailableError
from admin.insights.service import Insights
from engine.errors import InvalidInputError


def _csv(lines: Iterator[str], name: str) -> StreamingResponse:
    stamp = datetime.now(tz=UTC).strftime("%Y%m%dT%H%M%SZ")
    disposition = f'attachment; filename="{name}-{stamp}.csv"'
    return StreamingResponse(lines, media_type="text/csv; charset=utf-8",
                             headers={"Content-Disposition": disposition})  # fmt: skip


def build_insights_router(*, insights: Insights, auth: AdminAuth) -> APIRouter:
    router = APIRouter()

    async def answer(request: Request, read: Callable[[], Any]) -> Response:
        outcome = auth.check(client_address(request), bearer_token(request.headers.get("authorization")))
        if outcome is not AuthOutcome.OK:
            return _refusal(outcome)
        try:
            result = await run_in_threadpool(read)  # Redis INFO and SQL: off the event loop
        except InvalidInputError as exc:
            return JSONResponse({"error": exc.message}, status_code=400)
        except LogUnavailableError as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        return result if isinstance(result, Response) else JSONResponse(result)

    @router.get("/admin/api/sizing")
    async def admin_sizing(request: Request, window: str | None = None) -> Response:
        """Hit ratio L1 and L2 would have had at sizes from 1/10 to 10x today's, per task."""
        return await answer(request, lambda: insights.sizing(window))

    @router.get("/admin/api/worth")
    async def admin_worth(request: Request, window: str | None = None) -> Response:
        """Is caching worth it: repeat ratio, hit ratio, model time (and cost) saved, a verdict."""
        return await answer(request, lambda: insights.worth(window))

    @router.get("/admin/api/health")
    async def admin_health(request: Request) -> Response:
        """Redis used/max memory, policy, evicted and expired keys per primary; GPU figures."""
        return await answer(request, insights.health)

    @router.get("/admin/api/requests.csv")
    async def admin_requests_csv(request: Request, window: str | None = None) -> Response:
        return await answer(request, lambda: _csv(insights.requests_csv(window), "requests"))

    @router.get("/admin/api/audit.csv")
    async def admin_audit_csv(request: Request) -> Response:
        return await answer(request, lambda: _csv(insights.audit_csv(), "audit"))

    return router
