"""The worker API (API.md, "Worker API"): worker group token; run-scoped calls carry the
caller's snapshot id, and a stale one gets 409 with the latest snapshot."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api.context import ApiContext
from run_engine.api.http import ApiError, body, json_response
from run_engine.api.models import CompleteBody, ConnectBody, DequeueBody, WorkerHeartbeatBody
from run_engine.api.serialize import run_object, snapshot_object
from run_engine.db.repository import RunRow
from run_engine.ids import new_id

PREFIX = "/engine/v1/worker-actions"


def _ctx(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


async def connect(request: Request) -> Response:
    ctx = _ctx(request)
    group = await ctx.worker_group(request)
    req = await body(request, ConnectBody)
    await ctx.repo.upsert_worker_instance(new_id("wi"), group["id"], req.workerInstanceName)
    tasks = [t.model_dump(exclude_none=True) for t in req.deployment.tasks]
    queues = [q.model_dump(exclude_none=True) for q in req.deployment.queues]
    ids = [t["id"] for t in tasks]
    if len(set(ids)) != len(ids):
        raise ApiError(400, "invalid_input", "deployment.tasks: task ids must be unique")
    content_hash = hashlib.sha256(orjson.dumps({"tasks": tasks, "queues": queues}, option=orjson.OPT_SORT_KEYS)).hexdigest()
    version = req.deployment.version or content_hash[:12]
    envs = await ctx.repo.environments_of_worker_group(group["id"])
    if req.environments:
        wanted = set(req.environments)
        envs = [e for e in envs if e["id"] in wanted or e["slug"] in wanted]
    if not envs:
        raise ApiError(422, "no_environment", "this worker group serves no environment (run `run-engine bootstrap`)")
    deployments = []
    for env in envs:
        dep_id, enqueued = await ctx.engine.register_deployment(
            env_id=env["id"], worker_group_id=group["id"], version=version, content_hash=content_hash,
            tasks=tasks, queues=queues)
        deployments.append({"environmentId": env["id"], "deploymentId": dep_id, "pendingRunsEnqueued": enqueued})
    return json_response({"deploymentId": deployments[0]["deploymentId"], "version": version,
                          "workerGroupId": group["id"], "deployments": deployments})


async def heartbeat(request: Request) -> Response:
    ctx = _ctx(request)
    group = await ctx.worker_group(request)
    req = await body(request, WorkerHeartbeatBody)
    if not await ctx.repo.touch_worker_instance(group["id"], req.workerInstanceName):
        await ctx.repo.upsert_worker_instance(new_id("wi"), group["id"], req.workerInstanceName)
    return json_response({"ok": True})


def _run_payload(ctx: ApiContext, run: RunRow, snapshot: Any) -> dict[str, Any]:
    attempt = run.attempt_number + 1
    expires = int(ctx.engine.resources.clock.now()) + ctx.run_token_ttl_s
    return {
        "run": {"id": run.id, "taskIdentifier": run.task_identifier, "queue": run.queue,
                "environmentId": run.environment_id, "attemptNumber": attempt, "maxDuration": run.max_duration_s,
                "machine": run.machine, "tags": run.tags, "concurrencyKey": run.concurrency_key},
        "snapshot": snapshot_object(snapshot),
        "runToken": ctx.tokens.mint(run.id, attempt, expires),
    }


async def dequeue(request: Request) -> Response:
    ctx = _ctx(request)
    group = await ctx.worker_group(request)
    req = await body(request, DequeueBody, required=False)
    deadline = time.monotonic() + req.waitMs / 1000
    while True:
        got = await ctx.engine.dequeue(group["id"], req.maxRuns, req.workerInstanceName)
        remaining = deadline - time.monotonic()
        if got or remaining <= 0:
            break
        # Woken by an enqueue or a freed slot; the cap re-checks for runs whose back-off ended.
        await ctx.wakeups.wait(group["id"], min(remaining, 1.0))
    for d in got:
        ctx.remember_run_group(d.run.id, group["id"])
    return json_response({"runs": [_run_payload(ctx, d.run, d.snapshot) for d in got]})


async def _group_run_id(ctx: ApiContext, request: Request) -> str:
    """The run id of the path, if the run belongs to the caller's worker group (404 otherwise).
    Runs this process handed out are remembered, so the hot path needs no query."""
    group = await ctx.worker_group(request)
    run_id: str = request.path_params["run_id"]
    if ctx.run_group(run_id) == group["id"]:
        return run_id
    run = await ctx.engine.get_run(run_id)
    if run is None or run.worker_group_id != group["id"]:
        raise ApiError(404, "not_found", "run not found")
    ctx.remember_run_group(run_id, group["id"])
    return run_id


async def latest_snapshot(request: Request) -> Response:
    ctx = _ctx(request)
    run_id = await _group_run_id(ctx, request)
    return json_response({"snapshot": snapshot_object(await ctx.engine.latest_snapshot(run_id))})


async def start_attempt(request: Request) -> Response:
    ctx = _ctx(request)
    run_id = await _group_run_id(ctx, request)
    started = await ctx.engine.start_attempt(run_id, request.path_params["snapshot_id"])
    r = started.run
    return json_response({
        "run": run_object(r), "snapshot": snapshot_object(started.snapshot), "attemptNumber": started.attempt_number,
        "payload": r.payload, "journal": [], "machine": r.machine or "small-1x",
        "maxDuration": started.max_duration_s, "retry": started.retry.to_json(),
        "runToken": ctx.tokens.mint(r.id, started.attempt_number,
                                    int(ctx.engine.resources.clock.now()) + ctx.run_token_ttl_s),
    })


async def complete_attempt(request: Request) -> Response:
    ctx = _ctx(request)
    run_id = await _group_run_id(ctx, request)
    req = await body(request, CompleteBody)
    if req.ok:
        limit = ctx.engine.resources.settings.max_payload_bytes
        if req.output is not None and len(orjson.dumps(req.output)) > limit:
            raise ApiError(413, "payload_too_large", f"output: larger than {limit} bytes")
        outcome = await ctx.engine.complete_attempt(run_id, request.path_params["snapshot_id"], ok=True,
                                                    output=req.output)
    else:
        error = (req.error.model_dump(exclude_none=True) if req.error
                 else {"type": "BUILT_IN_ERROR", "message": "unknown error"})
        outcome = await ctx.engine.complete_attempt(run_id, request.path_params["snapshot_id"], ok=False,
                                                    error=error, retryable=req.retryable)
    out: dict[str, Any] = {"action": outcome.action, "status": outcome.status.value, "snapshotId": outcome.snapshot_id}
    if outcome.delay_ms is not None:
        out["delayMs"] = outcome.delay_ms
    return json_response(out)


async def run_heartbeat(request: Request) -> Response:
    ctx = _ctx(request)
    run_id = await _group_run_id(ctx, request)
    await ctx.engine.heartbeat(run_id, request.path_params["snapshot_id"])
    return json_response({"ok": True})


ROUTES = [
    Route(f"{PREFIX}/connect", connect, methods=["POST"]),
    Route(f"{PREFIX}/heartbeat", heartbeat, methods=["POST"]),
    Route(f"{PREFIX}/dequeue", dequeue, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/latest", latest_snapshot, methods=["GET"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/attempts/start", start_attempt, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/attempts/complete", complete_attempt, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/heartbeat", run_heartbeat, methods=["POST"]),
]
