"""Request bodies of the HTTP API (pydantic). Field names are the API's camelCase; unknown
fields are ignored so that Trigger.dev's SDK can call run-engine."""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from run_engine.engine import (
    MAX_METADATA_OPERATIONS,
    CronSpec,
    Debounce,
    MetadataOp,
    QueueSpec,
    RateLimitSpec,
    TaskSpec,
    parse_op,
    queue_type,
)
from run_engine.errors import ValidationError

MACHINES = ("micro", "small-1x", "small-2x", "medium-1x", "medium-2x", "large-1x", "large-2x")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}
#: the longest duration the API takes (delays, TTLs, timeouts, max duration, priority): 10 years
MAX_DURATION_S = 10 * 365 * 86400


def parse_duration_s(value: float | int | str) -> float:
    """Seconds from a number of seconds or a string like "30s", "15m", "2h", "1d"."""
    if isinstance(value, bool):
        raise ValueError("must be a number of seconds or a string like '30s', '15m', '2h', '1d'")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(value)
        if not match:
            raise ValueError("must be a number of seconds or a string like '30s', '15m', '2h', '1d'")
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if not seconds >= 0:
        raise ValueError("must not be negative")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"must be at most {MAX_DURATION_S} seconds (10 years)")
    return seconds


def not_a_bool(value: Any) -> Any:
    """Refuse true and false where a duration, a date or a count is expected (a ``mode="before"``
    check): pydantic would take true for one second, or for 1."""
    if isinstance(value, bool):
        raise ValueError("must not be true or false")
    return value


#: a count (a queue's limit, a rate's runs and burst, attempts, a batch's size and index, a wait's
#: sequence, a dequeue's runs and wait): a whole number (2.0 is 2), true and false refused (pydantic
#: reads true as 1 and false as 0: a queue stopped by ``concurrencyLimit: false``)
Count = Annotated[int, BeforeValidator(not_a_bool)]
#: a number (a priority, seconds, a back-off factor): true and false refused, as for a count
Number = Annotated[float, BeforeValidator(not_a_bool)]


def parse_when(value: float | int | str | datetime, now: float) -> datetime:
    """A delay as a duration (seconds, "30s", "15m", …) from ``now`` or an ISO 8601 date (UTC if naive)."""
    if isinstance(value, datetime):
        return utc(value)
    if isinstance(value, str) and not _DURATION.match(value):
        return parse_date(value)
    return datetime.fromtimestamp(now + parse_duration_s(value), UTC)


def parse_date(value: str) -> datetime:
    """An ISO 8601 date (UTC if naive)."""
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError("must be a duration like '30s', '15m', '2h', '1d' or an ISO 8601 date") from None
    return utc(when)


def utc(when: datetime) -> datetime:
    """A date in UTC (naive dates are taken as UTC). Any offset a client may write is accepted,
    but only dates that exist in UTC between the years 1 and 9999 (PostgreSQL refuses offsets
    beyond ±16 h, so dates are never stored with the client's offset)."""
    if when.tzinfo is None:
        return when.replace(tzinfo=UTC)
    try:
        return when.astimezone(UTC)
    except OverflowError:
        raise ValueError("is outside the years 1..9999 in UTC") from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class RateLimitOption(_Body):
    """``limit`` runs per ``period`` (a duration), at most ``burst`` of them back to back."""

    limit: Count = Field(ge=1, le=1_000_000)
    period: float | int | str = 1
    burst: Count = Field(default=1, ge=1, le=1_000_000)

    _not_a_bool = field_validator("period", mode="before")(not_a_bool)

    @field_validator("period")
    @classmethod
    def _period(cls, v: float | int | str) -> float | int | str:
        if parse_duration_s(v) <= 0:
            raise ValueError("must be longer than 0")
        return v

    def stored(self) -> dict[str, int]:
        return self.spec().stored()

    def spec(self) -> RateLimitSpec:
        return RateLimitSpec(self.limit, int(parse_duration_s(self.period) * 1000), self.burst)


