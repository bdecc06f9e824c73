"""The worker API (API.md, "Worker API"): worker group token; run-scoped calls carry the
caller's snapshot id, and a stale one gets 409 with the latest snapshot."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from run_engine.api import schemas as S
from run_engine.api.context import ApiContext, EnvAuth, ctx_of, worker_bucket
from run_engine.api.http import SCAN_OFF_LOOP_BYTES, ApiError, body, decode_payloads, error_payload, json_response
from run_engine.api.inputs import is_number, looks_like_id, needs_scan, too_many_containers, unstorable
from run_engine.api.models import (
    BatchCompleteBody,
    BatchCompleteItem,
    BatchStartBody,
    BatchWaitBody,
    BatchWaitItem,
    ChildTriggerBody,
    CompleteBody,
    ConnectBody,
    DequeueBody,
    JournalBody,
    RunSnapshotRef,
    WaitBody,
    WaitDurationBody,
    WorkerHeartbeatBody,
)
from run_engine.api.openapi import Query, operation
from run_engine.api.serialize import run_object, snapshot_object
from run_engine.engine import ResolvedJournal, RunRow, StartedAttempt, Waitpoint, WorkerGroup, is_batch_entry
from run_engine.errors import NotFoundError, StaleSnapshotError

PREFIX = "/engine/v1/worker-actions"
LATEST_RECHECK_S = 5.0  # a snapshot long-poll re-reads the run this often without a wake-up


@operation("Register a worker and its deployment", S.Connected, body=ConnectBody, security="workerToken")
async def connect(request: Request) -> Response:
    ctx = ctx_of(request)
    group = await ctx.worker_group(request)
    req = await body(request, ConnectBody)
    # the content hash is over the declaration as the worker sent it: the same declaration is
    # the same deployment, whatever the engine makes of it
    tasks = [t.model_dump(exclude_none=True) for t in req.deployment.tasks]
    queues = [{**q.model_dump(exclude_none=True), **({"rateLimit": q.rateLimit.stored()} if q.rateLimit else {})}
              for q in req.deployment.queues]
    content_hash = hashlib.sha256(orjson.dumps({"tasks": tasks, "queues": queues},
                                               option=orjson.OPT_SORT_KEYS)).hexdigest()
    deployed = await ctx.engine.deploy(
        group, version=req.deployment.version, content_hash=content_hash, environments=req.environments or (),
        tasks=[t.spec() for t in req.deployment.tasks], queues=[q.spec() for q in req.deployment.queues])
    # recorded once its deployment was taken somewhere: a worker refused everywhere (422) is not one
    await ctx.engine.connect_worker_instance(group.id, _instance_name(group, req.workerInstanceName), req.concurrency)
    # each with its version: the same content connected again is the deployment registered before,
    # with the version it was registered with (an environment may have had it, another not)
    deployments = [{"environmentId": d.env_id, "deploymentId": d.deployment_id, "version": d.version,
                    "pendingRunsEnqueued": d.pending_runs_enqueued} for d in deployed if d.refused is None]
    # an environment at its queue cap keeps its current deployment; the others took this one
    refused = [{"environmentId": d.env_id, "error": {"code": "too_many_queues", "message": d.refused}}
               for d in deployed if d.refused is not None]
    return json_response({"deploymentId": deployments[0]["deploymentId"], "version": deployments[0]["version"],
                          "workerGroupId": group.id, "deployments": deployments,
                          **({"refused": refused} if refused else {})})


@operation("Worker liveness", S.Ok, body=WorkerHeartbeatBody, security="workerToken")
async def heartbeat(request: Request) -> Response:
    ctx = ctx_of(request)
    group = await ctx.worker_group(request)
    req = await body(request, WorkerHeartbeatBody)
    name = _instance_name(group, req.workerInstanceName)
    if req.stopping:
        ctx.wakeups.release(f"{group.id}/{name}", group.id)
    if not await ctx.engine.touch_worker_instance(group.id, name):
        await ctx.engine.connect_worker_instance(group.id, name)
    return json_response({"ok": True})


def _instance_name(group: WorkerGroup, name: str) -> str:
    """A worker instance's name in its group: a token of one environment names its own instances
    only (``<environment id>/<name>``), so that it can neither end another supervisor's long-poll
    (``stopping``) nor change what the group shows of it."""
    return f"{group.scoped_env_id}/{name}" if group.scoped_env_id else name


def _run_payload(ctx: ApiContext, run: RunRow, snapshot: Any, token: str | None = None) -> dict[str, Any]:
    """A dequeued run as the worker gets it; ``token``: the run token of the attempt the dequeue
    started (else one is minted for the attempt its start makes: the next one, or, for a run
    restored from its checkpoint, the attempt it resumes by journal replay)."""
    attempt = run.attempt_number + (0 if snapshot.checkpoint_id else 1)
    expires = int(ctx.engine.now()) + ctx.run_token_ttl_s
    return {
        "run": {"id": run.id, "taskIdentifier": run.task_id, "queue": run.queue,
                "environmentId": run.env_id, "attemptNumber": attempt, "maxDuration": run.max_duration_s,
                "machine": run.machine, "tags": run.tags, "concurrencyKey": run.concurrency_key},
        "snapshot": snapshot_object(snapshot),
        "runToken": token or ctx.tokens.mint(run.id, attempt, expires),
    }


@operation("Long-poll for runs", S.DequeueOut, body=DequeueBody, body_required=False, security="workerToken")
async def dequeue(request: Request) -> Response:
    ctx = ctx_of(request)
    group = await ctx.worker_group(request)
    req = await body(request, DequeueBody, required=False)
    environments = list(req.environments or ())
    if scoped := group.scoped_env_id:
        if environments and environments != [scoped]:
            raise ApiError(403, "forbidden", f"this token serves environment {scoped} only")
        environments = [scoped]
    began = time.monotonic()
    deadline = began + req.waitMs / 1000
    worker_name = None if req.workerInstanceName is None else _instance_name(group, req.workerInstanceName)
    instance = f"{group.id}/{worker_name}"
    got = await ctx.engine.dequeue(group.id, req.maxRuns, worker_name, environments,
                                   req.deployments or (), start=req.startAttempts)
    if not got and req.waitMs:
        with ctx.hold("long-polls", worker_bucket(group)):
            while True:
                remaining = deadline - time.monotonic()
                if got or remaining <= 0:
                    break
                # Woken by an enqueue or a freed slot; the cap re-checks for runs whose back-off
                # ended, and a rate-limited queue says when it may serve again.
                cap = 1.0
                if got.retry_at_ms is not None:
                    cap = max(0.002, min(cap, got.retry_at_ms / 1000 - ctx.engine.now()))
                await ctx.wakeups.wait(group.id, min(remaining, cap))
                if ctx.wakeups.stopping:
                    break  # this server is stopping: answer now rather than be cut off mid-poll
                if ctx.wakeups.released(instance, since=began) or await request.is_disconnected():
                    break  # the worker is stopping or gone: runs handed out now would wait for a timeout
                got = await ctx.engine.dequeue(group.id, req.maxRuns, worker_name, environments,
                                               req.deployments or (), start=req.startAttempts)
    for d in got:
        ctx.remember_run_group(d.run.id, group.id, d.run.env_id)
    if req.startAttempts and got:
        # started in the dequeue's own statement; one it could not start is started here
        started = await _each(got, lambda d: _attempt(ctx, d.started) if d.started is not None
                              else _start(ctx, d.run.id, d.snapshot.id))
        items = [{**_run_payload(ctx, d.run, d.snapshot, attempt.get("runToken")), "attempt": attempt}
                 for d, attempt in zip(got, started, strict=True)]
    else:
        items = [_run_payload(ctx, d.run, d.snapshot) for d in got]
    # backlog (only when true): runs of the group were still ready after this dequeue (a supervisor
    # whose slots are all busy then suspends a run that blocks at once rather than after its grace)
    return json_response({"runs": items, "backlog": True} if got.backlog else {"runs": items})


async def _check_group(ctx: ApiContext, group: WorkerGroup, run_id: str) -> str:
    """``run_id`` if the run belongs to the caller's worker group (and, for an environment's
    token, to that environment); 404 otherwise. Runs this process handed out are remembered, so
    the hot path needs no query."""
    return (await _check_group_env(ctx, group, run_id))[0]


async def _check_group_env(ctx: ApiContext, group: WorkerGroup, run_id: str) -> tuple[str, str]:
    """(``run_id``, its environment) as :func:`_check_group` checks them."""
    owner = ctx.run_group(run_id)
    if owner is None:
        run = await ctx.engine.get_run(run_id) if looks_like_id(run_id, "run") else None
        if run is None:
            raise ApiError(404, "not_found", "run not found")
        owner = (run.worker_group_id, run.env_id)
        ctx.remember_run_group(run_id, *owner)
    scoped = group.scoped_env_id
    if owner[0] != group.id or (scoped and owner[1] != scoped):
        raise ApiError(404, "not_found", "run not found")
    return run_id, owner[1]


async def _group_run_id(ctx: ApiContext, request: Request) -> str:
    return await _check_group(ctx, await ctx.worker_group(request), request.path_params["run_id"])


@operation("Latest snapshot; with after and waitMs, waits for another", S.SnapshotOut,
           query=(Query("after", {"type": "string", "maxLength": 256}),
                  Query("waitMs", {"type": "integer", "minimum": 0, "maximum": 60000})),
           security="workerToken")
async def latest_snapshot(request: Request) -> Response:
    """The latest snapshot; with ``after=<snapshot id>&waitMs=N`` it waits (long-poll) until the
    latest is another one, e.g. a waiting run continued or was cancelled. With ``since=<snapshot
    id>`` (no wait) it also says, as ``sameExecution``, whether the latest continues the execution
    that held that snapshot (its own waits and continuations only: not a restore elsewhere, not
    another attempt): a worker whose answer was lost tells by it whether a move was its own."""
    ctx = ctx_of(request)
    group = await ctx.worker_group(request)
    run_id = await _check_group(ctx, group, request.path_params["run_id"])
    if (since := request.query_params.get("since")) is not None:
        if not looks_like_id(since, "snapshot"):
            raise ApiError(400, "invalid_input", "since: must be a snapshot id")
        latest, same = await ctx.engine.latest_snapshot_since(run_id, since)
        return json_response({"snapshot": snapshot_object(latest), "sameExecution": same})
    after = request.query_params.get("after")
    raw_wait = request.query_params.get("waitMs", "0")
    if not is_number(raw_wait) or int(raw_wait) > 60_000:
        raise ApiError(400, "invalid_input", "waitMs: must be an integer 0..60000")
    deadline = time.monotonic() + int(raw_wait) / 1000
    snapshot = await ctx.engine.latest_snapshot(run_id)
    if after is not None and snapshot.id == after and int(raw_wait):
        with ctx.hold("long-polls", worker_bucket(group)):
            while snapshot.id == after and (remaining := deadline - time.monotonic()) > 0:
                # woken by a continue or a cancel (any server process); the cap re-reads in case a
                # wake-up was lost
                await ctx.wakeups.wait(f"run:{run_id}", min(remaining, LATEST_RECHECK_S))
                snapshot = await ctx.engine.latest_snapshot(run_id)
    return json_response({"snapshot": snapshot_object(snapshot)})


async def _snapshot_of(ctx: ApiContext, run_id: str, snapshot_id: str) -> str:
    """``snapshot_id`` if it has the shape of a snapshot id; else the 409 any other snapshot but the
    run's latest gets, without the id ever reaching a statement that other runs' items share (a
    NUL in it would fail that statement for all of them)."""
    if looks_like_id(snapshot_id, "snapshot"):
        return snapshot_id
    latest = await ctx.engine.latest_snapshot(run_id)
    raise StaleSnapshotError(run_id, "(malformed)", latest.id, latest.engine_status)


async def _start(ctx: ApiContext, run_id: str, snapshot_id: str) -> dict[str, Any]:
    snapshot_id = await _snapshot_of(ctx, run_id, snapshot_id)
    return await _attempt(ctx, await ctx.engine.start_attempt(run_id, snapshot_id))


async def _attempt(ctx: ApiContext, started: StartedAttempt) -> dict[str, Any]:
    """A started attempt as the worker gets it."""
    r = started.run
    return {
        "run": run_object(r), "snapshot": snapshot_object(started.snapshot), "attemptNumber": started.attempt_number,
        "payload": r.payload, "machine": started.machine or "small-1x",
        # a first attempt has nothing journaled yet: no query on the hot path; a dequeue that
        # started a restored run read its journal's first page in the same statement
        **_journal_fields(started.journal if started.journal is not None else (
            await ctx.engine.resolved_journal(r.id) if started.snapshot.checkpoint_id or started.attempt_number > 1
            else None)),
        "maxDuration": started.max_duration_s, "retry": started.retry.to_json(),
        "runToken": ctx.tokens.mint(r.id, started.attempt_number,
                                    int(ctx.engine.now()) + ctx.run_token_ttl_s),
    }


def _journal_fields(page: ResolvedJournal | None) -> dict[str, Any]:
    """``journal`` (a page of it) and, when more follow, ``journalNext``: the sequence the executor
    asks for (``GET …/journal?from=``) once its replay gets there."""
    if page is None:
        return {"journal": []}
    return {"journal": page.entries, **({"journalNext": page.next} if page.next is not None else {})}


#: an attempt's error message and stack trace are kept to this many characters, its type, name and
#: code to 256: an error is for reading, and every page, realtime answer and DLQ listing reads it
#: (a task could otherwise fail a thousand runs with 10 MiB each)
ERROR_TEXT_CHARS = 32 * 1024
ERROR_NAME_CHARS = 256


def _cut(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    return value[:limit] + f"\u2026 [cut: {len(value) - limit} more characters]"


def _storable_error(error: dict[str, Any]) -> dict[str, Any]:
    """An attempt's error as it can be stored: NUL characters in its strings become U+FFFD, and
    long ones are cut (:data:`ERROR_TEXT_CHARS`; an error is for reading, refusing it would leave
    the run executing)."""
    return {k: _cut(v.replace("\x00", "\ufffd"), ERROR_TEXT_CHARS if k in ("message", "stackTrace")
                    else ERROR_NAME_CHARS) if isinstance(v, str) else v for k, v in error.items()}


async def _complete(ctx: ApiContext, run_id: str, snapshot_id: str, req: CompleteBody,
                    field: str = "output") -> dict[str, Any]:
    snapshot_id = await _snapshot_of(ctx, run_id, snapshot_id)  # the body is not scanned: see above
    problem = None
    if req.ok:
        try:
            raw = orjson.dumps(req.output)
            if (many := too_many_containers(raw)) is not None:
                problem = f"{field}: {many}"
            elif needs_scan(raw):  # a large output is walked off the event loop (every tenant's requests are on it)
                problem = (await asyncio.to_thread(unstorable, req.output, field) if len(raw) > SCAN_OFF_LOOP_BYTES
                           else unstorable(req.output, field))
        except orjson.JSONEncodeError:  # nested too deep for orjson
            problem = unstorable(req.output, field) or f"{field}: cannot be serialised"
    if req.ok and problem is None:
        ctx.check_size(req.output, field, raw)
        outcome = await ctx.engine.complete_attempt(run_id, snapshot_id, ok=True, output=req.output)
    elif problem is not None:
        # The task succeeded with an output that cannot be stored: the run fails with a clear
        # error (retrying would produce the same output) instead of staying EXECUTING.
        outcome = await ctx.engine.complete_attempt(run_id, snapshot_id, ok=False, retryable=False, error={
            "type": "OUTPUT_NOT_STORABLE", "name": "OutputNotStorable",
            "message": _cut(f"the task's {problem}", ERROR_TEXT_CHARS)})  # the path names its keys
    else:
        error = (_storable_error(req.error.model_dump(exclude_none=True)) if req.error
                 else {"type": "BUILT_IN_ERROR", "message": "unknown error"})
        outcome = await ctx.engine.complete_attempt(run_id, snapshot_id, ok=False, error=error,
                                                    retryable=req.retryable)
    out: dict[str, Any] = {"action": outcome.action, "status": outcome.status.value, "snapshotId": outcome.snapshot_id}
    if outcome.delay_ms is not None:
        out["delayMs"] = outcome.delay_ms
    return out


@operation("Start (or, after a restore, continue) an attempt", S.Started, security="workerToken")
async def start_attempt(request: Request) -> Response:
    ctx = ctx_of(request)
    run_id = await _group_run_id(ctx, request)
    return json_response(await _start(ctx, run_id, request.path_params["snapshot_id"]))


@operation("Complete an attempt", S.Completed, body=CompleteBody, security="workerToken")
async def complete_attempt(request: Request) -> Response:
    ctx = ctx_of(request)
    run_id = await _group_run_id(ctx, request)
    req = await body(request, CompleteBody, scan=False)  # an unstorable output fails the run: _complete
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


@operation("Start many attempts (per-item results)", S.ItemResults, body=BatchStartBody, security="workerToken")
async def start_attempts(request: Request) -> Response:
    """Start many attempts in one request (a supervisor under load)."""
    ctx = ctx_of(request)
    group = await ctx.worker_group(request)
    req = await body(request, BatchStartBody)

    async def one(item: RunSnapshotRef) -> dict[str, Any]:
        return await _start(ctx, await _check_group(ctx, group, item.runId), item.snapshotId)

    return json_response({"results": await _each(req.items, one)})


@operation("Complete many attempts (per-item results)", S.ItemResults, body=BatchCompleteBody, security="workerToken")
async def complete_attempts(request: Request) -> Response:
    """Complete many attempts in one request."""
    ctx = ctx_of(request)
    group = await ctx.worker_group(request)
    req = await body(request, BatchCompleteBody, scan=False)  # checked per item: one bad output fails one run

    async def one(pair: tuple[int, BatchCompleteItem]) -> dict[str, Any]:
        i, item = pair
        return await _complete(ctx, await _check_group(ctx, group, item.runId), item.snapshotId, item,
                               f"items.{i}.output")

    return json_response({"results": await _each(list(enumerate(req.items)), one)})


@operation("Run liveness", S.Ok, security="workerToken")
async def run_heartbeat(request: Request) -> Response:
    ctx = ctx_of(request)
    run_id = await _group_run_id(ctx, request)
    await ctx.engine.heartbeat(run_id, request.path_params["snapshot_id"])
    return json_response({"ok": True})


# --- waits, suspension, the journal ----------------------------------------------------------

def _blocked(outcome: Any, **extra: Any) -> dict[str, Any]:
    """A wait's answer: ``{blocked, snapshot, suspended?, entry?}``."""
    out = {"blocked": outcome.blocked, "snapshot": snapshot_object(outcome.snapshot), **extra}
    if outcome.suspended:
        out["suspended"] = True
    if outcome.entry is not None:
        out["entry"] = outcome.entry
    return out


