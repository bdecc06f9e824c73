"""``POST /api/v1/idempotencyKeys/{key}/reset`` with ``{taskIdentifier}``: Trigger.dev's SDK's
``idempotencyKeys.reset``. The task's runs that hold the key in the caller's environment give it up
before its TTL, so that the next trigger with it makes a new run (those runs are otherwise
untouched); the environment's batches that hold the key give it up too (a batch key is not a
task's), so that the next batch with it is a new one; 404 when no run of the task and no batch
holds it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ctx_of
from run_engine.api.http import ApiError, body, json_response
from run_engine.api.models import ResetIdempotencyKeyBody
from run_engine.api.openapi import operation

#: as a trigger's ``options.idempotencyKey``
MAX_KEY_CHARS = 256


@operation("Free an idempotency key of a task before its TTL (Trigger.dev's idempotencyKeys.reset)",
           S.ResetIdempotencyKey, body=ResetIdempotencyKeyBody)
async def reset_idempotency_key(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    key = request.path_params["key"]
    if not key or len(key) > MAX_KEY_CHARS:
        raise ApiError(400, "invalid_input", f"idempotency key: 1 to {MAX_KEY_CHARS} characters")
    req = await body(request, ResetIdempotencyKeyBody)
    if not await ctx.engine.reset_idempotency_key(auth.env_id, req.taskIdentifier, key):
        raise ApiError(404, "not_found",
                       f"no run of task {req.taskIdentifier!r} and no batch holds that idempotency key")
    return json_response({"id": key})


ROUTES = [Route("/api/v1/idempotencyKeys/{key:path}/reset", reset_idempotency_key, methods=["POST"])]