class QueueOption(_Body):
    name: str = Field(min_length=1, max_length=128)
    concurrencyLimit: Count | None = Field(default=None, ge=0, le=100_000)
    rateLimit: RateLimitOption | None = None

    def spec(self) -> QueueSpec:
        return QueueSpec(self.name, type=queue_type(self.name),
                         concurrency_limit=self.concurrencyLimit,
                         rate_limit=self.rateLimit.spec() if self.rateLimit else None)


class OutOfMemoryOption(_Body):
    machine: Literal[MACHINES]  # type: ignore[valid-type]


class RetryOption(_Body):
    maxAttempts: Count | None = Field(default=None, ge=1, le=250)
    outOfMemory: OutOfMemoryOption | None = None  # an attempt killed for its memory is retried on this machine
    factor: Number | None = Field(default=None, ge=1, le=100)
    minTimeoutInMs: Count | None = Field(default=None, ge=0, le=MAX_DURATION_S * 1000)
    maxTimeoutInMs: Count | None = Field(default=None, ge=0, le=MAX_DURATION_S * 1000)
    randomize: bool | None = None

    @model_validator(mode="after")
    def _order(self) -> RetryOption:
        if self.minTimeoutInMs is not None and self.maxTimeoutInMs is not None \
                and self.maxTimeoutInMs < self.minTimeoutInMs:
            raise ValueError("maxTimeoutInMs must be >= minTimeoutInMs")
        return self


class DebounceOption(_Body):
    """Join the DELAYED run of this task with the same ``key`` instead of creating another, and push
    its start to now + ``delay`` (never past the first trigger + ``maxDelay``)."""

    key: str = Field(min_length=1, max_length=512)
    delay: float | int | str
    mode: Literal["leading", "trailing"] = "leading"
    maxDelay: float | int | str | None = None

    _not_bool = field_validator("delay", "maxDelay", mode="before")(not_a_bool)

    @field_validator("delay")
    @classmethod
    def _delay(cls, v: float | int | str) -> float | int | str:
        if parse_duration_s(v) < 1:
            raise ValueError("must be at least 1 second")
        return v

    @field_validator("maxDelay")
    @classmethod
    def _max_delay(cls, v: float | int | str | None, info: ValidationInfo) -> float | int | str | None:
        if v is None:
            return v
        seconds = parse_duration_s(v)
        delay = info.data.get("delay")
        if delay is not None and seconds < parse_duration_s(delay):
            raise ValueError("must be at least the delay")
        return v

    def spec(self) -> Debounce:
        return Debounce(self.key, parse_duration_s(self.delay), self.mode,
                        None if self.maxDelay is None else parse_duration_s(self.maxDelay))


