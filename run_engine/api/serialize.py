"""The API's run object (API.md), a superset of Trigger.dev's RetrieveRunResponse."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from run_engine.engine import Explanation, RunRow, Snapshot
from run_engine.statuses import FINAL_RUN_STATUSES, RunStatus

QUEUED = {RunStatus.QUEUED, RunStatus.PENDING_VERSION, RunStatus.DELAYED}
EXECUTING = {RunStatus.EXECUTING, RunStatus.DEQUEUED}
FAILED = {RunStatus.FAILED, RunStatus.CRASHED, RunStatus.SYSTEM_FAILURE, RunStatus.EXPIRED, RunStatus.TIMED_OUT}


#: fields of the run object that are left out when they have no value (API.md: never null)
_OPTIONAL = ("concurrencyKey", "idempotencyKey", "ttl", "delayedUntil", "expiredAt", "startedAt", "finishedAt",
             "batchId", "version", "maxAttempts", "maxDuration", "machine")


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def duration(seconds: int | None) -> str | None:
    """``600`` → ``"10m"``: the largest unit that divides it exactly (Trigger.dev's ttl form)."""
    if seconds is None:
        return None
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def run_object(run: RunRow, *, children: list[str] | None = None) -> dict[str, Any]:
    status = RunStatus(run.status)
    end = run.finished_at
    duration_ms = int((end - run.started_at).total_seconds() * 1000) if end and run.started_at else 0
    obj: dict[str, Any] = {
        "id": run.id,
        "taskIdentifier": run.task_id,
        "status": status.value,
        "isQueued": status in QUEUED,
        "isExecuting": status in EXECUTING,
        "isWaiting": status == RunStatus.WAITING,
        "isCompleted": status in FINAL_RUN_STATUSES,
        "isSuccess": status == RunStatus.COMPLETED,
        "isFailed": status in FAILED,
        "isCancelled": status == RunStatus.CANCELED,
        "isTest": False,
        "payload": run.payload,
        "payloadType": run.payload_type,
        "attemptCount": run.attempt_number,
        "tags": run.tags,
        "metadata": run.metadata if run.metadata is not None else {},
        "queue": run.queue,
        "concurrencyKey": run.concurrency_key,
        "priority": run.priority_ms / 1000,
        "idempotencyKey": run.idempotency_key,
        "ttl": duration(run.ttl_s),
        "delayedUntil": iso(run.delay_until),
        "expiredAt": iso(run.finished_at) if status == RunStatus.EXPIRED else None,
        "createdAt": iso(run.created_at),
        "updatedAt": iso(run.updated_at),
        "startedAt": iso(run.started_at),
        "finishedAt": iso(run.finished_at),
        "durationMs": duration_ms,
        "costInCents": 0,
        "baseCostInCents": 0,
        "batchId": run.batch_id,
        "depth": run.depth,
        "triggerFunction": run.trigger_function,
        "relatedRuns": {"children": children or [],
                        **({"root": run.root_run_id} if run.root_run_id else {}),
                        **({"parent": run.parent_run_id} if run.parent_run_id else {})},
        "version": None,
        "maxAttempts": run.max_attempts,
        "maxDuration": run.max_duration_s,
        "machine": run.machine,
    }
    for key in _OPTIONAL:
        if obj[key] is None:
            del obj[key]
    if status == RunStatus.COMPLETED:
        obj["output"] = run.output
        if run.output_type is not None:
            obj["outputType"] = run.output_type
    if run.error is not None and status in FAILED | {RunStatus.CANCELED} or (run.error and status in QUEUED):
        obj["error"] = _error(run.error)
    return obj


def pagination(next_cursor: str | None) -> dict[str, str]:
    """``{"next": cursor}``, or ``{}`` on the last page (API.md: left out, never null)."""
    return {"next": next_cursor} if next_cursor else {}


def _error(error: dict[str, Any]) -> dict[str, Any]:
    out = {"type": error.get("type", "BUILT_IN_ERROR"), "message": error.get("message", "")}
    for key in ("name", "stackTrace", "code"):
        if error.get(key):
            out[key] = error[key]
    return out


def snapshot_object(snapshot: Snapshot) -> dict[str, Any]:
    return {
        "id": snapshot.id,
        "runId": snapshot.run_id,
        "executionStatus": snapshot.engine_status,
        "runStatus": snapshot.run_status,
        "attemptNumber": snapshot.attempt_number,
        "description": snapshot.description,
        "previousSnapshotId": snapshot.previous_snapshot_id,
        "checkpointId": snapshot.checkpoint_id,
        "completedWaitpointIds": snapshot.completed_waitpoint_ids,
        "createdAt": iso(snapshot.created_at),
    }


_FACTS = {"concurrency_key": "concurrencyKey"}  # a reason's facts under their API names


def explanation_object(e: Explanation) -> dict[str, Any]:
    """``GET /api/v1/runs/{id}/explain``: each reason is its code, its facts, its message."""
    reasons = [{"code": r.code, **{_FACTS.get(k, k): iso(v) if isinstance(v, datetime) else v
                                   for k, v in r.facts.items()}, "message": r.message} for r in e.reasons]
    return {"id": e.run_id, "status": e.status, "executionStatus": e.execution_status, "reasons": reasons,
            "summary": e.summary}

