"""The Starlette application: public API, worker API, health and the OpenAPI document."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from run_engine import dashboard
from run_engine.api import (
    auth,
    batches,
    bulk,
    bulk_actions,
    deployments,
    idempotency,
    metrics,
    packets,
    public,
    realtime_shapes,
    schedules,
    stream,
    tokens,
    uploads,
    worker,
    worker_groups,
)
from run_engine.api.context import ApiContext
from run_engine.api.headers import BaselineHeaders
from run_engine.api.http import ApiError, handle_exception, handle_refusing, json_response
from run_engine.api.inputs import RejectUnstorable
from run_engine.api.openapi import openapi_document, operation
from run_engine.api.routing import IndexedRouter
from run_engine.api.schemas import Health, Index
from run_engine.dependencies import DEPENDENCY_ERRORS, MAYBE_REFUSING
from run_engine.errors import RunEngineError


@operation("Health: the server and its dependencies", Health, security="none")
async def healthz(request: Request) -> Response:
    """200 when PostgreSQL and Redis both answer within 2 s, else 503 naming the one that does not."""
    ctx: ApiContext = request.app.state.ctx
    state = {name: "up" if up else "down" for name, up in (await ctx.engine.ping(2.0)).items()}
    down = [name for name, s in state.items() if s == "down"]
    if not down:
        return json_response({"ok": True, "dependencies": state})
    names = {"postgres": "PostgreSQL", "redis": "Redis"}
    return json_response({"ok": False, "dependencies": state, "error": {
        "code": "service_unavailable", "message": " and ".join(names[d] for d in down) + " unavailable",
        "dependency": down[0]}}, 503, headers={"Retry-After": "2"})


@operation("Where things are: the dashboard, health, the OpenAPI document, the API", Index, security="none")
async def index(request: Request) -> Response:
    """``GET /`` answers with directions instead of a bare 404; a browser is sent to the dashboard."""
    if "text/html" in request.headers.get("accept", ""):
        return RedirectResponse("/dashboard", 303)
    from importlib.metadata import PackageNotFoundError, version

    try:
        current = version("run-engine")
    except PackageNotFoundError:  # run from a source tree that is not installed
        current = "unknown"
    return json_response({"name": "run-engine", "version": current, "dashboard": "/dashboard", "health": "/healthz",
                          "openapi": "/openapi.json", "api": "/api/v1",
                          "docs": "docs/API.md in the repository (the HTTP, CLI and SDK reference)"})


@operation("This document", None, security="none")
async def openapi(request: Request) -> Response:
    doc = getattr(request.app.state, "openapi", None)
    if doc is None:
        doc = request.app.state.openapi = openapi_document(routes())
    return json_response(doc)


def routes() -> list[BaseRoute]:
    """Every route the API serves (the OpenAPI document is built from them)."""
    # bulk before public: POST /api/v1/runs/bulk/replay would otherwise be a replay of run "bulk"
    return [Route("/", index), Route("/healthz", healthz), Route("/openapi.json", openapi), *bulk.ROUTES,
            *bulk_actions.ROUTES,
            *public.ROUTES, *batches.ROUTES, *tokens.ROUTES, *schedules.ROUTES, *stream.ROUTES, *packets.ROUTES,
            *uploads.ROUTES, *idempotency.ROUTES, *realtime_shapes.ROUTES, *auth.ROUTES, *worker_groups.ROUTES,
            *deployments.ROUTES, *worker.ROUTES, *metrics.ROUTES]


def create_app(ctx: ApiContext) -> Starlette:
    app = Starlette(
        routes=[*routes(), *dashboard.routes()],  # the pages are served beside the API, not in its OpenAPI
        middleware=[Middleware(BaselineHeaders), Middleware(RejectUnstorable)],
        # Expected errors are answered by ExceptionMiddleware; anything else reaches
        # ServerErrorMiddleware, which answers with the same shape and logs the traceback.
        # A dependency that cannot be reached, or refuses writes for a while, is expected too (503),
        # not a server error.
        exception_handlers={ApiError: handle_exception, RunEngineError: handle_exception,
                            HTTPException: handle_exception, **dict.fromkeys(DEPENDENCY_ERRORS, handle_exception),
                            **dict.fromkeys(MAYBE_REFUSING, handle_refusing),
                            Exception: handle_exception},
    )
    # the same routes, tried only where the path can match (run_engine/api/routing.py)
    app.router = IndexedRouter(app.router.routes)
    app.state.ctx = ctx
    return app