def _block_response(outcome: Any, **extra: Any) -> Response:
    return json_response(_blocked(outcome, **extra))


@operation("Wait for a duration or until a date (DATETIME waitpoint)", S.Blocked, body=WaitDurationBody,
           security="workerToken")
async def wait_duration(request: Request) -> Response:
    ctx = ctx_of(request)
    run_id, env_id = await _check_group_env(ctx, await ctx.worker_group(request), request.path_params["run_id"])
    req = await body(request, WaitDurationBody)
    if (req.seconds is None) == (req.date is None):
        raise ApiError(400, "invalid_input", "body: give exactly one of seconds and date")
    if req.date is not None:
        at = req.date if req.date.tzinfo else req.date.replace(tzinfo=UTC)
    else:
        at = datetime.fromtimestamp(ctx.engine.now() + (req.seconds or 0), UTC)
    wp = await ctx.engine.create_datetime_waitpoint(env_id, at, idempotency_key=req.idempotencyKey)
    outcome = await ctx.engine.block(run_id, request.path_params["snapshot_id"], sequence=req.sequence, kind="wait",
                                     key=wp.id, waitpoint_ids=[wp.id], suspend=req.suspend)
    return _block_response(outcome, waitpointId=wp.id)


@operation("Block on a token or run waitpoint", S.Blocked, body=WaitBody, security="workerToken")
async def wait_waitpoint(request: Request) -> Response:
    ctx = ctx_of(request)
    # the run's environment as the group check knows it (remembered at dequeue): no query
    run_id, env_id = await _check_group_env(ctx, await ctx.worker_group(request), request.path_params["run_id"])
    req = await body(request, WaitBody)
    return json_response(await _wait_on(ctx, run_id, env_id, request.path_params["snapshot_id"],
                                        request.path_params["waitpoint_id"], req))


