"""The catalogue of engine jobs: every kind, how its fixed id is built and its payload.

A job's id is fixed by what it is about (a run, a snapshot, an attempt, a waitpoint), so that
scheduling it again replaces it (debouncing) and the reconciler can ask Redis whether it is there.
Each builder returns a :data:`JobSpec` ready for ``SystemResources.change_jobs``; the engine maps
each kind to its handler (``RunEngine``). The checks of held runs (heartbeat timeouts, max
durations: no more than the runs held, which concurrency limits bound) and the sweeper are in the
default lane, claimed first; what a tenant's triggers make by the million (delays, TTLs, waitpoint
dates and timeouts, bulk actions) is in its environment's lane, and the lanes take turns."""

from __future__ import annotations

from typing import Any

from run_engine.jobs import JobSpec

__all__ = ["JobSpec"]

HEARTBEAT = "heartbeat_timeout"  # a held run's heartbeat timed out (payload: run_id, snapshot_id)
MAX_DURATION = "max_duration"  # an attempt ran past its task's maxDuration (run_id, attempt)
DELAYED = "enqueue_delayed"  # a DELAYED run is due (run_id)
TTL = "expire_ttl"  # a run not started within its TTL expires (run_id)
WAITPOINT_DATETIME = "waitpoint_datetime"  # a DATETIME waitpoint is due (waitpoint_id)
WAITPOINT_TIMEOUT = "waitpoint_timeout"  # a waitpoint with a timeout timed out (waitpoint_id)
WAITPOINT_SWEEP = "waitpoint_sweep"  # the sweeper: RUN/BATCH waitpoints whose completion was lost
SWEEP_ID = "sweep.waitpoints"
BULK_ACTION = "bulk_action"  # the next page of a bulk cancel or replay (bulk_id)
CONTINUE_BLOCKED = "continue_blocked"  # the next page of the runs completed waitpoints unblocked
# the next page of the PENDING_VERSION runs a registered deployment can run (deployment_id, env_id,
# worker_group_id): a connect promotes the first ones itself, a job the rest
PROMOTE_PENDING = "promote_pending"
# a cancel's way down the runs its run waits on, taken up again should the cancel stop part way
# (run_id): armed before the cancel, gone once it reached their end
CANCEL_CASCADE = "cancel_cascade"

KINDS = (HEARTBEAT, MAX_DURATION, DELAYED, TTL, WAITPOINT_DATETIME, WAITPOINT_TIMEOUT, WAITPOINT_SWEEP, BULK_ACTION,
         CONTINUE_BLOCKED, PROMOTE_PENDING, CANCEL_CASCADE)


def heartbeat_id(run_id: str, snapshot_id: str) -> str:
    return f"hb.{run_id}.{snapshot_id}"


def heartbeat(run_id: str, snapshot_id: str, at: float, *, graced: bool = False) -> JobSpec:
    """``graced``: armed again once already because it came due while no heartbeat could be heard
    (a heartbeat moves the job, never this mark: a snapshot's timeout is graced once at most)."""
    payload: dict[str, Any] = {"run_id": run_id, "snapshot_id": snapshot_id}
    if graced:
        payload["graced"] = True
    return heartbeat_id(run_id, snapshot_id), HEARTBEAT, payload, at, ""


def max_duration_id(run_id: str, attempt: int) -> str:
    return f"maxdur.{run_id}.{attempt}"


def max_duration(run_id: str, attempt: int, at: float) -> JobSpec:
    return max_duration_id(run_id, attempt), MAX_DURATION, {"run_id": run_id, "attempt": attempt}, at, ""


def delayed_id(run_id: str) -> str:
    return f"delay.{run_id}"


def delayed(run_id: str, env_id: str, at: float) -> JobSpec:
    return delayed_id(run_id), DELAYED, {"run_id": run_id}, at, env_id


def ttl_id(run_id: str) -> str:
    return f"ttl.{run_id}"


def ttl(run_id: str, env_id: str, at: float) -> JobSpec:
    return ttl_id(run_id), TTL, {"run_id": run_id}, at, env_id


def waitpoint_datetime_id(waitpoint_id: str) -> str:
    return f"wpdt.{waitpoint_id}"


def waitpoint_datetime(waitpoint_id: str, env_id: str, at: float) -> JobSpec:
    return waitpoint_datetime_id(waitpoint_id), WAITPOINT_DATETIME, {"waitpoint_id": waitpoint_id}, at, env_id


def waitpoint_timeout_id(waitpoint_id: str) -> str:
    return f"wpto.{waitpoint_id}"


def waitpoint_timeout(waitpoint_id: str, env_id: str, at: float) -> JobSpec:
    return waitpoint_timeout_id(waitpoint_id), WAITPOINT_TIMEOUT, {"waitpoint_id": waitpoint_id}, at, env_id


def sweep(at: float, runs_after: str = "", waitpoints_after: str = "") -> JobSpec:
    """The sweeper's next pass, going on after the ids its last pass walked to ('': the start)."""
    return SWEEP_ID, WAITPOINT_SWEEP, {"runs_after": runs_after, "waitpoints_after": waitpoints_after}, at, ""


def bulk_action_id(bulk_id: str) -> str:
    return f"bulk.{bulk_id}"


def bulk_action(bulk_id: str, env_id: str, at: float) -> JobSpec:
    return bulk_action_id(bulk_id), BULK_ACTION, {"bulk_id": bulk_id}, at, env_id


def cancel_cascade_id(run_id: str) -> str:
    return f"cancel.{run_id}"


def cancel_cascade(run_id: str, env_id: str, at: float) -> JobSpec:
    return cancel_cascade_id(run_id), CANCEL_CASCADE, {"run_id": run_id}, at, env_id


def continue_blocked(waitpoint_ids: list[str], after: str, env_id: str, at: float) -> JobSpec:
    return (f"continue.{waitpoint_ids[0]}", CONTINUE_BLOCKED, {"waitpoint_ids": waitpoint_ids, "after": after},
            at, env_id)


def promote_pending_id(deployment_id: str) -> str:
    return f"promote.{deployment_id}"


def promote_pending(deployment_id: str, env_id: str, worker_group_id: str, at: float) -> JobSpec:
    return (promote_pending_id(deployment_id), PROMOTE_PENDING,
            {"deployment_id": deployment_id, "env_id": env_id, "worker_group_id": worker_group_id}, at, env_id)
