"""The Starlette application: public API, worker API, health and the OpenAPI document."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import public, schedules, stream, tokens, worker
from run_engine.api.context import ApiContext
from run_engine.api.http import ApiError, handle_exception, json_response
from run_engine.api.inputs import RejectUnstorable
from run_engine.api.openapi import openapi_document, operation
from run_engine.api.schemas import Health
from run_engine.errors import RunEngineError


@operation("Health: the server and its dependencies", Health, security="none")
async def healthz(request: Request) -> Response:
    ctx: ApiContext = request.app.state.ctx
    await ctx.engine.redis.ping()
    return json_response({"ok": True})


@operation("This document", None, security="none")
async def openapi(request: Request) -> Response:
    doc = getattr(request.app.state, "openapi", None)
    if doc is None:
        doc = request.app.state.openapi = openapi_document(request.app.routes)
    return json_response(doc)


def create_app(ctx: ApiContext) -> Starlette:
    app = Starlette(
        routes=[Route("/healthz", healthz), Route("/openapi.json", openapi), *public.ROUTES, *tokens.ROUTES, *schedules.ROUTES, *stream.ROUTES,
                *worker.ROUTES],
        middleware=[Middleware(RejectUnstorable)],
        # Expected errors are answered by ExceptionMiddleware; anything else reaches
        # ServerErrorMiddleware, which answers with the same shape and logs the traceback.
        exception_handlers={ApiError: handle_exception, RunEngineError: handle_exception,
                            HTTPException: handle_exception, Exception: handle_exception},
    )
    app.state.ctx = ctx
    return app
