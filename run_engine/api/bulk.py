"""Bulk actions (``POST /api/v1/runs/bulk/cancel|replay``): cancel or replay every run matching the
runs list's filters, in the background a page at a time; ``GET /api/v1/runs/bulk/{id}`` reads the
progress. The same idempotency key (body ``idempotencyKey`` or header ``Idempotency-Key``) answers
with the action it made before."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ctx_of
from run_engine.api.http import ApiError, body, json_response
from run_engine.api.inputs import looks_like_id
from run_engine.api.models import BulkBody, parse_date
from run_engine.api.openapi import operation
from run_engine.api.serialize import iso
from run_engine.engine import BulkAction, RunFilter
from run_engine.statuses import RunStatus


def bulk_object(action: BulkAction, cached: bool | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": action.id, "type": action.kind, "status": action.status,
                           "processed": action.processed, "succeeded": action.succeeded,
                           "filter": shown_filter(action.filter), "createdAt": iso(action.created_at)}
    if action.completed_at is not None:
        out["completedAt"] = iso(action.completed_at)
    if action.idempotency_key is not None:
        out["idempotencyKey"] = action.idempotency_key
    if cached is not None:
        out["isCached"] = cached
    return out


def shown_filter(stored: dict[str, Any]) -> dict[str, Any]:
    """An action's filter as stored, without the date bound that an action by run ids stores for
    older engines (:data:`systems.bulk_actions.NO_RUN_BEFORE_IDS`)."""
    return {k: v for k, v in stored.items() if not (k == "created_to" and stored.get("ids"))}


def _filter(req: BulkBody) -> RunFilter:
    f = req.filter
    for status in f.status or ():
        if status not in RunStatus.__members__:
            raise ApiError(400, "invalid_input", f"filter.status: unknown status {status!r}")
    dates = {}
    for key, name, value in (("created_from", "from", f.createdAt.from_ if f.createdAt else None),
                             ("created_to", "to", f.createdAt.to if f.createdAt else None)):
        if value:
            try:
                dates[key] = parse_date(value)
            except ValueError as exc:
                raise ApiError(400, "invalid_input", f"filter.createdAt.{name}: {exc}") from None
    run_filter = RunFilter(statuses=tuple(f.status or ()), tasks=tuple(f.taskIdentifier or ()), tags=tuple(f.tag or ()),
                           queues=tuple(f.queue or ()), batches=tuple(f.batch or ()),
                           created_from=dates.get("created_from"), created_to=dates.get("created_to"))
    if not run_filter.stored():
        raise ApiError(400, "invalid_input", "filter: name at least one of status, taskIdentifier, tag, queue, batch, "
                                             "createdAt (an empty filter would act on every run)")
    return run_filter


async def _create(request: Request, kind: str) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, BulkBody)
    key = req.idempotencyKey or request.headers.get("idempotency-key") or None
    if key is not None and len(key) > 256:
        raise ApiError(400, "invalid_input", "Idempotency-Key: at most 256 characters")
    action, cached = await ctx.engine.create_bulk_action(auth.env_id, kind, _filter(req), key)
    if action.kind != kind:
        raise ApiError(409, "idempotency_key_reused", f"this idempotency key made a bulk {action.kind.lower()} "
                                                      f"({action.id}) already")
    return json_response(bulk_object(action, cached))


@operation("Cancel every run matching a filter (in the background; read the progress)", S.BulkAction, body=BulkBody)
async def bulk_cancel(request: Request) -> Response:
    return await _create(request, "CANCEL")


@operation("Replay every run matching a filter (in the background; read the progress)", S.BulkAction, body=BulkBody)
async def bulk_replay(request: Request) -> Response:
    return await _create(request, "REPLAY")


@operation("A bulk action and its progress", S.BulkAction)
async def get_bulk(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    action_id = request.path_params["bulk_id"]
    action = await ctx.engine.bulk_action(auth.env_id, action_id) if looks_like_id(action_id, "bulk") else None
    if action is None:
        raise ApiError(404, "not_found", "bulk action not found")
    return json_response(bulk_object(action))


ROUTES = [
    Route("/api/v1/runs/bulk/cancel", bulk_cancel, methods=["POST"]),
    Route("/api/v1/runs/bulk/replay", bulk_replay, methods=["POST"]),
    Route("/api/v1/runs/bulk/{bulk_id}", get_bulk, methods=["GET"]),
]
