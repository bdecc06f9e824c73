"""``GET /api/v1/worker-groups``: the worker groups an environment's runs may be sent to (the
trigger option ``workerGroup``), which one is its default, and their connected instances."""

from __future__ import annotations

from datetime import datetime

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ctx_of
from run_engine.api.http import json_response
from run_engine.api.openapi import operation
from run_engine.api.serialize import iso


def _when(value: object) -> str | None:
    """A heartbeat time as stored in the instances' JSON (PostgreSQL's text form) as ISO 8601."""
    if not isinstance(value, str):
        return None
    try:
        return iso(datetime.fromisoformat(value))
    except ValueError:
        return value


@operation("The worker groups runs of this environment may be sent to, with their instances", S.WorkerGroupList)
async def list_worker_groups(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    groups = await ctx.engine.worker_groups(auth.env_id)
    return json_response({"data": [
        {"id": g.id, "name": g.name, "isDefault": g.is_default, "shared": g.shared,
         "instances": [{"name": i.get("name"), "concurrency": i.get("concurrency"),
                        "lastHeartbeatAt": _when(i.get("lastHeartbeatAt"))} for i in g.instances]}
        for g in groups]})


ROUTES = [Route("/api/v1/worker-groups", list_worker_groups, methods=["GET"])]