@operation("Block many runs on token or run waitpoints (per-item results)", S.ItemResults, body=BatchWaitBody,
           security="workerToken")
async def wait_waitpoints(request: Request) -> Response:
    """The waits of many runs in one request (a supervisor under load): each item as
    ``…/waitpoints/{waitpointId}/wait`` answers it, or its own error."""
    ctx = ctx_of(request)
    group = await ctx.worker_group(request)
    req = await body(request, BatchWaitBody)
    # A run waits on one thing at a time: a run named again in the same request is refused (409)
    # without reaching the engine, whose batch would otherwise take one statement per repeat, in
    # turn, while every other caller of that batch waits.
    first: dict[str, int] = {}
    repeats = {i for i, item in enumerate(req.items) if first.setdefault(item.runId, i) != i}

    async def one(pair: tuple[int, BatchWaitItem]) -> dict[str, Any]:
        i, item = pair
        if i in repeats:
            raise ApiError(409, "conflict", f"run {item.runId} is named more than once in this request")
        run_id, env_id = await _check_group_env(ctx, group, item.runId)
        return await _wait_on(ctx, run_id, env_id, item.snapshotId, item.waitpointId, item)

    return json_response({"results": await _each(list(enumerate(req.items)), one)})


async def _wait_on(ctx: ApiContext, run_id: str, env_id: str, snapshot_id: str, waitpoint_id: str,
                   req: WaitBody) -> dict[str, Any]:
    snapshot_id = await _snapshot_of(ctx, run_id, snapshot_id)
    if not looks_like_id(waitpoint_id, "run") and req.kind not in ("child", "batch"):
        # a token, a date, another batch's waitpoint: the block statement looks it up (its
        # environment, the key of its entry), no query of its own
        outcome = await ctx.engine.block(run_id, snapshot_id, sequence=req.sequence, kind=req.kind, key=waitpoint_id,
                                         waitpoint_ids=[waitpoint_id], suspend=req.suspend, env_id=env_id)
        return _blocked(outcome, waitpointId=waitpoint_id)
    entry = None
    if req.kind in ("child", "batch"):  # a replay re-blocking on its children: keep the journaled ids
        entries = (await ctx.engine.journal(run_id, req.sequence)).entries
        entry = entries[0].result if entries and entries[0].sequence == req.sequence else None
    for tries_left in range(_LOOK_UPS - 1, -1, -1):
        if looks_like_id(waitpoint_id, "run"):  # wait on any run: its RUN waitpoint (on itself or an
            # ancestor: one completed with a WAIT_DEADLOCK error, the wait over at once)
            wp: Waitpoint | None = await ctx.engine.run_waitpoint(env_id, waitpoint_id, waiter_id=run_id)
        else:
            wp = await ctx.engine.get_waitpoint(waitpoint_id, env_id)
        if wp is None:
            raise ApiError(404, "not_found", "waitpoint not found")
        if req.kind == "batch" and (wp.type != "BATCH" or not is_batch_entry(entry)):
            # only a replay waits on a batch this way: its journal entry names the batch's runs, which
            # every later read of the journal lists (an entry without them would break the journal)
            raise ApiError(400, "invalid_input", "kind batch: waits only on the batch the run's journal entry at this "
                                                 "sequence holds (batches are triggered and waited on with /trigger)")
        try:
            outcome = await ctx.engine.block(run_id, snapshot_id, sequence=req.sequence, kind=req.kind,
                                             key=wp.completed_by_batch_id or wp.completed_by_run_id or wp.id,
                                             waitpoint_ids=[wp.id], result=entry, suspend=req.suspend)
        except NotFoundError as exc:
            # Retention deleted the (completed, old) waitpoint between the look-up and the block,
            # which wrote nothing: looked up again, a run's is made again (completed at once if the
            # run has finished), another is gone (404)
            if exc.kind != "waitpoint" or exc.ident != wp.id or not tries_left:
                raise
            continue
        return _blocked(outcome, waitpointId=wp.id)
    raise AssertionError("unreachable")


