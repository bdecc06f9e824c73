"""Many runs as one shape stream (:mod:`run_engine.api.shape_stream`), as Trigger.dev's SDK
subscribes to them: ``GET /realtime/v1/runs?tags=a,b[&tasks=…][&createdAt=1d]`` (its
``runs.subscribeToRunsWithTag`` and ``useRealtimeRunsWithTag``) and ``GET /realtime/v1/batches/{batchId}``
(``runs.subscribeToBatch``, ``useRealtimeBatch``). A public access token needs a scope for every tag
it asks for (``read:tags:<tag>``), or for the batch (``read:batch:<id>``)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api.context import ctx_of
from run_engine.api.http import ApiError
from run_engine.api.inputs import looks_like_id
from run_engine.api.models import parse_duration_s
from run_engine.api.openapi import Query, csv, operation
from run_engine.api.public_tokens import allows, forbidden
from run_engine.api.shape_stream import MAX_OFFSET_CHARS, shape
from run_engine.engine import ShapeRead
from run_engine.realtime import env_key

#: the newest runs a tag shape holds (older ones fall out of it)
MAX_TAG_RUNS = 500
MAX_BATCH_RUNS = 1000
#: a shape over many runs re-reads them at most this often, however busy the environment
MIN_INTERVAL_S = 0.25
DEFAULT_WINDOW = timedelta(days=1)
LIVE = (Query("offset", {"type": "string", "maxLength": MAX_OFFSET_CHARS},
              "-1 first, then the electric-offset of the answer"),
        Query("live", {"type": "string", "enum": ["true", "false"]}),
        Query("skipColumns", {"type": "string", "maxLength": 4096}, "columns to leave out, comma-separated"))


def _list(request: Request, name: str) -> list[str]:
    values = [v.strip() for v in request.query_params.get(name, "").split(",") if v.strip()]
    if len(values) > 10 or any(len(v) > 128 for v in values):
        raise ApiError(400, "invalid_input", f"{name}: at most 10 values of at most 128 characters")
    return values


@operation("Runs with any of the tags, as a shape stream (Trigger.dev's subscribeToRunsWithTag)", None,
           security="apiKeyOrPublicToken",
           query=(csv("tags"), csv("tasks"), Query("createdAt", {"type": "string", "maxLength": 32},
                                                   "a duration: runs created within it (default 1d)"), *LIVE))
async def runs_with_tags(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, public=True)
    tags, tasks = _list(request, "tags"), _list(request, "tasks")
    if not tags:
        raise ApiError(400, "invalid_input", "tags: at least one tag")
    if auth.scopes is not None and not all(allows(auth.scopes, "read:all", "read:runs", f"read:tags:{t}")
                                           for t in tags):
        raise forbidden()
    window = DEFAULT_WINDOW
    if raw := request.query_params.get("createdAt"):
        try:
            window = timedelta(seconds=parse_duration_s(raw))
        except ValueError as exc:
            raise ApiError(400, "invalid_input", f"createdAt: {exc}") from None
    env_id = auth.env_id

    async def load(changed_after: datetime | None) -> ShapeRead:
        since = datetime.fromtimestamp(ctx.engine.now(), UTC) - window
        return await ctx.engine.shape_runs(env_id, tags=tags, tasks=tasks, created_from=since, limit=MAX_TAG_RUNS,
                                           updated_after=changed_after)

    # the handle is a header: the tags' digest, not the tags (a header holds Latin-1 only)
    handle = "tags-" + hashlib.sha256("\0".join(tags).encode()).hexdigest()[:32]
    return await shape(ctx, auth, request, handle, load, env_key(env_id),
                       min_interval_s=MIN_INTERVAL_S)


@operation("The runs of a batch, as a shape stream (Trigger.dev's subscribeToBatch)", None,
           security="apiKeyOrPublicToken", query=LIVE)
async def batch_runs(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request, public=True)
    batch_id = request.path_params["batch_id"]
    if not looks_like_id(batch_id, "batch"):
        raise ApiError(404, "not_found", "batch not found")
    if not allows(auth.scopes, "read:all", "read:runs", f"read:batch:{batch_id}"):
        raise forbidden()
    env_id = auth.env_id

    async def load(changed_after: datetime | None) -> ShapeRead:
        # every run, never fewer (a run left out of a read would never be sent), light: the
        # answers bound what they hold
        return await ctx.engine.shape_runs(env_id, batches=[batch_id], limit=MAX_BATCH_RUNS,
                                           updated_after=changed_after)

    if not await ctx.engine.list_runs(env_id, batches=[batch_id], limit=1, light=True):
        raise ApiError(404, "not_found", "batch not found")
    return await shape(ctx, auth, request, batch_id, load, env_key(env_id), min_interval_s=MIN_INTERVAL_S)


ROUTES = [
    Route("/realtime/v1/runs", runs_with_tags, methods=["GET"]),
    Route("/realtime/v1/batches/{batch_id}", batch_runs, methods=["GET"]),
]
