"""Cron schedules (API.md): create (or update by deduplication key), list, get, delete, activate,
deactivate. Declarative schedules come from the tasks' ``cron`` in a deployment."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ApiContext, ctx_of
from run_engine.api.http import ApiError, body, json_response
from run_engine.api.inputs import is_number, looks_like_id
from run_engine.api.models import ScheduleBody
from run_engine.api.openapi import PAGE, Query, operation
from run_engine.api.serialize import iso, pagination
from run_engine.engine import Environment, Schedule


def schedule_object(row: Schedule, env: Environment | None = None) -> dict[str, Any]:
    """The schedule (API.md), with the ``generator`` and ``environments`` Trigger.dev's SDK reads."""
    return {"id": row.id, "task": row.task_id, "type": row.type, "active": row.active,
            "cron": row.cron, "timezone": row.timezone, "externalId": row.external_id,
            "deduplicationKey": row.deduplication_key, "nextRun": iso(row.next_run_at),
            "lastRun": iso(row.last_run_at), "createdAt": iso(row.created_at),
            "generator": {"type": "CRON", "expression": row.cron, "description": ""},
            "environments": [{"id": row.env_id, "type": env.type if env else "DEVELOPMENT"}]}


async def _object(ctx: ApiContext, row: Schedule) -> dict[str, Any]:
    return schedule_object(row, await ctx.environment(row.env_id))


@operation("Create a cron schedule (the same deduplicationKey updates it)", S.Schedule, body=ScheduleBody)
async def create_schedule(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, ScheduleBody)
    row = await ctx.engine.upsert_schedule(
        auth.env_id, task=req.task, cron=req.cron, timezone=req.timezone, external_id=req.externalId,
        deduplication_key=req.deduplicationKey)
    return json_response(await _object(ctx, row))


@operation("Update a schedule's task, cron, time zone or external id", S.Schedule, body=ScheduleBody)
async def update_schedule(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    row = await _own(ctx, auth.env_id, request.path_params["schedule_id"])
    req = await body(request, ScheduleBody)
    updated = await ctx.engine.update_schedule(
        auth.env_id, row.id, task=req.task, cron=req.cron, timezone=req.timezone, external_id=req.externalId)
    return json_response(await _object(ctx, updated))


def _int_param(request: Request, name: str, low: int, high: int, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not is_number(raw) or not low <= int(raw) <= high:
        raise ApiError(400, "invalid_input", f"{name}: must be an integer {low}..{high}")
    return int(raw)


@operation("List schedules (cursor pages, or page numbers with page and perPage)", S.ScheduleList,
           query=(*PAGE, Query("page", {"type": "integer", "minimum": 1}),
                  Query("perPage", {"type": "integer", "minimum": 1, "maximum": 100})))
async def list_schedules(request: Request) -> Response:
    """Newest first. ``pagination`` holds ``next`` (a cursor for ``page[after]``) and, as Trigger.dev's
    SDK reads them, ``currentPage``, ``totalPages`` and ``count``."""
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    size = _int_param(request, "perPage", 1, 100, _int_param(request, "page[size]", 1, 100, 25))
    number = _int_param(request, "page", 1, 1_000_000, 0)
    after = None
    if (cursor := request.query_params.get("page[after]")) and not number:
        try:
            ts, sid = cursor.split("|", 1)
            after = (datetime.fromisoformat(ts), sid)
        except ValueError:
            raise ApiError(400, "invalid_input", "page[after]: not a cursor returned by this API") from None
    offset = (number - 1) * size if number else 0
    rows = await ctx.engine.list_schedules(auth.env_id, size + 1, after, offset)
    page, more = rows[:size], len(rows) > size
    total, before = await ctx.engine.count_schedules(auth.env_id, after)
    nxt = f"{page[-1].created_at.isoformat()}|{page[-1].id}" if more and page else None
    env = await ctx.environment(auth.env_id)
    return json_response({"data": [schedule_object(r, env) for r in page], "pagination": {
        **pagination(nxt), "currentPage": number or before // size + 1, "totalPages": max(1, -(-total // size)),
        "count": total}})


async def _own(ctx: ApiContext, env_id: str, schedule_id: str) -> Schedule:
    row = await ctx.engine.get_schedule(schedule_id, env_id) if looks_like_id(schedule_id, "sched") else None
    if row is None:
        raise ApiError(404, "not_found", "schedule not found")
    return row


@operation("Get a schedule", S.Schedule)
async def get_schedule(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    return json_response(await _object(ctx, await _own(ctx, auth.env_id, request.path_params["schedule_id"])))


@operation("Delete a schedule", S.ScheduleDeleted)
async def delete_schedule(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    row = await _own(ctx, auth.env_id, request.path_params["schedule_id"])
    await ctx.engine.delete_schedule(row.id, auth.env_id)
    return json_response({"id": row.id, "deleted": True})


async def _set_active(request: Request, active: bool) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    row = await _own(ctx, auth.env_id, request.path_params["schedule_id"])
    return json_response(await _object(ctx, await ctx.engine.set_schedule_active(auth.env_id, row.id, active)))


@operation("Activate a schedule", S.Schedule)
async def activate(request: Request) -> Response:
    return await _set_active(request, True)


@operation("Deactivate a schedule", S.Schedule)
async def deactivate(request: Request) -> Response:
    return await _set_active(request, False)


ROUTES = [
    Route("/api/v1/schedules", create_schedule, methods=["POST"]),
    Route("/api/v1/schedules", list_schedules, methods=["GET"]),
    Route("/api/v1/schedules/{schedule_id}", get_schedule, methods=["GET"]),
    Route("/api/v1/schedules/{schedule_id}", delete_schedule, methods=["DELETE"]),
    Route("/api/v1/schedules/{schedule_id}", update_schedule, methods=["PUT"]),
    Route("/api/v1/schedules/{schedule_id}/activate", activate, methods=["POST"]),
    Route("/api/v1/schedules/{schedule_id}/deactivate", deactivate, methods=["POST"]),
]
