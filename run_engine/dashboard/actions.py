"""What the dashboard's buttons and forms do (POST, CSRF-checked, answered with a redirect): the
same engine calls, checks and limits as the public API, scoped to the signed-in environment."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import Response

from run_engine.api.http import ApiError, DecodedPayload, decode_payload
from run_engine.api.inputs import is_number, looks_like_id
from run_engine.api.models import parse_when
from run_engine.api.public import trigger_request
from run_engine.api.tokens import complete
from run_engine.dashboard.core import Dash, action, redirect
from run_engine.engine import RunRow, TaskQueue
from run_engine.errors import InvalidTransitionError


async def _json(dash: Dash, form: dict[str, str], name: str) -> Any:
    """A form field's JSON, as the API takes a payload's JSON text: 413 over the payload limit or
    with too many objects and arrays (counted before decoding), 400 when not JSON or unstorable;
    decoded and walked off the event loop when large (a 3 MiB text of a million empty lists took
    the loop two seconds)."""
    raw = form.get(name, "").strip()
    if not raw:
        return None
    decoded = await decode_payload(raw, "application/json", name, dash.ctx.engine.settings.max_payload_bytes)
    return decoded.value if isinstance(decoded, DecodedPayload) else decoded


async def _run(dash: Dash, request: Request) -> RunRow:
    run_id = request.path_params["run_id"]
    run = await dash.ctx.engine.get_run(run_id, dash.env.id) if looks_like_id(run_id, "run") else None
    if run is None:
        raise ApiError(404, "not_found", "run not found")
    return run


@action
async def trigger(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    """A test run of a deployed task with a JSON payload."""
    task = form.get("task", "").strip()
    if not task or len(task) > 128:
        raise ApiError(400, "invalid_input", "task: choose a task (1..128 characters)")
    req = trigger_request(dash.ctx, dash.auth, task, await _json(dash, form, "payload"), None, "body")
    run = await dash.ctx.engine.trigger(req)
    return redirect(request, f"/dashboard/runs/{run.id}", f"Triggered {task}: {run.id}")


@action
async def cancel(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    run = await _run(dash, request)
    status = await dash.ctx.engine.cancel(run.id)
    return redirect(request, f"/dashboard/runs/{run.id}", f"Run {run.id} is {status.value}")


@action
async def replay(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    run = await _run(dash, request)
    new = await dash.ctx.engine.replay(run)
    return redirect(request, f"/dashboard/runs/{new.id}", f"Replayed {run.id} as {new.id}")


@action
async def reschedule(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    run = await _run(dash, request)
    try:
        when = parse_when(form.get("delay", "").strip(), dash.ctx.engine.now())
    except ValueError as exc:
        raise ApiError(400, "invalid_input", f"delay: {exc}") from None
    try:
        await dash.ctx.engine.reschedule(dash.env.id, run.id, when)
    except InvalidTransitionError:
        raise ApiError(422, "not_delayed", f"run {run.id} is {run.status}: only a DELAYED run can be "
                                           "rescheduled") from None
    return redirect(request, f"/dashboard/runs/{run.id}", f"Rescheduled to {when.isoformat()}")


async def _queue(dash: Dash, form: dict[str, str]) -> TaskQueue:
    name = form.get("queue", "")
    row = await dash.ctx.engine.task_queue(dash.env.id, name) if 0 < len(name) <= 256 else None
    if row is None:
        raise ApiError(404, "not_found", "queue not found")
    return row


@action
async def pause_queue(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    action = form.get("action")
    if action not in ("pause", "resume"):  # a form with none (or another) did not mean to resume
        raise ApiError(400, "invalid_input", "action: pause or resume")
    row = await _queue(dash, form)
    if action == "pause":
        await dash.ctx.engine.pause_queue(dash.env.id, row.name)
        return redirect(request, "/dashboard/queues", f"Paused {row.name}")
    await dash.ctx.engine.resume_queue(dash.env.id, row.name)
    return redirect(request, "/dashboard/queues", f"Resumed {row.name}")


@action
async def queue_concurrency(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    """Override the queue's concurrency limit, or (an empty value) go back to the deployed one."""
    row = await _queue(dash, form)
    raw = form.get("limit", "").strip()
    if raw and not (is_number(raw) and int(raw) <= 100_000):
        raise ApiError(400, "invalid_input", "limit: a whole number 0..100000, or empty to reset")
    await dash.ctx.engine.set_queue_concurrency_override(dash.env.id, row.name, int(raw) if raw else None)
    return redirect(request, "/dashboard/queues", f"{row.name}: limit {'set to ' + raw if raw else 'reset'}")


@action
async def redrive(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    run = await _run(dash, request)
    try:
        await dash.ctx.engine.redrive(dash.env.id, run.id)
    except InvalidTransitionError:
        raise ApiError(409, "not_dead_lettered", "the run is not in the dead-letter queue") from None
    return redirect(request, "/dashboard/dlq", f"Redrove {run.id}")


@action
async def redrive_all(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    task, queue = form.get("task", "").strip(), form.get("queue", "").strip()
    if len(task) > 256 or len(queue) > 256:
        raise ApiError(400, "invalid_input", "task, queue: at most 256 characters")
    after = form.get("after", "").strip() or None
    if after is not None and len(after) > 256:
        raise ApiError(400, "invalid_input", "after: at most 256 characters")
    count, more = await dash.ctx.engine.redrive_all(dash.env.id, [task] if task else (), [queue] if queue else (),
                                                    after)
    runs = f"Redrove {count} run{'s' if count != 1 else ''}"
    if not more:
        return redirect(request, "/dashboard/dlq", runs)
    # a bounded part of a DLQ of millions a press: the page's button goes on from where this stopped
    given = {k: v for k, v in (("task", task), ("queue", queue)) if v}
    return redirect(request, "/dashboard/dlq?" + urlencode({**given, "redrive_after": more}),
                    f"{runs}; more remain: press Redrive all again to go on")


@action
async def schedule_active(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    schedule_id = request.path_params["schedule_id"]
    if not looks_like_id(schedule_id, "sched"):
        raise ApiError(404, "not_found", "schedule not found")
    action = form.get("action")
    if action not in ("activate", "deactivate"):
        raise ApiError(400, "invalid_input", "action: activate or deactivate")
    active = action == "activate"
    row = await dash.ctx.engine.set_schedule_active(dash.env.id, schedule_id, active)
    done = "activated" if active else "deactivated"
    return redirect(request, "/dashboard/schedules", f"{row.task_id} ({row.cron}) {done}")


@action
async def complete_token(request: Request, dash: Dash, form: dict[str, str]) -> Response:
    waitpoint_id = request.path_params["waitpoint_id"]
    wp = (await dash.ctx.engine.get_waitpoint(waitpoint_id, dash.env.id)
          if looks_like_id(waitpoint_id, "waitpoint") else None)
    if wp is None or wp.type != "MANUAL":
        raise ApiError(404, "not_found", "waitpoint token not found")
    await complete(dash.ctx, wp, await _json(dash, form, "output"))
    return redirect(request, "/dashboard/tokens", f"Completed {wp.id}")