class TriggerOptions(_Body):
    queue: QueueOption | str | None = None
    concurrencyKey: str | None = Field(default=None, max_length=256)
    # an empty key is refused, as a token's is: it would be one more key (every trigger with it
    # answered with the first run for 30 days) that the reset endpoint cannot name
    idempotencyKey: str | None = Field(default=None, min_length=1, max_length=256)
    idempotencyKeyTTL: float | int | str | None = None
    delay: float | int | str | datetime | None = None
    ttl: float | int | str | None = None
    priority: Number | None = Field(default=None, ge=0, le=MAX_DURATION_S)
    tags: list[str] | str | None = None
    metadata: dict[str, Any] | None = None
    maxAttempts: Count | None = Field(default=None, ge=1, le=250)
    maxDuration: Number | None = Field(default=None, gt=0, le=MAX_DURATION_S)
    machine: Literal[MACHINES] | None = None  # type: ignore[valid-type]
    lockToVersion: str | None = Field(default=None, max_length=128)
    parentRunId: str | None = Field(default=None, max_length=128)
    resumeParentOnCompletion: bool | None = None
    payloadType: str | None = Field(default=None, max_length=128)
    retry: RetryOption | None = None
    debounce: DebounceOption | None = None
    workerGroup: str | None = Field(default=None, min_length=1, max_length=128)

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str] | str | None) -> list[str] | None:
        if v is None:
            return None
        tags = [v] if isinstance(v, str) else v
        if len(tags) > 10:
            raise ValueError("at most 10 tags")
        for tag in tags:
            if not tag or len(tag) > 128:
                raise ValueError("each tag must be 1..128 characters")
        return tags

    @field_validator("queue")
    @classmethod
    def _queue_name(cls, v: QueueOption | str | None) -> QueueOption | str | None:
        if isinstance(v, str) and (not v or len(v) > 128):
            raise ValueError("must be 1..128 characters")
        return v

    _not_a_bool = field_validator("ttl", "idempotencyKeyTTL", "delay", mode="before")(not_a_bool)

    @field_validator("ttl", "idempotencyKeyTTL")
    @classmethod
    def _duration(cls, v: float | int | str | None) -> float | int | str | None:
        if v is not None:
            parse_duration_s(v)
        return v

    @field_validator("delay")
    @classmethod
    def _delay(cls, v: float | int | str | datetime | None) -> float | int | str | datetime | None:
        if v is not None:
            parse_when(v, 0)
        return utc(v) if isinstance(v, datetime) else v


class TriggerBody(_Body):
    payload: Any = None
    options: TriggerOptions | None = None


class BatchItem(_Body):
    task: str = Field(min_length=1, max_length=128)
    payload: Any = None
    options: TriggerOptions | None = None


class ResetIdempotencyKeyBody(_Body):
    """``POST /api/v1/idempotencyKeys/{key}/reset`` (the SDK's ``idempotencyKeys.reset``)."""
    taskIdentifier: str = Field(min_length=1, max_length=128)


class PromoteBody(_Body):
    """``POST /api/v1/deployments/{version}/promote`` (optional: Trigger.dev's CLI sends none)."""
    workerGroup: str | None = Field(default=None, min_length=1, max_length=128)


class OpenBatchBody(_Body):
    """Trigger.dev's two-phase batch, phase 1 (``POST /api/v3/batches``)."""
    runCount: Count = Field(ge=1, le=1000)
    taskIdentifiers: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(default=None,
                                                                                            max_length=1000)
    idempotencyKey: str | None = Field(default=None, min_length=1, max_length=256)  # an index entry: bounded
    #: how long the key names this batch (default 30 days, as a run's)
    idempotencyKeyTTL: float | int | str | None = None
    parentRunId: str | None = Field(default=None, max_length=128)

    _not_a_bool = field_validator("idempotencyKeyTTL", mode="before")(not_a_bool)

    @field_validator("idempotencyKeyTTL")
    @classmethod
    def _duration(cls, v: float | int | str | None) -> float | int | str | None:
        if v is not None:
            parse_duration_s(v)
        return v


class BatchStreamItem(_Body):
    """One NDJSON line of phase 2 (``POST /api/v3/batches/{batchId}/items``)."""
    index: Count = Field(ge=0, le=999)
    task: str = Field(min_length=1, max_length=128)
    payload: Any = None
    options: TriggerOptions | None = None


class CreatedRange(_Body):
    from_: str | None = Field(default=None, alias="from", max_length=64)
    to: str | None = Field(default=None, max_length=64)


StrList = list[Annotated[str, Field(min_length=1, max_length=256)]]


class RunFilterBody(_Body):
    """The runs list's filters (``GET /api/v1/runs``), as lists."""
    status: StrList | None = Field(default=None, max_length=100)
    taskIdentifier: StrList | None = Field(default=None, max_length=100)
    tag: StrList | None = Field(default=None, max_length=100)
    queue: StrList | None = Field(default=None, max_length=100)
    batch: StrList | None = Field(default=None, max_length=100)
    createdAt: CreatedRange | None = None


