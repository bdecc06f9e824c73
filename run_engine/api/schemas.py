"""Response bodies of the HTTP API, as the OpenAPI document describes them (API.md).

These models document; the handlers build plain dicts. The fuzzing test (schemathesis, in CI)
checks every response against them, so they cannot drift from what the server sends. Objects
allow fields beyond those listed (the API adds fields freely); a field that may be left out is
not ``required``, and ``null`` is allowed only where the server sends it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RUN_STATUSES = ("PENDING_VERSION", "DELAYED", "QUEUED", "DEQUEUED", "EXECUTING", "WAITING", "COMPLETED",
                "CANCELED", "FAILED", "CRASHED", "SYSTEM_FAILURE", "EXPIRED", "TIMED_OUT")


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Out):
    code: str
    message: str


class Error(_Out):
    """Every error: ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


class Pagination(_Out):
    next: str = Field(default="", description="cursor of the next page; left out on the last page")


class RunError(_Out):
    type: str
    message: str
    name: str = ""
    stackTrace: str = ""


class RelatedRuns(_Out):
    root: str = ""
    parent: str = ""
    children: list[str] = Field(default_factory=list)


class Run(_Out):
    """The run object (a superset of Trigger.dev's RetrieveRunResponse)."""

    id: str
    taskIdentifier: str
    status: Literal[RUN_STATUSES]  # type: ignore[valid-type]
    isQueued: bool
    isExecuting: bool
    isWaiting: bool
    isCompleted: bool
    isSuccess: bool
    isFailed: bool
    isCancelled: bool
    isTest: bool
    payload: Any
    output: Any = None
    error: RunError | None = None
    attemptCount: int
    tags: list[str]
    metadata: dict[str, Any]
    queue: str
    concurrencyKey: str = ""
    priority: float
    idempotencyKey: str = ""
    ttl: str = Field(default="", description="a duration such as '10m'")
    delayedUntil: str = ""
    expiredAt: str = ""
    createdAt: str
    updatedAt: str
    startedAt: str = ""
    finishedAt: str = ""
    durationMs: int
    costInCents: float
    baseCostInCents: float
    batchId: str = ""
    depth: int
    triggerFunction: str
    relatedRuns: RelatedRuns
    version: str = ""


class RunList(_Out):
    data: list[Run]
    pagination: Pagination


class Triggered(_Out):
    id: str
    isCached: bool


class BatchRun(_Out):
    id: str
    taskIdentifier: str
    isCached: bool


class BatchItemFailure(_Out):
    """An item of the batch that failed on its own and has no run (``taskIdentifier`` "" when its
    line named no task)."""
    index: int
    taskIdentifier: str
    error: str
    errorCode: str


class BatchTriggered(_Out):
    id: str
    runs: list[BatchRun]
    errors: list[BatchItemFailure] | None = None


class BulkAction(_Out):
    id: str
    type: Literal["CANCEL", "REPLAY"]
    status: Literal["PENDING", "COMPLETED", "ABORTED"]
    processed: int
    succeeded: int
    filter: dict[str, Any]
    createdAt: str
    completedAt: str | None = None
    idempotencyKey: str | None = None
    isCached: bool | None = None


class BatchOpened(_Out):
    id: str
    runCount: int
    isCached: bool
    idempotencyKey: str | None = None


class StreamedLineError(_Out):
    """A streamed line that made no run: its line number (from 1), the batch index and task it
    names (left out when it names none: it then fails no item), its error message and code."""
    line: int
    index: int | None = None
    taskIdentifier: str | None = None
    error: str
    errorCode: str


class BatchItemsStreamed(_Out):
    id: str
    itemsAccepted: int
    itemsDeduplicated: int
    sealed: bool
    enqueuedCount: int | None = None
    expectedCount: int | None = None
    errors: list[StreamedLineError] | None = None


class Batch(_Out):
    id: str
    status: Literal["PENDING", "COMPLETED"]
    runCount: int
    runs: list[str]


class BatchProcessing(_Out):
    errors: list[BatchItemFailure]


class BatchV2(_Out):
    id: str
    status: Literal["PENDING", "PROCESSING", "COMPLETED", "ABORTED"]
    idempotencyKey: str | None = None
    createdAt: str
    updatedAt: str
    runCount: int
    runs: list[str]
    processing: BatchProcessing


class ResetIdempotencyKey(_Out):
    id: str


class BulkActionCreated(_Out):
    id: str


class BulkCounts(_Out):
    total: int
    success: int
    failure: int


class SdkBulkAction(_Out):
    id: str
    name: str | None = None
    type: Literal["CANCEL", "REPLAY"]
    status: Literal["PENDING", "COMPLETED", "ABORTED"]
    counts: BulkCounts
    createdAt: str
    completedAt: str | None = None


class SdkBulkActionPage(_Out):
    data: list[SdkBulkAction]
    pagination: dict[str, str]


class RunId(_Out):
    id: str


class Reason(_Out):
    code: str
    message: str


class Explanation(_Out):
    id: str
    status: str
    executionStatus: str | None
    reasons: list[Reason]
    summary: str


