"""The dashboard's pages (GET): what an environment's runs, queues, dead letters, batches, tokens,
schedules and workers look like now. Each reads through the engine facade, scoped to the signed-in
environment: an id of another environment is "not found", never shown."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import Response

from run_engine.api.http import ApiError
from run_engine.api.inputs import looks_like_id
from run_engine.api.public import queue_objects
from run_engine.api.serialize import explanation_object, run_object
from run_engine.api.tokens import token_status
from run_engine.dashboard.core import Dash, page, render
from run_engine.engine import RunRow, Snapshot
from run_engine.statuses import FINAL_RUN_STATUSES, RunStatus

PAGE_SIZE = 25
#: statuses in which a run can still be explained (it has not started)
NOT_STARTED = {RunStatus.QUEUED, RunStatus.DELAYED, RunStatus.PENDING_VERSION}
FILTERS = ("status", "task", "tag", "queue", "batch", "from", "to")
STALE_AFTER_S = 60  # a worker instance not heard of for this long is shown as gone


def _text(request: Request, name: str, limit: int = 256) -> str:
    value = request.query_params.get(name, "").strip()
    if len(value) > limit:
        raise ApiError(400, "invalid_input", f"{name}: at most {limit} characters")
    return value


def _day(value: str, name: str, *, end: bool) -> datetime | None:
    """A date (``YYYY-MM-DD``) or date-time from the filter form, in UTC; ``to`` takes the whole day."""
    if not value:
        return None
    try:
        if len(value) == 10:
            day = date.fromisoformat(value)
            when = datetime(day.year, day.month, day.day, tzinfo=UTC)
            return when.replace(hour=23, minute=59, second=59, microsecond=999999) if end else when
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    except ValueError:
        raise ApiError(400, "invalid_input", f"{name}: not a date (YYYY-MM-DD)") from None


async def _deployed_tasks(dash: Dash) -> list[str]:
    return sorted({t for w in await dash.ctx.engine.workers(dash.env.id) for t in w.tasks})


@page
async def runs(request: Request, dash: Dash) -> Response:
    """Runs, newest first, filtered; cursor pages; the table follows changes live."""
    f = {name: _text(request, name) for name in FILTERS}
    if f["status"] and f["status"] not in RunStatus.__members__:
        raise ApiError(400, "invalid_input", f"status: unknown status {f['status']!r}")
    after = None
    if cursor := _text(request, "after", 600):
        try:
            ts, run_id = cursor.split("|", 1)
            after = (datetime.fromisoformat(ts), run_id)
        except ValueError:
            raise ApiError(400, "invalid_input", "after: not a cursor of this page") from None
    created_from, created_to = _day(f["from"], "from", end=False), _day(f["to"], "to", end=True)
    async with dash.ctx.costly_reads.turn(dash.env.id):  # the API's run list's turns (a tag filter may walk far)
        found = await dash.ctx.engine.list_runs(
            dash.env.id, statuses=[f["status"]] if f["status"] else [], tasks=[f["task"]] if f["task"] else [],
            tags=[f["tag"]] if f["tag"] else [], queues=[f["queue"]] if f["queue"] else [],
            batches=[f["batch"]] if f["batch"] else [], limit=PAGE_SIZE + 1, after=after,
            created_from=created_from, created_to=created_to,
            light=True)  # the table shows no payload, output or metadata
    rows, more = found[:PAGE_SIZE], len(found) > PAGE_SIZE
    given = {k: v for k, v in f.items() if v}
    next_url = ("/dashboard/runs?" + urlencode({**given, "after": f"{rows[-1].created_at.isoformat()}|{rows[-1].id}"})
                if more and rows else None)
    here = "/dashboard/runs" + ("?" + urlencode({**given, **({"after": cursor} if cursor else {})}) if given or cursor
                                else "")
    context = {"title": "Runs", "runs": [run_object(r) for r in rows], "filters": f, "next_url": next_url,
               "first_url": "/dashboard/runs?" + urlencode(given) if cursor else None,
               "here": here, "statuses": list(RunStatus.__members__)}
    if request.query_params.get("partial") == "table":
        return render(request, "_runs_table.html", context, dash=dash)
    context["tasks"] = await _deployed_tasks(dash)
    return render(request, "runs.html", context, dash=dash)


def _attempts(snapshots: list[Snapshot]) -> list[dict[str, Any]]:
    """One entry per attempt: when it started and ended, and the error it ended with."""
    attempts: dict[int, dict[str, Any]] = {}
    for s in snapshots:
        if s.attempt_number <= 0:
            continue
        a = attempts.setdefault(s.attempt_number, {"number": s.attempt_number, "started": s.created_at,
                                                   "ended": None, "error": None, "worker": s.worker_id})
        a["ended"] = s.created_at
        if s.error:
            a["error"] = s.error
    return list(attempts.values())


async def _run_context(dash: Dash, run: RunRow) -> dict[str, Any]:
    engine = dash.ctx.engine
    snapshots = await engine.snapshots(run.id)
    status = RunStatus(run.status)
    explanation = None
    if status in NOT_STARTED:
        explanation = explanation_object(await engine.explain(dash.env.id, run.id))
    return {
        "title": f"Run {run.id}", "run": run_object(run), "row": run, "final": status in FINAL_RUN_STATUSES,
        "delayed": status == RunStatus.DELAYED, "snapshots": snapshots[-500:], "hidden": max(0, len(snapshots) - 500),
        # its first page (what one read of a journal holds at most): the entries after it are counted
        "attempts": _attempts(snapshots), "journal": (journal := await engine.journal(run.id)).entries,
        "journal_more": journal.next is not None,
        "blocking": await engine.blocking_waitpoints(run.id), "children": await engine.child_runs(run.id),
        "explanation": explanation,
    }


@page
async def run_detail(request: Request, dash: Dash) -> Response:
    run_id = request.path_params["run_id"]
    run = await dash.ctx.engine.get_run(run_id, dash.env.id) if looks_like_id(run_id, "run") else None
    if run is None:
        raise ApiError(404, "not_found", "run not found")
    context = await _run_context(dash, run)
    template = "_run_detail.html" if request.query_params.get("partial") == "detail" else "run.html"
    return render(request, template, context, dash=dash)


@page
async def queues(request: Request, dash: Dash) -> Response:
    async with dash.ctx.costly_reads.turn(dash.env.id):  # the API's queue list's turns (10,000 queues)
        rows = (await dash.ctx.engine.list_queues(dash.env.id))[:500]
        shown = await queue_objects(dash.ctx, dash.env.id, rows)
    return render(request, "queues.html", {"title": "Queues", "queues": shown}, dash=dash)


@page
async def dlq(request: Request, dash: Dash) -> Response:
    task, queue = _text(request, "task"), _text(request, "queue")
    after = _text(request, "after", 256) or None
    dead, following = await dash.ctx.engine.list_dead(dash.env.id, 50, after, {task} if task else (),
                                                      {queue} if queue else ())
    given = {k: v for k, v in (("task", task), ("queue", queue)) if v}
    next_url = "/dashboard/dlq?" + urlencode({**given, "after": following}) if following else None
    redrive_after = _text(request, "redrive_after", 256)  # where a redrive of all that stopped goes on
    entries = [{"run": run_object(d.run), "reason": d.entry.reason, "deliveries": d.entry.deliveries,
                "dead_at": datetime.fromtimestamp(d.entry.dead_at_ms / 1000, UTC)} for d in dead]
    return render(request, "dlq.html", {"title": "Dead letters", "entries": entries, "task": task, "queue": queue,
                                        "next_url": next_url, "redrive_after": redrive_after}, dash=dash)


@page
async def batches(request: Request, dash: Dash) -> Response:
    async with dash.ctx.costly_reads.turn(dash.env.id):  # counts every run of the environment's batches
        rows = await dash.ctx.engine.list_batches(dash.env.id)
    return render(request, "batches.html", {"title": "Batches", "batches": rows}, dash=dash)


@page
async def tokens(request: Request, dash: Dash) -> Response:
    status = _text(request, "status")
    if status not in ("", "WAITING", "COMPLETED"):
        raise ApiError(400, "invalid_input", "status: WAITING or COMPLETED")
    statuses = {"WAITING": ["PENDING"], "COMPLETED": ["COMPLETED"]}.get(status, [])
    async with dash.ctx.costly_reads.turn(dash.env.id):  # the API's token list's turns
        rows, _ = await dash.ctx.engine.list_tokens(dash.env.id, statuses=statuses, limit=100)
    return render(request, "tokens.html", {"title": "Tokens", "status": status,
                                           "tokens": [(w, token_status(w)) for w in rows]}, dash=dash)


@page
async def schedules(request: Request, dash: Dash) -> Response:
    rows = await dash.ctx.engine.list_schedules(dash.env.id, 200, None)
    return render(request, "schedules.html", {"title": "Schedules", "schedules": rows}, dash=dash)


@page
async def workers(request: Request, dash: Dash) -> Response:
    now = datetime.now(UTC)
    groups = []
    for w in await dash.ctx.engine.workers(dash.env.id):
        instances = [{**i, "live": (now - datetime.fromisoformat(i["lastHeartbeatAt"])).total_seconds()
                      < STALE_AFTER_S} for i in w.instances]
        groups.append({"group": w, "instances": instances})
    return render(request, "workers.html", {"title": "Workers", "groups": groups}, dash=dash)