class BulkBody(_Body):
    filter: RunFilterBody = Field(default_factory=RunFilterBody)
    idempotencyKey: str | None = Field(default=None, min_length=1, max_length=256)


class QueueRef(_Body):
    """A queue as Trigger.dev's SDK names one in a filter: a task's own (``task``) or a custom one."""
    type: Literal["task", "custom"]
    name: str = Field(min_length=1, max_length=256)


_Names = Annotated[str, Field(min_length=1, max_length=256)]


class SdkBulkFilter(BaseModel):
    """The filter of Trigger.dev's ``runs.bulk.cancel|replay``. Every key it may send is named
    (anything else is refused); those run-engine cannot filter by are refused by the route, as
    acting on more runs than asked would be worse than not acting."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    status: _Names | list[_Names] | None = None
    taskIdentifier: _Names | list[_Names] | None = None
    tag: _Names | list[_Names] | None = None
    batch: _Names | None = None
    queue: QueueRef | list[QueueRef] | None = None
    from_: StrictStr | StrictInt | StrictFloat | None = Field(default=None, alias="from")
    to: StrictStr | StrictInt | StrictFloat | None = None
    period: str | None = Field(default=None, max_length=32)
    version: Any = None
    schedule: Any = None
    isTest: Any = None
    machine: Any = None
    region: Any = None
    bulkAction: Any = None


class CreateBulkActionBody(_Body):
    """``POST /api/v1/bulk-actions`` (Trigger.dev's ``runs.bulk.cancel|replay``): a filter or run ids."""
    action: Literal["cancel", "replay"]
    filter: SdkBulkFilter | None = None
    runIds: list[_Names] | None = Field(default=None, min_length=1, max_length=500)
    name: str | None = Field(default=None, max_length=255)
    targetRegion: str | None = Field(default=None, max_length=256)


class RescheduleBody(_Body):
    delay: float | int | str | datetime

    _not_a_bool = field_validator("delay", mode="before")(not_a_bool)

    @field_validator("delay")
    @classmethod
    def _delay(cls, v: float | int | str | datetime) -> float | int | str | datetime:
        parse_when(v, 0)
        return utc(v) if isinstance(v, datetime) else v


class MetadataBody(_Body):
    """A replacement (``metadata``) or Trigger.dev's operations (``operations``: when given, even
    empty, ``metadata`` is ignored, as Trigger.dev does), and operations on the run's parent and
    root. The operations are checked one by one (:func:`metadata_operations`)."""

    metadata: dict[str, Any] | None = None
    operations: list[Any] | None = None
    parentOperations: list[Any] | None = None
    rootOperations: list[Any] | None = None


def metadata_operations(raw: list[Any] | None, field: str) -> tuple[MetadataOp, ...]:
    """The operations of one list of a :class:`MetadataBody`, each checked (400 naming
    ``<field>.<index>`` and what is wrong with it)."""
    return tuple(parse_op(op, f"{field}.{i}") for i, op in enumerate(raw or ()))


def metadata_change(req: MetadataBody, *, keyed: bool = False) -> tuple[tuple[MetadataOp, ...], tuple[MetadataOp, ...],
                                                                      tuple[MetadataOp, ...]] | None:
    """The operations of a body on the run, its parent and its root, or None for a plain
    replacement (``metadata`` alone, as before operations: one statement, no row lock; ``keyed``,
    a request with an idempotency key: an ``update`` operation, as the key is remembered under the
    row lock). 400 for a body with nothing to do, or more than :data:`MAX_METADATA_OPERATIONS`
    operations."""
    if req.operations is None and not req.parentOperations and not req.rootOperations:
        if req.metadata is None:
            raise ValidationError("metadata", "Field required (or operations, parentOperations, rootOperations)")
        if not keyed:
            return None
    count = sum(len(ops or ()) for ops in (req.operations, req.parentOperations, req.rootOperations))
    if count > MAX_METADATA_OPERATIONS:
        raise ValidationError("operations", f"at most {MAX_METADATA_OPERATIONS} operations a request (operations, "
                                            f"parentOperations and rootOperations together; {count} given)")
    own = (metadata_operations(req.operations, "operations") if req.operations is not None
           else (MetadataOp("update", None, req.metadata, "metadata"),) if req.metadata is not None else ())
    return (own, metadata_operations(req.parentOperations, "parentOperations"),
            metadata_operations(req.rootOperations, "rootOperations"))


def metadata_digest(req: MetadataBody) -> str:
    """A digest of a metadata request's body (what a request sent again with its idempotency key
    must be): of its fields as decoded, in the order they came (a client sends a try again as it
    sent it)."""
    fields = [req.metadata, req.operations, req.parentOperations, req.rootOperations]
    try:
        text = orjson.dumps(fields)
    except (orjson.JSONEncodeError, RecursionError):  # an integer past 64 bits, past 254 levels
        text = repr(fields).encode()
    return hashlib.blake2b(text, digest_size=12).hexdigest()


class TagsBody(_Body):
    tags: list[str] | str = Field(min_length=1)

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str] | str) -> list[str]:
        tags = [v] if isinstance(v, str) else v
        if len(tags) > 10:
            raise ValueError("at most 10 tags")
        if any(not t or len(t) > 128 for t in tags):
            raise ValueError("each tag must be 1..128 characters")
        return tags


