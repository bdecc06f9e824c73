"""``GET /realtime/v1/runs/{runId}?offset=…``: one run as a shape stream, the long-poll protocol of
ElectricSQL that Trigger.dev's SDK (``runs.subscribeToRun``, its realtime hooks) reads. Without an
``offset`` the same path serves run-engine's own Server-Sent Events (:mod:`run_engine.api.stream`).

The first request (``offset=-1``) answers with the run as an ``insert`` and ``up-to-date``; each
later one (``live=true``) waits until the run changes (any server process: RealtimeHub), then
answers with an ``update``, or after a while with ``up-to-date`` alone. The offset is the run's
``updated_at`` in microseconds, so a client that comes back late gets the newest state at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from run_engine.api.context import ApiContext, EnvAuth
from run_engine.api.http import ApiError
from run_engine.engine import RunRow

LIVE_WAIT_S = 20.0
#: run-engine's statuses as the raw TaskRun statuses the SDK maps back (its apiStatusFromRunStatus)
RAW_STATUS = {"QUEUED": "PENDING", "COMPLETED": "COMPLETED_SUCCESSFULLY", "FAILED": "COMPLETED_WITH_ERRORS",
              "WAITING": "WAITING_TO_RESUME"}
UP_TO_DATE = {"headers": {"control": "up-to-date"}}


def _naive(value: datetime | None) -> str | None:
    """A date as the raw shape has it: ISO without an offset, in UTC (the SDK appends the Z)."""
    return None if value is None else value.astimezone(UTC).replace(tzinfo=None).isoformat()


def _packet(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _error(error: dict[str, Any] | None) -> dict[str, Any] | None:
    if not error:
        return None
    return {"type": "BUILT_IN_ERROR", "name": str(error.get("name") or error.get("type") or "Error"),
            "message": str(error.get("message") or ""), "stackTrace": str(error.get("stackTrace") or "")}


def raw_row(run: RunRow) -> dict[str, Any]:
    """The run as the SDK's SubscribeRunRawShape reads it."""
    duration_ms = 0
    if run.started_at and run.finished_at:
        duration_ms = int((run.finished_at - run.started_at).total_seconds() * 1000)
    return {
        "id": run.id, "friendlyId": run.id, "taskIdentifier": run.task_id,
        "status": RAW_STATUS.get(run.status, run.status),
        "createdAt": _naive(run.created_at), "updatedAt": _naive(run.updated_at),
        "startedAt": _naive(run.started_at), "delayUntil": _naive(run.delay_until),
        "queuedAt": _naive(run.queued_at), "completedAt": _naive(run.finished_at),
        "expiredAt": _naive(run.finished_at) if run.status == "EXPIRED" else None,
        "idempotencyKey": run.idempotency_key, "number": 0, "isTest": False, "usageDurationMs": duration_ms,
        "costInCents": 0, "baseCostInCents": 0, "ttl": None,
        "payload": _packet(run.payload), "payloadType": "application/json",
        "metadata": _packet(run.metadata), "metadataType": "application/json" if run.metadata is not None else None,
        "output": _packet(run.output) if run.status == "COMPLETED" else None,
        "outputType": "application/json" if run.status == "COMPLETED" and run.output is not None else None,
        "runTags": list(run.tags), "error": _error(run.error), "realtimeStreams": [],
    }


def _offset(run: RunRow) -> str:
    return f"{int(run.updated_at.timestamp() * 1_000_000)}_0"


def _answer(run: RunRow, messages: list[dict[str, Any]], *, live: bool) -> Response:
    headers = {"electric-handle": run.id, "electric-offset": _offset(run), "electric-schema": "{}",
               "Cache-Control": "no-store"}
    if live:
        headers["electric-cursor"] = _offset(run).split("_", 1)[0]
        headers["electric-up-to-date"] = ""
    return Response(orjson.dumps(messages), media_type="application/json", headers=headers)


async def shape(ctx: ApiContext, auth: EnvAuth, request: Request, run_id: str) -> Response:
    """Answer one request of the shape protocol for the run (it exists in the caller's environment)."""
    offset = request.query_params.get("offset", "-1")
    live = request.query_params.get("live") == "true"
    run = await ctx.engine.get_run(run_id, auth.env_id)
    if run is None:
        raise ApiError(404, "not_found", "run not found")
    key = f'"public"."TaskRun"/"{run.id}"'
    if offset == "-1" or not live:
        return _answer(run, [{"key": key, "value": raw_row(run), "headers": {"operation": "insert"}}, UP_TO_DATE],
                       live=False)
    hub = ctx.realtime
    if hub is None:
        raise ApiError(503, "unavailable", "realtime is not running in this process")
    with ctx.hold("streams", auth.bucket):
        async with hub.watch(run.id) as changed:
            deadline = asyncio.get_running_loop().time() + LIVE_WAIT_S
            while _offset(run) == offset:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0 or await request.is_disconnected():
                    return _answer(run, [UP_TO_DATE], live=True)
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(remaining, 5.0))
                fresh = await ctx.engine.get_run(run.id, auth.env_id)
                if fresh is None:
                    return _answer(run, [UP_TO_DATE], live=True)
                run = fresh
    return _answer(run, [{"key": key, "value": raw_row(run), "headers": {"operation": "update"}}, UP_TO_DATE],
                   live=True)