#: how many times a wait looks its waitpoint up when retention deleted the one it found before it blocked
_LOOK_UPS = 3


@operation("Trigger children and wait for them (RUN or BATCH waitpoint)", S.Blocked, body=ChildTriggerBody,
           security="workerToken")
async def trigger_children(request: Request) -> Response:
    """Trigger children of the run and block it until they finish (triggerAndWait and
    batchTriggerAndWait): one journal entry, one waitpoint, one insert for all children."""
    from run_engine.api.public import trigger_request  # the public API's option handling

    ctx = ctx_of(request)
    run_id = await _group_run_id(ctx, request)
    req = await body(request, ChildTriggerBody)
    if not req.batch and len(req.items) != 1:
        raise ApiError(400, "invalid_input", "items: exactly one item unless batch is true")
    run = await ctx.engine.get_run(run_id)
    assert run is not None
    auth = EnvAuth(run.env_id, "", "", run.worker_group_id, run_id=run.id)
    for i, item in enumerate(req.items):
        if item.options is not None and item.options.debounce is not None:
            raise ApiError(400, "invalid_input", f"items.{i}.options.debounce: triggerAndWait does not debounce")
    payloads = await decode_payloads([(item.payload, item.options.payloadType if item.options else None,
                                       f"items.{i}.payload") for i, item in enumerate(req.items)],
                                     ctx.engine.settings.max_payload_bytes)
    requests = [trigger_request(ctx, auth, item.task, payload, item.options, f"items.{i}")
                for i, (item, payload) in enumerate(zip(req.items, payloads, strict=True))]
    run_ids, outcome = await ctx.engine.trigger_and_wait(run_id, request.path_params["snapshot_id"], req.sequence,
                                                         requests, batch=req.batch, suspend=req.suspend)
    return _block_response(outcome, runIds=run_ids)