class BatchBody(_Body):
    items: list[BatchItem] = Field(min_length=1, max_length=1000)


class BatchV2Body(BatchBody):
    """Trigger.dev's one-request batch (``POST /api/v2/tasks/batch``): the items, and the parent of
    every one of them."""
    parentRunId: str | None = Field(default=None, max_length=128)
    resumeParentOnCompletion: bool | None = None


#: how a queue is named in its path (Trigger.dev's SDK sends it): ``task`` (a task id: the queue
#: ``task/<id>``), ``custom`` (the name as is) or ``id`` (the queue's id)
QueueKind = Literal["task", "custom", "id"]


class PauseBody(_Body):
    action: Literal["pause", "resume"]
    type: QueueKind | None = None


class ConcurrencyBody(_Body):
    concurrencyLimit: Count = Field(ge=0, le=100_000)
    type: QueueKind | None = None


class QueueKindBody(_Body):
    type: QueueKind | None = None


class RedriveAllBody(_Body):
    taskIdentifier: str | None = Field(default=None, max_length=128)
    queue: str | None = Field(default=None, max_length=128)
    after: str | None = Field(default=None, max_length=256)  # the `next` of the call before


# --- worker API -------------------------------------------------------------------------------

class CronDecl(_Body):
    pattern: str = Field(min_length=1, max_length=100)
    timezone: str | None = Field(default=None, max_length=64)


