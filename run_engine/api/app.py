"""The Starlette application: public API, worker API, health and the OpenAPI document."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import models, public, schedules, stream, tokens, worker
from run_engine.api.context import ApiContext
from run_engine.api.http import ApiError, handle_exception, json_response
from run_engine.errors import RunEngineError

# path → method → (summary, request model or None); the OpenAPI document is built from it
_DOC: dict[str, dict[str, tuple[str, type[BaseModel] | None]]] = {
    "/api/v1/tasks/{taskId}/trigger": {"post": ("Trigger a run", models.TriggerBody)},
    "/api/v1/tasks/batch": {"post": ("Trigger a batch of runs", models.BatchBody)},
    "/api/v1/batches/{batchId}": {"get": ("Get a batch", None)},
    "/api/v3/runs/{runId}": {"get": ("Get a run", None)},
    "/api/v1/runs": {"get": ("List runs", None)},
    "/api/v2/runs/{runId}/cancel": {"post": ("Cancel a run", None)},
    "/api/v1/runs/{runId}/replay": {"post": ("Replay a run", None)},
    "/api/v1/queues": {"get": ("List queues", None)},
    "/api/v1/queues/{name}": {"get": ("Get a queue", None)},
    "/api/v1/queues/{name}/pause": {"post": ("Pause or resume a queue", models.PauseBody)},
    "/api/v1/queues/{name}/concurrency/override": {"post": ("Override the concurrency limit", models.ConcurrencyBody)},
    "/api/v1/queues/{name}/concurrency/reset": {"post": ("Reset the concurrency limit", None)},
    "/api/v1/dlq": {"get": ("List dead-lettered runs", None)},
    "/api/v1/dlq/{runId}/redrive": {"post": ("Redrive one run", None)},
    "/api/v1/dlq/redrive": {"post": ("Redrive matching runs", models.RedriveAllBody)},
    "/engine/v1/worker-actions/connect": {"post": ("Register a worker and its deployment", models.ConnectBody)},
    "/engine/v1/worker-actions/heartbeat": {"post": ("Worker liveness", models.WorkerHeartbeatBody)},
    "/engine/v1/worker-actions/dequeue": {"post": ("Long-poll for runs", models.DequeueBody)},
    "/engine/v1/worker-actions/attempts/start": {"post": ("Start many attempts (per-item results)",
                                                          models.BatchStartBody)},
    "/engine/v1/worker-actions/attempts/complete": {"post": ("Complete many attempts (per-item results)",
                                                             models.BatchCompleteBody)},
    "/engine/v1/worker-actions/runs/{runId}/snapshots/latest": {"get": ("Latest snapshot", None)},
    "/engine/v1/worker-actions/runs/{runId}/snapshots/{snapshotId}/attempts/start": {"post": ("Start an attempt", None)},
    "/engine/v1/worker-actions/runs/{runId}/snapshots/{snapshotId}/attempts/complete": {
        "post": ("Complete an attempt", models.CompleteBody)},
    "/engine/v1/worker-actions/runs/{runId}/snapshots/{snapshotId}/heartbeat": {"post": ("Run liveness", None)},
    "/api/v1/runs/{runId}/reschedule": {"post": ("Reschedule a delayed run (422 unless DELAYED)",
                                                 models.RescheduleBody)},
    "/api/v1/runs/{runId}/explain": {"get": ("Why a QUEUED or DELAYED run has not started", None)},
    "/api/v1/runs/{runId}/metadata": {"put": ("Replace a run's metadata", models.MetadataBody)},
    "/api/v1/runs/{runId}/tags": {"post": ("Add tags to a run (at most 10)", models.TagsBody)},
    "/api/v1/schedules": {"post": ("Create a cron schedule (the same deduplicationKey updates it)", models.ScheduleBody),
                          "get": ("List schedules", None)},
    "/api/v1/schedules/{scheduleId}": {"get": ("Get a schedule", None), "delete": ("Delete a schedule", None)},
    "/api/v1/schedules/{scheduleId}/activate": {"post": ("Activate a schedule", None)},
    "/api/v1/schedules/{scheduleId}/deactivate": {"post": ("Deactivate a schedule", None)},
    "/realtime/v1/runs/{runId}": {"get": ("Server-Sent Events: the run object on every status change", None)},
    "/api/v1/waitpoints/tokens": {"post": ("Create a waitpoint token", models.TokenCreateBody),
                                  "get": ("List waitpoint tokens", None)},
    "/api/v1/waitpoints/tokens/{waitpointId}": {"get": ("Get a waitpoint token", None)},
    "/api/v1/waitpoints/tokens/{waitpointId}/complete": {"post": ("Complete a token", models.TokenCompleteBody)},
    "/api/v1/waitpoints/tokens/{waitpointId}/callback/{signature}": {
        "post": ("Complete a token by its signed callback URL (no API key; the body is the output)", None)},
    "/engine/v1/worker-actions/runs/{runId}/snapshots/{snapshotId}/wait/duration": {
        "post": ("Wait for a duration or until a date (DATETIME waitpoint)", models.WaitDurationBody)},
    "/engine/v1/worker-actions/runs/{runId}/snapshots/{snapshotId}/waitpoints/{waitpointId}/wait": {
        "post": ("Block on a token or run waitpoint", models.WaitBody)},
    "/engine/v1/worker-actions/runs/{runId}/snapshots/{snapshotId}/trigger": {
        "post": ("Trigger children and wait for them (RUN or BATCH waitpoint)", models.ChildTriggerBody)},
    "/engine/v1/worker-actions/runs/{runId}/snapshots/{snapshotId}/suspend": {
        "post": ("Checkpoint a blocked run (REPLAY) and release its concurrency", None)},
    "/engine/v1/worker-actions/runs/{runId}/snapshots/{snapshotId}/continue": {
        "post": ("Resume a restored run (same as attempts/start)", None)},
    "/engine/v1/worker-actions/runs/{runId}/journal": {"post": ("Journal a step result", models.JournalBody),
                                                       "get": ("The run's journal, waits resolved", None)},
}

_ERROR_SCHEMA = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "code": {"type": "string"}, "message": {"type": "string"}}, "required": ["code", "message"]}}}


def openapi_document() -> dict[str, Any]:
    components: dict[str, Any] = {"Error": _ERROR_SCHEMA}
    paths: dict[str, Any] = {}
    for path, methods in _DOC.items():
        item: dict[str, Any] = {}
        for method, (summary, model) in methods.items():
            op: dict[str, Any] = {
                "summary": summary,
                "security": [{"bearer": []}],
                "parameters": [{"name": p.strip("{}"), "in": "path", "required": True, "schema": {"type": "string"}}
                               for p in path.split("/") if p.startswith("{")],
                "responses": {"200": {"description": "OK"}, **{
                    str(code): {"description": text, "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/Error"}}}}
                    for code, text in ((400, "invalid input"), (401, "missing or bad credentials"),
                                       (403, "credentials of another scope"), (404, "unknown id"),
                                       (409, "conflict"), (413, "payload too large"),
                                       (422, "impossible in the current state"), (429, "rate limited"))}},
            }
            if model is not None:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            item[method] = op
        paths[path] = item
    return {
        "openapi": "3.1.0",
        "info": {"title": "run-engine", "version": "1"},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


async def healthz(request: Request) -> Response:
    ctx: ApiContext = request.app.state.ctx
    await ctx.engine.redis.ping()
    return json_response({"ok": True})


async def openapi(request: Request) -> Response:
    return json_response(openapi_document())


def create_app(ctx: ApiContext) -> Starlette:
    app = Starlette(
        routes=[Route("/healthz", healthz), Route("/openapi.json", openapi), *public.ROUTES, *tokens.ROUTES, *schedules.ROUTES, *stream.ROUTES,
                *worker.ROUTES],
        # Expected errors are answered by ExceptionMiddleware; anything else reaches
        # ServerErrorMiddleware, which answers with the same shape and logs the traceback.
        exception_handlers={ApiError: handle_exception, RunEngineError: handle_exception,
                            HTTPException: handle_exception, Exception: handle_exception},
    )
    app.state.ctx = ctx
    return app
