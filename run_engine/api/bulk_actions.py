"""Bulk actions as Trigger.dev's SDK makes and reads them (``runs.bulk.cancel|replay|retrieve|list|
abort|poll``): ``POST /api/v1/bulk-actions`` with ``{action, filter | runIds, name?}``,
``GET /api/v1/bulk-actions[/{id}]``, ``POST /api/v1/bulk-actions/{id}/abort``. The same actions
as run-engine's own ``/api/v1/runs/bulk/*`` (:mod:`run_engine.api.bulk`), in the SDK's shape."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ctx_of
from run_engine.api.http import ApiError, body, json_response, page_size
from run_engine.api.inputs import looks_like_id
from run_engine.api.models import CreateBulkActionBody, SdkBulkFilter, parse_date, parse_duration_s
from run_engine.api.openapi import PAGE, operation
from run_engine.api.serialize import iso
from run_engine.engine import BulkAction, RunFilter
from run_engine.statuses import RunStatus

#: filters of the SDK that run-engine has no notion of (versions, schedules, machines, regions...)
UNSUPPORTED = ("version", "schedule", "isTest", "machine", "region", "bulkAction")


def sdk_bulk_object(action: BulkAction) -> dict[str, Any]:
    """The SDK's BulkActionObject: ``counts.total`` is the runs named (``runIds``), or those the
    action went through so far (a filter's: it grows page by page); ``failure`` the runs it could
    not act on (finished already, refused, or named and not found once the action ended)."""
    named = len(action.filter.get("ids", ()))
    total = named or action.processed
    looked_at = total if action.status == "COMPLETED" else action.processed
    out: dict[str, Any] = {"id": action.id, "type": action.kind, "status": action.status,
                           "counts": {"total": total, "success": action.succeeded,
                                      "failure": max(0, looked_at - action.succeeded)},
                           "createdAt": iso(action.created_at)}
    if action.name is not None:
        out["name"] = action.name
    if action.completed_at is not None:
        out["completedAt"] = iso(action.completed_at)
    return out


def _strings(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _when(value: str | float, name: str) -> datetime:
    """A date as the SDK sends one: ISO 8601 (a Date), or milliseconds since the epoch."""
    try:
        if isinstance(value, str):
            return parse_date(value)
        return datetime.fromtimestamp(value / 1000, UTC)
    except (ValueError, OverflowError, OSError):
        raise ApiError(400, "invalid_input", f"filter.{name}: an ISO 8601 date or milliseconds since the epoch "
                                             "(years 1 to 9999)") from None


def _run_filter(f: SdkBulkFilter, now: float) -> RunFilter:
    for name in UNSUPPORTED:
        value = getattr(f, name)
        if value not in (None, "", []):
            raise ApiError(400, "invalid_input", f"filter.{name}: run-engine cannot filter runs by {name} "
                                                 "(the action would act on more runs than asked)")
    statuses = _strings(f.status)
    for status in statuses:
        if status not in RunStatus.__members__:
            raise ApiError(400, "invalid_input", f"filter.status: unknown status {status!r}")
    queues = [] if f.queue is None else [f.queue] if not isinstance(f.queue, list) else f.queue
    created_from = _when(f.from_, "from") if f.from_ is not None else None
    created_to = _when(f.to, "to") if f.to is not None else None
    if f.period is not None:
        if created_from is not None or created_to is not None:
            raise ApiError(400, "invalid_input", "filter.period: give a period or from/to, not both")
        try:
            created_from = datetime.fromtimestamp(now, UTC) - timedelta(seconds=parse_duration_s(f.period))
        except (ValueError, OverflowError) as exc:
            raise ApiError(400, "invalid_input", f"filter.period: {exc}") from None
    return RunFilter(statuses=statuses, tasks=_strings(f.taskIdentifier), tags=_strings(f.tag),
                     queues=tuple(f"task/{q.name}" if q.type == "task" else q.name for q in queues),
                     batches=_strings(f.batch), created_from=created_from, created_to=created_to)


@operation("Cancel or replay runs by filter or by id, in the background (Trigger.dev's runs.bulk.*)",
           S.BulkActionCreated, body=CreateBulkActionBody)
async def create_bulk_action(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    req = await body(request, CreateBulkActionBody)
    if (req.filter is None) == (req.runIds is None):
        raise ApiError(400, "invalid_input", "give exactly one of filter and runIds")
    if req.targetRegion is not None:
        raise ApiError(400, "invalid_input", "targetRegion: run-engine has no regions (a replay runs where "
                                             "its run's worker group does)")
    if req.runIds is not None:
        bad = next((i for i in req.runIds if not looks_like_id(i, "run")), None)
        if bad is not None:
            raise ApiError(400, "invalid_input", f"runIds: {bad[:64]!r} is not a run id")
        run_filter = RunFilter(ids=tuple(dict.fromkeys(req.runIds)))
    else:
        assert req.filter is not None
        run_filter = _run_filter(req.filter, ctx.engine.now())
        if not run_filter.stored():
            raise ApiError(400, "invalid_input", "filter: name at least one of status, taskIdentifier, tag, queue, "
                                                 "batch, from, to, period (an empty filter would act on every run)")
    key = request.headers.get("idempotency-key") or None
    if key is not None and len(key) > 256:
        raise ApiError(400, "invalid_input", "Idempotency-Key: at most 256 characters")
    kind = req.action.upper()
    action, _ = await ctx.engine.create_bulk_action(auth.env_id, kind, run_filter, key, req.name)
    if action.kind != kind:
        raise ApiError(409, "idempotency_key_reused", f"this idempotency key made a bulk {action.kind.lower()} "
                                                      f"({action.id}) already")
    return json_response({"id": action.id})


async def _action(request: Request) -> tuple[str, BulkAction | None]:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    action_id = request.path_params["bulk_id"]
    return auth.env_id, await ctx.engine.bulk_action(auth.env_id, action_id) if looks_like_id(action_id, "bulk") \
        else None


@operation("A bulk action, as Trigger.dev's SDK reads it (runs.bulk.retrieve and poll)", S.SdkBulkAction)
async def retrieve_bulk_action(request: Request) -> Response:
    _, action = await _action(request)
    if action is None:
        raise ApiError(404, "not_found", "bulk action not found")
    return json_response(sdk_bulk_object(action))


@operation("Stop a bulk action under way (runs.bulk.abort): no further page is started", S.BulkActionCreated)
async def abort_bulk_action(request: Request) -> Response:
    ctx = ctx_of(request)
    env_id, action = await _action(request)
    if action is None:
        raise ApiError(404, "not_found", "bulk action not found")
    stopped = await ctx.engine.abort_bulk_action(env_id, action.id)
    if stopped is None:
        raise ApiError(404, "not_found", "bulk action not found")
    if stopped.status == "COMPLETED":
        raise ApiError(409, "finished", f"bulk action {action.id} completed already")
    return json_response({"id": action.id})


@operation("The environment's bulk actions, newest first (runs.bulk.list)", S.SdkBulkActionPage, query=PAGE)
async def list_bulk_actions(request: Request) -> Response:
    ctx = ctx_of(request)
    auth = await ctx.env_auth(request)
    size = page_size(request)
    after = None
    if cursor := request.query_params.get("page[after]"):
        ts, _, action_id = cursor.partition("|")
        try:
            after = (datetime.fromisoformat(ts), action_id)
        except ValueError:
            raise ApiError(400, "invalid_input", "page[after]: not a cursor returned by this API") from None
        if after[0].tzinfo is None or not looks_like_id(action_id, "bulk"):
            raise ApiError(400, "invalid_input", "page[after]: not a cursor returned by this API")
    actions = await ctx.engine.list_bulk_actions(auth.env_id, size, after)
    pagination: dict[str, str] = {}
    if len(actions) == size:
        last = actions[-1]
        pagination["next"] = f"{last.created_at.isoformat()}|{last.id}"
    return json_response({"data": [sdk_bulk_object(a) for a in actions], "pagination": pagination})


ROUTES = [
    Route("/api/v1/bulk-actions", create_bulk_action, methods=["POST"]),
    Route("/api/v1/bulk-actions", list_bulk_actions, methods=["GET"]),
    Route("/api/v1/bulk-actions/{bulk_id}", retrieve_bulk_action, methods=["GET"]),
    Route("/api/v1/bulk-actions/{bulk_id}/abort", abort_bulk_action, methods=["POST"]),
]