class TaskDecl(_Body):
    id: str = Field(min_length=1, max_length=128)
    cron: Annotated[str, Field(max_length=100)] | CronDecl | None = None
    queue: str | None = Field(default=None, min_length=1, max_length=128)
    retry: dict[str, Any] | None = None
    maxDuration: Count | None = Field(default=None, gt=0, le=MAX_DURATION_S)
    machine: Literal[MACHINES] | None = None  # type: ignore[valid-type]

    def spec(self) -> TaskSpec:
        cron = None  # an empty pattern declares no schedule
        if isinstance(self.cron, str) and self.cron:
            cron = CronSpec(self.cron)
        elif isinstance(self.cron, CronDecl):
            cron = CronSpec(self.cron.pattern, self.cron.timezone or "UTC")
        return TaskSpec(self.id, queue=self.queue, retry=self.retry, max_duration_s=self.maxDuration,
                        machine=self.machine, cron=cron)

    @field_validator("retry")
    @classmethod
    def _retry(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """A retry policy the engine can use (checked now, not when a run's attempt fails)."""
        if v is None:
            return v
        from run_engine.settings import RetryPolicy

        oom = v.get("out_of_memory", v.get("outOfMemory"))
        if oom is not None and (not isinstance(oom, dict) or oom.get("machine") not in MACHINES):
            raise ValueError(f"out_of_memory: {{\"machine\": one of {', '.join(MACHINES)}}}")
        numbers = {k: x for k, x in v.items() if k not in ("randomize", "out_of_memory", "outOfMemory")}
        if any(isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= MAX_DURATION_S
               for x in numbers.values() if x is not None):
            raise ValueError(f"values must be numbers from 0 to {MAX_DURATION_S}")
        try:
            RetryPolicy.from_json(v, RetryPolicy(max_timeout_s=MAX_DURATION_S))
        except Exception as exc:  # the policy's own checks (ValidationError, TypeError)
            raise ValueError(str(exc)) from None
        return v


class DeploymentDecl(_Body):
    tasks: list[TaskDecl] = Field(min_length=1, max_length=5000)
    queues: list[QueueOption] = Field(default_factory=list, max_length=5000)
    version: str | None = Field(default=None, min_length=1, max_length=128)

    @field_validator("queues")
    @classmethod
    def _unique(cls, v: list[QueueOption]) -> list[QueueOption]:
        names = [q.name for q in v]
        if len(set(names)) != len(names):
            raise ValueError("queue names must be unique")
        return v


class ConnectBody(_Body):
    workerInstanceName: str = Field(min_length=1, max_length=256)
    concurrency: Count | None = Field(default=None, ge=0, le=100_000)  # runs it takes at once (shown, not enforced)
    deployment: DeploymentDecl
    environments: list[Annotated[str, Field(max_length=256)]] | None = Field(default=None, max_length=100)


class WorkerHeartbeatBody(_Body):
    workerInstanceName: str = Field(min_length=1, max_length=256)
    # a stopping worker: its open long-poll answers at once without handing it runs
    stopping: bool = False


class DequeueBody(_Body):
    maxRuns: Count = Field(default=1, ge=1, le=100)
    waitMs: Count = Field(default=0, ge=0, le=60_000)
    workerInstanceName: str | None = Field(default=None, max_length=256)
    # extension: only runs of these environments (ids); a supervisor started with --env sends them
    environments: list[Annotated[str, Field(max_length=256)]] | None = Field(default=None, max_length=100)
    # extension: the deployments (ids from connect) the worker runs: only runs of their tasks
    deployments: list[Annotated[str, Field(max_length=256)]] | None = Field(default=None, max_length=100)
    # extension: also start the attempts (PENDING_EXECUTING → EXECUTING) in the same request;
    # each item then carries `attempt`, the response of attempts/start
    startAttempts: bool = False


class ErrorBody(_Body):
    type: str = "BUILT_IN_ERROR"
    name: str | None = None
    message: str = ""
    stackTrace: str | None = None
    code: str | None = None


class CompleteBody(_Body):
    ok: bool
    output: Any = None
    outputType: str | None = None
    error: ErrorBody | None = None
    retryable: bool | None = None


class RunSnapshotRef(_Body):
    runId: str = Field(min_length=1, max_length=64)
    snapshotId: str = Field(min_length=1, max_length=64)


class BatchStartBody(_Body):
    items: list[RunSnapshotRef] = Field(min_length=1, max_length=100)


class BatchCompleteItem(CompleteBody):
    runId: str = Field(min_length=1, max_length=64)
    snapshotId: str = Field(min_length=1, max_length=64)


class BatchCompleteBody(_Body):
    items: list[BatchCompleteItem] = Field(min_length=1, max_length=100)


# --- schedules --------------------------------------------------------------------------------

class ScheduleBody(_Body):
    task: str = Field(min_length=1, max_length=128)
    cron: str = Field(min_length=1, max_length=100)
    timezone: str = Field(default="UTC", min_length=1, max_length=64)
    externalId: str | None = Field(default=None, max_length=256)
    deduplicationKey: str | None = Field(default=None, min_length=1, max_length=256)


# --- waitpoints -------------------------------------------------------------------------------

def _duration(v: Any) -> Any:
    if v is not None:
        parse_duration_s(v)
    return v


class TokenCreateBody(_Body):
    idempotencyKey: str | None = Field(default=None, min_length=1, max_length=256)
    idempotencyKeyTTL: float | str | None = None
    timeout: float | str | datetime | None = None
    tags: list[str] = Field(default_factory=list)

    @field_validator("idempotencyKeyTTL")
    @classmethod
    def _ttl(cls, v: Any) -> Any:
        return _duration(v)

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, v: Any) -> Any:
        """A duration ("1h", seconds) or an ISO 8601 date."""
        if v is None:
            return v
        if isinstance(v, datetime):
            return utc(v)
        if isinstance(v, str) and not _DURATION.match(v):
            return parse_date(v)
        return _duration(v)

    _not_a_bool = field_validator("timeout", "idempotencyKeyTTL", mode="before")(not_a_bool)

    @field_validator("tags", mode="before")
    @classmethod
    def _one_tag(cls, v: Any) -> Any:
        """One tag as a string too (Trigger.dev's createToken takes either), none as null."""
        return [] if v is None else [v] if isinstance(v, str) else v

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str]) -> list[str]:
        if len(v) > 10:
            raise ValueError("at most 10 tags")
        if any(not t or len(t) > 128 for t in v):
            raise ValueError("each tag is 1..128 characters")
        return v


