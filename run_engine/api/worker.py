"""The worker API (API.md, "Worker API"): worker group token; run-scoped calls carry the
caller's snapshot id, and a stale one gets 409 with the latest snapshot."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api.context import ApiContext
from run_engine.api.http import ApiError, body, error_payload, json_response
from run_engine.api.models import (
    BatchCompleteBody,
    BatchCompleteItem,
    BatchStartBody,
    CompleteBody,
    ConnectBody,
    DequeueBody,
    RunSnapshotRef,
    WorkerHeartbeatBody,
)
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
    items = [_run_payload(ctx, d.run, d.snapshot) for d in got]
    if req.startAttempts and got:
        started = await _each(got, lambda d: _start(ctx, d.run.id, d.snapshot.id))
        for item, attempt in zip(items, started, strict=True):
            item["attempt"] = attempt
    return json_response({"runs": items})


async def _check_group(ctx: ApiContext, group: dict[str, Any], run_id: str) -> str:
    """``run_id`` if the run belongs to the caller's worker group (404 otherwise). Runs this
    process handed out are remembered, so the hot path needs no query."""
    if ctx.run_group(run_id) == group["id"]:
        return run_id
    run = await ctx.engine.get_run(run_id)
    if run is None or run.worker_group_id != group["id"]:
        raise ApiError(404, "not_found", "run not found")
    ctx.remember_run_group(run_id, group["id"])
    return run_id


async def _group_run_id(ctx: ApiContext, request: Request) -> str:
    return await _check_group(ctx, await ctx.worker_group(request), request.path_params["run_id"])


async def latest_snapshot(request: Request) -> Response:
    ctx = _ctx(request)
    run_id = await _group_run_id(ctx, request)
    return json_response({"snapshot": snapshot_object(await ctx.engine.latest_snapshot(run_id))})


async def _start(ctx: ApiContext, run_id: str, snapshot_id: str) -> dict[str, Any]:
    started = await ctx.engine.start_attempt(run_id, snapshot_id)
    r = started.run
    return {
        "run": run_object(r), "snapshot": snapshot_object(started.snapshot), "attemptNumber": started.attempt_number,
        "payload": r.payload, "journal": [], "machine": r.machine or "small-1x",
        "maxDuration": started.max_duration_s, "retry": started.retry.to_json(),
        "runToken": ctx.tokens.mint(r.id, started.attempt_number,
                                    int(ctx.engine.resources.clock.now()) + ctx.run_token_ttl_s),
    }


async def _complete(ctx: ApiContext, run_id: str, snapshot_id: str, req: CompleteBody) -> dict[str, Any]:
    if req.ok:
        limit = ctx.engine.resources.settings.max_payload_bytes
        if req.output is not None and len(orjson.dumps(req.output)) > limit:
            raise ApiError(413, "payload_too_large", f"output: larger than {limit} bytes")
        outcome = await ctx.engine.complete_attempt(run_id, snapshot_id, ok=True, output=req.output)
    else:
        error = (req.error.model_dump(exclude_none=True) if req.error
                 else {"type": "BUILT_IN_ERROR", "message": "unknown error"})
        outcome = await ctx.engine.complete_attempt(run_id, snapshot_id, ok=False, error=error,
                                                    retryable=req.retryable)
    out: dict[str, Any] = {"action": outcome.action, "status": outcome.status.value, "snapshotId": outcome.snapshot_id}
    if outcome.delay_ms is not None:
        out["delayMs"] = outcome.delay_ms
    return out


async def start_attempt(request: Request) -> Response:
    ctx = _ctx(request)
    run_id = await _group_run_id(ctx, request)
    return json_response(await _start(ctx, run_id, request.path_params["snapshot_id"]))


async def complete_attempt(request: Request) -> Response:
    ctx = _ctx(request)
    run_id = await _group_run_id(ctx, request)
    req = await body(request, CompleteBody)
    return json_response(await _complete(ctx, run_id, request.path_params["snapshot_id"], req))


async def _each(items: list[Any], one: Callable[[Any], Awaitable[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run ``one`` for every item concurrently (the engine batches them); per-item results."""
    async def guarded(item: Any) -> dict[str, Any]:
        try:
            return {"ok": True, **await one(item)}
        except Exception as exc:
            status, data, _ = error_payload(exc)
            return {"ok": False, "status": status, **data}

    return list(await asyncio.gather(*(guarded(i) for i in items)))


async def start_attempts(request: Request) -> Response:
    """Start many attempts in one request (a supervisor under load)."""
    ctx = _ctx(request)
    group = await ctx.worker_group(request)
    req = await body(request, BatchStartBody)

    async def one(item: RunSnapshotRef) -> dict[str, Any]:
        return await _start(ctx, await _check_group(ctx, group, item.runId), item.snapshotId)

    return json_response({"results": await _each(req.items, one)})


async def complete_attempts(request: Request) -> Response:
    """Complete many attempts in one request."""
    ctx = _ctx(request)
    group = await ctx.worker_group(request)
    req = await body(request, BatchCompleteBody)

    async def one(item: BatchCompleteItem) -> dict[str, Any]:
        return await _complete(ctx, await _check_group(ctx, group, item.runId), item.snapshotId, item)

    return json_response({"results": await _each(req.items, one)})


async def run_heartbeat(request: Request) -> Response:
    ctx = _ctx(request)
    run_id = await _group_run_id(ctx, request)
    await ctx.engine.heartbeat(run_id, request.path_params["snapshot_id"])
    return json_response({"ok": True})


ROUTES = [
    Route(f"{PREFIX}/connect", connect, methods=["POST"]),
    Route(f"{PREFIX}/heartbeat", heartbeat, methods=["POST"]),
    Route(f"{PREFIX}/dequeue", dequeue, methods=["POST"]),
    Route(f"{PREFIX}/attempts/start", start_attempts, methods=["POST"]),
    Route(f"{PREFIX}/attempts/complete", complete_attempts, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/latest", latest_snapshot, methods=["GET"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/attempts/start", start_attempt, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/attempts/complete", complete_attempt, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/heartbeat", run_heartbeat, methods=["POST"]),
]
