"""Execution statuses (on snapshots) and the public run statuses they show (DESIGN.md §5)."""

from __future__ import annotations

from enum import StrEnum


class ExecutionStatus(StrEnum):
    RUN_CREATED = "RUN_CREATED"
    DELAYED = "DELAYED"
    PENDING_VERSION = "PENDING_VERSION"
    QUEUED = "QUEUED"
    PENDING_EXECUTING = "PENDING_EXECUTING"
    EXECUTING = "EXECUTING"
    EXECUTING_WITH_WAITPOINTS = "EXECUTING_WITH_WAITPOINTS"
    SUSPENDED = "SUSPENDED"
    QUEUED_EXECUTING = "QUEUED_EXECUTING"
    PENDING_CANCEL = "PENDING_CANCEL"
    FINISHED = "FINISHED"


class RunStatus(StrEnum):
    PENDING_VERSION = "PENDING_VERSION"
    DELAYED = "DELAYED"
    QUEUED = "QUEUED"
    DEQUEUED = "DEQUEUED"
    EXECUTING = "EXECUTING"
    WAITING = "WAITING"
    COMPLETED = "COMPLETED"
    CANCELED = "CANCELED"
    FAILED = "FAILED"
    CRASHED = "CRASHED"
    SYSTEM_FAILURE = "SYSTEM_FAILURE"
    EXPIRED = "EXPIRED"
    TIMED_OUT = "TIMED_OUT"


E = ExecutionStatus

#: public status shown for each non-terminal execution status
PUBLIC_STATUS: dict[ExecutionStatus, RunStatus] = {
    E.RUN_CREATED: RunStatus.QUEUED,
    E.DELAYED: RunStatus.DELAYED,
    E.PENDING_VERSION: RunStatus.PENDING_VERSION,
    E.QUEUED: RunStatus.QUEUED,
    E.PENDING_EXECUTING: RunStatus.DEQUEUED,
    E.EXECUTING: RunStatus.EXECUTING,
    E.EXECUTING_WITH_WAITPOINTS: RunStatus.WAITING,
    E.SUSPENDED: RunStatus.WAITING,
    E.QUEUED_EXECUTING: RunStatus.QUEUED,
    E.PENDING_CANCEL: RunStatus.EXECUTING,
}

FINAL_RUN_STATUSES = frozenset(
    {
        RunStatus.COMPLETED,
        RunStatus.CANCELED,
        RunStatus.FAILED,
        RunStatus.CRASHED,
        RunStatus.SYSTEM_FAILURE,
        RunStatus.EXPIRED,
        RunStatus.TIMED_OUT,
    }
)

DEQUEUEABLE = frozenset({E.QUEUED, E.QUEUED_EXECUTING})
EXECUTING = frozenset({E.EXECUTING, E.EXECUTING_WITH_WAITPOINTS})
#: statuses in which the run sits in the run queue (or its delayed set)
IN_QUEUE = frozenset({E.QUEUED, E.QUEUED_EXECUTING})
#: statuses whose snapshot arms a heartbeat-timeout job
HEARTBEAT_STATUSES = frozenset(
    {E.PENDING_EXECUTING, E.EXECUTING, E.EXECUTING_WITH_WAITPOINTS, E.PENDING_CANCEL}
)
#: statuses of a run handed out to a worker (not yet given back): its queue message is held and
#: holds its slots until the run's own ack, nack, release or enqueue
HANDED_OUT = HEARTBEAT_STATUSES
#: statuses a cancel finishes at once (nothing is running)
CANCEL_AT_ONCE = frozenset(
    {E.RUN_CREATED, E.DELAYED, E.PENDING_VERSION, E.QUEUED, E.QUEUED_EXECUTING, E.SUSPENDED, E.PENDING_EXECUTING}
)