class TokenCompleteBody(_Body):
    data: Any = None


class _WaitBody(_Body):
    """A wait of an executing run; ``suspend``: checkpoint the run at once if it is blocked."""

    sequence: Count = Field(ge=0, le=1_000_000)
    suspend: bool = False


class WaitDurationBody(_WaitBody):
    seconds: Number | None = Field(default=None, ge=0, le=10 * 365 * 86400)
    date: datetime | None = None

    @field_validator("date")
    @classmethod
    def _date(cls, v: datetime | None) -> datetime | None:
        return None if v is None else utc(v)
    idempotencyKey: str | None = Field(default=None, min_length=1, max_length=256)


class WaitBody(_WaitBody):
    kind: Literal["token", "wait", "child", "batch"] = "token"


class BatchWaitItem(WaitBody):
    """One wait of ``POST /waits``: what ``…/waitpoints/{waitpointId}/wait`` takes, with its path."""

    runId: str = Field(min_length=1, max_length=64)
    snapshotId: str = Field(min_length=1, max_length=64)
    waitpointId: str = Field(min_length=1, max_length=64)


class BatchWaitBody(_Body):
    items: list[BatchWaitItem] = Field(min_length=1, max_length=100)


class ChildTriggerBody(_WaitBody):
    batch: bool = False
    items: list[BatchItem] = Field(min_length=1, max_length=1000)


class JournalBody(_Body):
    snapshotId: str = Field(min_length=1, max_length=64)
    sequence: Count = Field(ge=0, le=1_000_000)
    kind: Literal["step"] = "step"
    key: str = Field(min_length=1, max_length=256)
    result: Any = None


class PublicTokenBody(_Body):
    """``POST /api/v1/auth/public-tokens``: a public access token the server signs."""
    scopes: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(min_length=1, max_length=500)
    expirationTime: str | int | None = None  # a duration ("15m", "1h") or a date in Unix seconds; 15 minutes
    oneTimeUse: bool = False
    realtime: dict[str, Any] | None = None

    _not_a_bool = field_validator("expirationTime", mode="before")(not_a_bool)