@operation("Checkpoint a blocked run (REPLAY) and release its concurrency", S.SnapshotOut, security="workerToken")
async def suspend(request: Request) -> Response:
    ctx = ctx_of(request)
    run_id = await _group_run_id(ctx, request)
    snapshot = await ctx.engine.suspend(run_id, request.path_params["snapshot_id"])
    return json_response({"snapshot": snapshot_object(snapshot)})


@operation("Journal a step result", S.Ok, body=JournalBody, security="workerToken")
async def append_journal(request: Request) -> Response:
    ctx = ctx_of(request)
    run_id = await _group_run_id(ctx, request)
    req = await body(request, JournalBody)
    ctx.check_size(req.result, "result")
    await ctx.engine.append_journal(run_id, req.snapshotId, req.sequence, req.kind, req.key, req.result)
    return json_response({"ok": True})


@operation("The run's journal, waits resolved", S.JournalOut,
           query=(Query("from", {"type": "integer", "minimum": 0}),), security="workerToken")
async def get_journal(request: Request) -> Response:
    ctx = ctx_of(request)
    run_id = await _group_run_id(ctx, request)
    raw = request.query_params.get("from", "0")
    if not is_number(raw):
        raise ApiError(400, "invalid_input", "from: must be a non-negative integer")
    page = await ctx.engine.resolved_journal(run_id, int(raw))
    return json_response({"journal": page.entries, **({"next": page.next} if page.next is not None else {})})


ROUTES = [
    Route(f"{PREFIX}/connect", connect, methods=["POST"]),
    Route(f"{PREFIX}/heartbeat", heartbeat, methods=["POST"]),
    Route(f"{PREFIX}/dequeue", dequeue, methods=["POST"]),
    Route(f"{PREFIX}/attempts/start", start_attempts, methods=["POST"]),
    Route(f"{PREFIX}/attempts/complete", complete_attempts, methods=["POST"]),
    Route(f"{PREFIX}/waits", wait_waitpoints, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/latest", latest_snapshot, methods=["GET"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/attempts/start", start_attempt, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/attempts/complete", complete_attempt, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/heartbeat", run_heartbeat, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/continue", start_attempt, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/suspend", suspend, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/wait/duration", wait_duration, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/waitpoints/{{waitpoint_id}}/wait", wait_waitpoint,
          methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/snapshots/{{snapshot_id}}/trigger", trigger_children, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/journal", append_journal, methods=["POST"]),
    Route(f"{PREFIX}/runs/{{run_id}}/journal", get_journal, methods=["GET"]),
]