class MetadataOut(_Out):
    metadata: dict[str, Any]


class TagsOut(_Out):
    tags: list[str]


class Queue(_Out):
    id: str
    name: str
    type: Literal["task", "custom"]
    running: int
    queued: int
    concurrencyLimit: int | None
    paused: bool


class QueueList(_Out):
    data: list[Queue]


class DlqEntry(_Out):
    run: Run
    reason: str
    deadAt: str
    deliveries: int


class DlqList(_Out):
    data: list[DlqEntry]
    pagination: Pagination


class Redriven(_Out):
    redriven: int
    next: str | None = None  # only when the call stopped before the end: send it as `after`


class TokenCreated(_Out):
    id: str
    isCached: bool
    url: str


class Token(_Out):
    id: str
    status: Literal["WAITING", "COMPLETED", "TIMED_OUT"]
    output: Any = None
    outputIsError: bool
    completedAt: str = ""
    timeoutAt: str = ""
    tags: list[str]
    idempotencyKey: str = ""


class TokenList(_Out):
    data: list[Token]
    pagination: Pagination


class Success(_Out):
    success: bool


class PacketUrl(_Out):
    presignedUrl: str


class PacketUpload(_Out):
    presignedUrl: str
    storagePath: str


class Schedule(_Out):
    id: str
    task: str
    type: Literal["IMPERATIVE", "DECLARATIVE"]
    active: bool
    cron: str
    timezone: str
    externalId: str | None
    deduplicationKey: str | None
    nextRun: str | None
    lastRun: str | None
    createdAt: str


class ScheduleList(_Out):
    data: list[Schedule]
    pagination: Pagination


class ScheduleDeleted(_Out):
    id: str
    deleted: bool


# --- worker API ------------------------------------------------------------------------------

class Snapshot(_Out):
    id: str
    runId: str
    executionStatus: str
    runStatus: str
    attemptNumber: int
    description: str
    previousSnapshotId: str | None
    checkpointId: str | None
    completedWaitpointIds: list[str]
    createdAt: str


class SnapshotOut(_Out):
    snapshot: Snapshot


class Deployment(_Out):
    environmentId: str
    deploymentId: str
    version: str
    pendingRunsEnqueued: int


class Connected(_Out):
    deploymentId: str
    version: str
    workerGroupId: str
    deployments: list[Deployment]


class Ok(_Out):
    ok: bool


class Started(_Out):
    run: Run
    snapshot: Snapshot
    attemptNumber: int
    payload: Any
    journal: list[dict[str, Any]]
    machine: str
    runToken: str


class DequeuedRun(_Out):
    id: str
    taskIdentifier: str
    queue: str
    environmentId: str
    attemptNumber: int


class Dequeued(_Out):
    run: DequeuedRun
    snapshot: Snapshot
    runToken: str
    attempt: dict[str, Any] = Field(default_factory=dict, description="with startAttempts: the attempt's start, "
                                                                      "or ok false with an error")


class DequeueOut(_Out):
    runs: list[Dequeued]
    backlog: bool = Field(default=False, description="runs of the worker group were still ready after this dequeue")


class ItemResult(_Out):
    ok: bool
    status: int = 200
    error: ErrorDetail | None = None


class ItemResults(_Out):
    results: list[ItemResult]


class Completed(_Out):
    action: Literal["finished", "retry"]
    status: str
    snapshotId: str
    delayMs: int = 0


class Blocked(_Out):
    blocked: bool
    snapshot: Snapshot
    entry: dict[str, Any] = Field(default_factory=dict)
    suspended: bool = Field(default=False, description="the wait asked to suspend and the run was checkpointed: "
                                                       "stop its executor; it is restored from the queue")


class JournalOut(_Out):
    journal: list[dict[str, Any]]


class Dependencies(_Out):
    postgres: Literal["up", "down"]
    redis: Literal["up", "down"]


class Health(_Out):
    ok: bool
    dependencies: Dependencies


class Index(_Out):
    name: str
    version: str
    dashboard: str
    health: str
    openapi: str
    api: str
    docs: str


class JwtClaims(_Out):
    sub: str
    pub: bool


class PublicToken(_Out):
    token: str


class BatchV2Triggered(_Out):
    id: str
    runCount: int
    isCached: bool
    idempotencyKey: str | None = None
    errors: list[BatchItemFailure] | None = None


class WorkerInstanceOut(_Out):
    name: str
    concurrency: int | None = None
    lastHeartbeatAt: str | None = None


class WorkerGroupOut(_Out):
    id: str
    name: str
    isDefault: bool
    shared: bool
    instances: list[WorkerInstanceOut]


class WorkerGroupList(_Out):
    data: list[WorkerGroupOut]


class PromotedDeployment(_Out):
    id: str
    version: str
    workerGroupId: str
    alreadyCurrent: bool
    pendingRunsEnqueued: int


class Promoted(_Out):
    """The first deployment promoted (the environment's default group's when it has one), and all."""

    id: str
    version: str
    workerGroupId: str
    alreadyCurrent: bool
    pendingRunsEnqueued: int
    deployments: list[PromotedDeployment]
