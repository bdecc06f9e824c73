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
from run_engine.api.inputs import looks_like_id
from run_engine.api.models import ScheduleBody
from run_engine.api.openapi import PAGE, operation
from run_engine.api.serialize import iso, pagination
from run_engine.engine import Schedule


def schedule_object(row: Schedule) -> dict[str, Any]:
    return {"id": row.id, "task": row.task_id, "type": row.type, "active": row.active,
            "cron": row.cron, "timezone": row.timezone, "externalId": row.external_id,
            "deduplicationKey": row.deduplication_key, "nextRun": iso(row.next_run_at),
            "lastRun": iso(row.last_run_at), "createdAt": iso(row.created_at)}


@operation("Create a cron schedule (the same deduplicationKey updates it)", S.Schedule, body=ScheduleBody)
async def create_schedule(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, ScheduleBody)
    row = await ctx.engine.upsert_schedule(
        auth.env_id, task=req.task, cron=req.cron, timezone=req.timezone, external_id=req.externalId,
        deduplication_key=req.deduplicationKey)
    return json_response(schedule_object(row))


@operation("List schedules", S.ScheduleList, query=PAGE)
async def list_schedules(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    raw = request.query_params.get("page[size]", "25")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise ApiError(400, "invalid_input", "page[size]: must be an integer 1..100")
    size = int(raw)
    after = None
    if cursor := request.query_params.get("page[after]"):
        try:
            ts, sid = cursor.split("|", 1)
            after = (datetime.fromisoformat(ts), sid)
        except ValueError:
            raise ApiError(400, "invalid_input", "page[after]: not a cursor returned by this API") from None
    rows = await ctx.engine.list_schedules(auth.env_id, size + 1, after)
    page, more = rows[:size], len(rows) > size
    nxt = f"{page[-1].created_at.isoformat()}|{page[-1].id}" if more and page else None
    return json_response({"data": [schedule_object(r) for r in page], "pagination": pagination(nxt)})


async def _own(ctx: ApiContext, env_id: str, schedule_id: str) -> Schedule:
    row = await ctx.engine.get_schedule(schedule_id, env_id) if looks_like_id(schedule_id, "sched") else None
    if row is None:
        raise ApiError(404, "not_found", "schedule not found")
    return row


@operation("Get a schedule", S.Schedule)
async def get_schedule(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    return json_response(schedule_object(await _own(ctx, auth.env_id, request.path_params["schedule_id"])))


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
    return json_response(schedule_object(await ctx.engine.set_schedule_active(auth.env_id, row.id, active)))


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
    Route("/api/v1/schedules/{schedule_id}/activate", activate, methods=["POST"]),
    Route("/api/v1/schedules/{schedule_id}/deactivate", deactivate, methods=["POST"]),
]
