"""``GET /metrics``: Prometheus metrics of the whole installation (every environment's numbers), so
not for tenants: served only when ``RUN_ENGINE_METRICS_TOKEN`` is set, to a bearer of that token.
Unset, the route answers 404 like any unknown path; any other credential, or none, gets 401."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api.context import ApiContext
from run_engine.api.http import ApiError
from run_engine.api.openapi import operation
from run_engine.metrics import CONTENT_TYPE_LATEST, render


def authorized(header: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


@operation("Prometheus metrics of the installation (RUN_ENGINE_METRICS_TOKEN)", None, security="metricsToken",
           media="text/plain")
async def metrics(request: Request) -> Response:
    ctx: ApiContext = request.app.state.ctx
    token = ctx.engine.settings.metrics_token
    if not token:
        raise HTTPException(404)
    if not authorized(request.headers.get("authorization"), token):
        raise ApiError(401, "unauthorized", "the metrics token is required (Authorization: Bearer …)",
                       headers={"WWW-Authenticate": "Bearer"})
    return Response(await render(ctx.engine), media_type=CONTENT_TYPE_LATEST)


ROUTES = [Route("/metrics", metrics, methods=["GET"])]
