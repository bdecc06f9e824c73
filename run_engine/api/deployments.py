"""``POST /api/v1/deployments/{version}/promote``: make an older deployment current again (a
rollback), as Trigger.dev's endpoint of that path and its CLI's ``promote`` do. A deployment is
per (environment, worker group): the version is promoted in every worker group of the environment
that has it, or in the one the body's ``workerGroup`` names."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ctx_of
from run_engine.api.http import ApiError, body, json_response
from run_engine.api.models import PromoteBody
from run_engine.api.openapi import operation
from run_engine.engine import Promoted

#: as a connect's ``deployment.version``
MAX_VERSION_CHARS = 128


def _promoted(p: Promoted) -> dict[str, Any]:
    return {"id": p.deployment_id, "version": p.version, "workerGroupId": p.worker_group_id,
            "alreadyCurrent": p.already_current, "pendingRunsEnqueued": p.pending_runs_enqueued}


@operation("Make a deployment version current again (a rollback; Trigger.dev's promote)", S.Promoted,
           body=PromoteBody, body_required=False)
async def promote_deployment(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    version = request.path_params["version"]
    if not version or len(version) > MAX_VERSION_CHARS:
        raise ApiError(400, "invalid_input", f"version: 1 to {MAX_VERSION_CHARS} characters")
    req = await body(request, PromoteBody, required=False)
    promoted = await ctx.engine.promote_deployment(auth.env_id, version, worker_group=req.workerGroup)
    if not promoted:
        where = f" in worker group {req.workerGroup!r}" if req.workerGroup is not None else ""
        raise ApiError(404, "not_found", f"no deployment of version {version!r} in this environment{where}")
    return json_response({**_promoted(promoted[0]), "deployments": [_promoted(p) for p in promoted]})


ROUTES = [Route("/api/v1/deployments/{version:path}/promote", promote_deployment, methods=["POST"])]
