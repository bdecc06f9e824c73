"""Errors of the run engine.

Hierarchy::

    RunEngineError
    ├── NotFoundError              unknown id (or one of another environment)
    ├── StaleSnapshotError         the caller's snapshot id is no longer the latest (HTTP 409)
    ├── InvalidTransitionError     the run is in a state where the operation is impossible (409/422)
    ├── DuplicateExecutionError    a journal sequence another execution of the run already wrote (409)
    ├── ConflictError              the request contradicts what exists (HTTP 409)
    ├── QueueFullError             the environment's queue is at its maximum length (HTTP 429)
    ├── LockTimeoutError           the run lock could not be taken in time
    ├── ReadTimeoutError           a costly read went past its statement timeout (HTTP 503)
    ├── ValidationError            bad input (HTTP 400), names the field
    ├── TooLargeError              what the input would make is past a size limit (HTTP 413), names the field
    └── ConfigurationError         bad settings, missing embedded server, …

Decisions (retry, finish, requeue) are returned as data, never raised.
"""

from __future__ import annotations


class RunEngineError(Exception):
    code = "internal_error"


class NotFoundError(RunEngineError):
    code = "not_found"

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} not found")
        self.kind = kind
        self.ident = ident


class StaleSnapshotError(RunEngineError):
    code = "stale_snapshot"

    def __init__(self, run_id: str, snapshot_id: str, latest_snapshot_id: str, latest_status: str) -> None:
        super().__init__(
            f"snapshot {snapshot_id} of run {run_id} is stale: the latest is {latest_snapshot_id} ({latest_status})"
        )
        self.run_id = run_id
        self.snapshot_id = snapshot_id
        self.latest_snapshot_id = latest_snapshot_id
        self.latest_status = latest_status


class InvalidTransitionError(RunEngineError):
    code = "invalid_state"

    def __init__(self, run_id: str, status: str, operation: str) -> None:
        super().__init__(f"cannot {operation} run {run_id} in execution status {status}")
        self.run_id = run_id
        self.status = status
        self.operation = operation


class DuplicateExecutionError(RunEngineError):
    code = "duplicate_execution"

    def __init__(self, run_id: str, sequence: int) -> None:
        super().__init__(f"journal entry {sequence} of run {run_id} was written by another execution: stop")
        self.run_id = run_id
        self.sequence = sequence


class ConflictError(RunEngineError):
    code = "conflict"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class QueueFullError(RunEngineError):
    code = "queue_full"

    def __init__(self, env_id: str, queued: int, adding: int, limit: int) -> None:
        super().__init__(f"the environment has {queued} runs queued and its maximum queue length is {limit}: "
                         f"{adding} more would exceed it; retry when runs have started")
        self.env_id = env_id
        self.queued = queued
        self.limit = limit


class TooManyError(RunEngineError):
    """A per-environment limit on things under way (HTTP 429): retry once some have finished."""

    code = "too_many"

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"the environment has {limit} {what} under way, its most; retry when one has finished")
        self.what = what
        self.limit = limit


class LockTimeoutError(RunEngineError):
    code = "lock_timeout"

    def __init__(self, resources: tuple[str, ...], waited_s: float, attempts: int) -> None:
        super().__init__(
            f"could not lock {', '.join(resources)} after {attempts} attempts in {waited_s:.2f}s"
        )
        self.resources = resources
        self.waited_s = waited_s
        self.attempts = attempts


class ReadTimeoutError(RunEngineError):
    """A read whose cost the tenant's data decides (a list, a realtime shape) went past
    ``RUN_ENGINE_COSTLY_READ_TIMEOUT_S`` and was cancelled by PostgreSQL."""

    code = "read_timeout"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the read took longer than {timeout_s:g} s and was stopped: narrow it (fewer or "
                         "rarer filters, a shorter createdAt window, a smaller page) or retry later")
        self.timeout_s = timeout_s


class ValidationError(RunEngineError):
    code = "invalid_input"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class TooLargeError(RunEngineError):
    """What the request would store is past a size limit (HTTP 413 ``payload_too_large``)."""

    code = "payload_too_large"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class UnprocessableError(RunEngineError):
    """Well-formed but impossible now (HTTP 422); ``code`` names the reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ConfigurationError(RunEngineError):
    code = "configuration_error"
