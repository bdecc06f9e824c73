"""EnqueueSystem: create runs (trigger) and put runs into the run queue."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from run_engine.db.deployments import TaskQueue
from run_engine.db.runs import InsertGuard, NewRun, RunRow
from run_engine.errors import ConflictError, NotFoundError, QueueFullError, UnprocessableError, ValidationError
from run_engine.events import RunEvent
from run_engine.ids import new_id
from run_engine.run_queue import EnqueueItem, QueueSettings, RateLimit
from run_engine.statuses import ExecutionStatus, RunStatus
from systems import engine_jobs
from systems.resources import SystemResources

log = logging.getLogger(__name__)
DEFAULT_IDEMPOTENCY_TTL_S = 30 * 86400
MAX_IDEMPOTENCY_KEY_CHARS = 256  # as the API's options.idempotencyKey (an index entry: bounded)


@dataclass(frozen=True, slots=True)
class Debounce:
    """Join the DELAYED run of (environment, task, ``key``) instead of creating another: its date
    moves to now + ``delay_s``, never past the first trigger + ``max_delay_s``. ``mode``
    "trailing" also gives it this trigger's payload (and metadata, tags, max attempts, max
    duration and machine when given); "leading" keeps the first trigger's."""

    key: str
    delay_s: float
    mode: str = "leading"
    max_delay_s: float | None = None


@dataclass(frozen=True, slots=True)
class TriggerRequest:
    """What a caller asks for; options use the API's meaning (seconds, names)."""

    env_id: str
    task_id: str
    payload: Any = None
    payload_type: str = "application/json"
    queue: str | None = None
    queue_concurrency_limit: int | None = None
    concurrency_key: str | None = None
    priority_s: float = 0.0
    tags: tuple[str, ...] = ()
    metadata: Any = None
    max_attempts: int | None = None
    retry: dict[str, Any] | None = None
    max_duration_s: int | None = None
    machine: str | None = None
    parent_run_id: str | None = None
    root_run_id: str | None = None
    depth: int = 0
    batch_id: str | None = None
    batch_index: int | None = None  # a streamed batch's item: its index (one run an index)
    trigger_function: str = "trigger"
    ttl_s: float | None = None
    run_id: str | None = None  # given by callers that must know it before the insert
    resume_parent_on_completion: bool = False
    delay_until: datetime | None = None
    idempotency_key: str | None = None
    idempotency_key_ttl_s: float | None = None
    debounce: Debounce | None = None  # RunEngine.trigger* only (systems/debounce.py), not trigger-and-wait
    # where the run goes: a worker group of the environment's project by name, or by id (a replay's
    # own); neither: the environment's default group
    worker_group: str | None = None
    worker_group_id: str | None = None
    # lockToVersion: the run is the deployment of that version's (of its worker group) only
    lock_to_version: str | None = None


@dataclass(frozen=True, slots=True)
class TriggeredRun:
    id: str
    status: RunStatus
    snapshot_id: str
    queue: str
    is_cached: bool = False


@dataclass(slots=True)
class _EnvInfo:
    worker_group_id: str
    concurrency_limit: int
    max_queue_length: int | None = None
    project_id: str = ""
    fetched_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _TaskInfo:
    deployment_id: str | None
    queue: str | None
    fetched_at: float = field(default_factory=time.monotonic)


def _settings(row: TaskQueue) -> QueueSettings:
    """What the run queue holds of a task queue: its effective limit, key limit, rate limit and
    pause, with their version."""
    rate = RateLimit(r.limit, r.period_ms, r.burst) if (r := row.rate_limit) else None
    return QueueSettings(row.env_id, row.name, row.effective_limit, row.concurrency_key_limit, rate, row.paused,
                         row.settings_version)


def _remember(cache: dict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """Put ``key`` in a bounded cache, forgetting the oldest entry when it is full: task ids and
    queue names are chosen by tenants, so the caches must not grow with what they send."""
    if key not in cache and len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value


class EnqueueSystem:
    # Deployments and limits change rarely; a short cache keeps the trigger path to one write.
    CACHE_TTL_S = 2.0
    CACHE_SIZE = 10_000

    def __init__(self, resources: SystemResources) -> None:
        self.r = resources
        self._envs: dict[str, _EnvInfo] = {}
        self._tasks: dict[tuple[str, ...], _TaskInfo] = {}
        self._queues: dict[tuple[str, str], None] = {}
        self._groups: dict[tuple[str, str, str], tuple[str | None, float]] = {}
        self._last_micros = 0

    def invalidate(self, env_id: str | None = None) -> None:
        """Forget the cached tasks and queues of ``env_id`` (of every environment when None). The
        caches are this process's own: other processes see a deployment within CACHE_TTL_S."""
        if env_id is None:
            self._tasks.clear()
            self._queues.clear()
            return
        for task in [k for k in self._tasks if k[0] == env_id]:
            del self._tasks[task]
        for queue in [k for k in self._queues if k[0] == env_id]:
            del self._queues[queue]

    async def environment(self, env_id: str) -> _EnvInfo:
        info = self._envs.get(env_id)
        if info is None or time.monotonic() - info.fetched_at > self.CACHE_TTL_S:
            row = await self.r.repo.tenancy.environment(env_id)
            if row is None:
                raise NotFoundError("environment", env_id)
            fresh = _EnvInfo(row.default_worker_group_id, row.concurrency_limit,
                             row.max_queue_length or self.r.settings.max_queue_length, row.project_id)
            if info is None or info.concurrency_limit != fresh.concurrency_limit:
                await self.r.queue.set_env_limit(env_id, fresh.concurrency_limit)
            info = fresh
            _remember(self._envs, env_id, info, self.CACHE_SIZE)
        return info

    async def worker_group(self, env: _EnvInfo, req: TriggerRequest) -> str:
        """The worker group a run goes to: the one it names (of the environment's project, or the
        environment's default group, by name), else the environment's default."""
        if req.worker_group_id is not None:
            return req.worker_group_id
        if req.worker_group is None:
            return env.worker_group_id
        key = (env.project_id, env.worker_group_id, req.worker_group)
        cached = self._groups.get(key)
        if cached is None or time.monotonic() - cached[1] > self.CACHE_TTL_S:
            found = await self.r.repo.tenancy.routable_worker_group(env.project_id, env.worker_group_id,
                                                                    req.worker_group)
            cached = (found, time.monotonic())
            _remember(self._groups, key, cached, self.CACHE_SIZE)
        if cached[0] is None:
            raise ValidationError("worker_group", f"no worker group named {req.worker_group!r} in this project")
        return cached[0]

    async def current_task(self, env_id: str, worker_group_id: str, task_id: str) -> _TaskInfo:
        """The task as the current deployment of (env, group) has it (``deployment_id`` None: none
        has); cached for CACHE_TTL_S."""
        key = (env_id, worker_group_id, task_id)
        info = self._tasks.get(key)
        if info is None or time.monotonic() - info.fetched_at > self.CACHE_TTL_S:
            row = await self.r.repo.deployments.current_task(env_id, worker_group_id, task_id)
            info = _TaskInfo(row.deployment_id, row.queue_name) if row else _TaskInfo(None, None)
            _remember(self._tasks, key, info, self.CACHE_SIZE)
        return info

    async def version_task(self, env_id: str, worker_group_id: str, task_id: str, version: str) -> _TaskInfo:
        """The task as the deployment of (env, group) with ``version`` has it, current or not
        (lockToVersion); ValidationError when there is none or it lacks the task: no worker could
        ever take such a run. Cached for CACHE_TTL_S."""
        key = (env_id, worker_group_id, task_id, version)
        info = self._tasks.get(key)
        if info is None or time.monotonic() - info.fetched_at > self.CACHE_TTL_S:
            row = await self.r.repo.deployments.version_task(env_id, worker_group_id, version, task_id)
            info = _TaskInfo(row.deployment_id, row.queue_name) if row else _TaskInfo(None, None)
            _remember(self._tasks, key, info, self.CACHE_SIZE)
        if info.deployment_id is None:
            raise ValidationError("lockToVersion", f"no deployment of version {version!r} has the task {task_id!r} "
                                                   "in the worker group this run goes to")
        return info

    async def _task(self, req: TriggerRequest, group_id: str) -> _TaskInfo:
        """The task as the run's deployment has it: the version it locks to, else the current one."""
        if req.lock_to_version is not None:
            return await self.version_task(req.env_id, group_id, req.task_id, req.lock_to_version)
        return await self.current_task(req.env_id, group_id, req.task_id)

    async def _ensure_queue(self, env_id: str, name: str, limit: int | None) -> None:
        if limit is None and (env_id, name) in self._queues:
            return
        cap = self.r.settings.max_queues_per_env
        row = await self.r.repo.deployments.ensure_queue(new_id("queue"), env_id, name, limit, cap)
        if row is None:
            # each queue is a row, Redis keys and settings that every deploy and every restore of
            # Redis walks: a tenant naming a new queue per trigger would make them unbounded
            raise UnprocessableError("too_many_queues", f"queue: this environment has {cap} queues, the most "
                                     "it may have (RUN_ENGINE_MAX_QUEUES_PER_ENV); use one of them")
        await self.mirror_queue(row)
        _remember(self._queues, (env_id, name), None, self.CACHE_SIZE)

    async def mirror_queue(self, row: TaskQueue) -> None:
        """Copy a task queue's effective limit (override, else deployed), rate limit and pause flag
        to Redis, with their version: Redis keeps a newer copy (another process's, made after an
        operator's change that this row, read before it, does not have)."""
        await self.mirror_queue_rows([row])

    async def mirror_queue_rows(self, rows: Sequence[TaskQueue], *, repair: bool = False) -> None:
        """:meth:`mirror_queue` for many queues, in pipelined round trips (``repair``: also over a
        copy of the same version, found unlike the row)."""
        await self.r.queue.configure_queues([_settings(row) for row in rows], repair=repair)

    async def stale_queue_rows(self, rows: Sequence[TaskQueue]) -> list[TaskQueue]:
        """The queues of ``rows`` whose copy in Redis is behind the row (see RunQueue.stale_settings)."""
        stale = await self.r.queue.stale_settings([_settings(row) for row in rows])
        return [row for row, behind in zip(rows, stale, strict=True) if behind]

    async def mirror_queues(self, env_id: str, names: Sequence[str] | None = None) -> None:
        """Mirror the environment's queues ``names`` (every queue of it when None: a restore of Redis)."""
        deployments = self.r.repo.deployments
        await self.mirror_queue_rows(await (deployments.list_queues(env_id) if names is None
                                            else deployments.queues_named(env_id, names)))

    async def trigger_many(self, requests: Sequence[TriggerRequest], *,
                           guard: InsertGuard | None = None) -> list[TriggeredRun]:
        """Create runs: one insert for all of them, then one enqueue for those that can run.

        A request whose idempotency key (environment, task, key) is held by a run whose key has
        not expired gets that run back (``is_cached``) and creates nothing. Delayed runs are
        DELAYED until an engine job enqueues them; runs with a TTL get an engine job that expires
        them if they have not started by then. ``guard`` is run in the insert's transaction, before
        it (a statement of its own, not shared with other callers' runs): what it raises leaves
        nothing made and is raised."""
        now = self.r.clock.now()
        new_runs: list[NewRun] = []
        items: list[EnqueueItem] = []
        item_requests: list[TriggerRequest] = []
        results: list[TriggeredRun] = []
        jobs: list[engine_jobs.JobSpec] = []
        keyed: dict[str, list[tuple[str, str, str | None]]] = {}
        for req in requests:
            if req.debounce is not None:
                raise ValidationError("debounce", "this way of triggering does not debounce")
            run, item, run_jobs, result = await self._prepare(req, now)
            if req.idempotency_key is not None:
                keyed.setdefault(req.env_id, []).append((req.task_id, req.idempotency_key, req.batch_id))
            new_runs.append(run)
            if item is not None:
                items.append(item)
                item_requests.append(req)
            jobs += run_jobs
            results.append(result)
        try:
            await self._check_queue_length(items)
        except QueueFullError:
            # a request whose idempotency key a run holds creates nothing: a client repeating its
            # trigger while the queue is full gets that run back, not a 429
            await self._check_queue_length(await self._not_held(items, item_requests, now))
        for env_id, keys in keyed.items():
            await self.r.repo.runs.release_expired_idempotency_keys(env_id, keys, datetime.fromtimestamp(now, UTC))
        inserted = (await self.r.insert_runs(new_runs) if guard is None
                    else await self.r.repo.runs.insert_runs(new_runs, guard=guard))
        if len(inserted) < len(new_runs):
            results, items, jobs, new_runs = await self._cached(requests, new_runs, results, inserted, items, jobs,
                                                                retake=guard is None)
        try:
            if jobs:
                await self.r.change_jobs(schedule=jobs)
            await self.r.enqueue_items(items)
        except Exception:
            # The runs are stored (PostgreSQL is the record); answering with an error now would
            # make a retrying client create them twice. The reconciler enqueues QUEUED runs that
            # the queue does not know, and due DELAYED runs whose job is missing.
            log.warning("runs %s stored but not (all) enqueued; the reconciler will enqueue them",
                        [r.id for r in new_runs][:10], exc_info=True)
        for run, result in zip(new_runs, results, strict=False):
            if result.is_cached:
                continue
            self.r.events.emit(RunEvent("run_created", run.id, run.env_id, run.snapshot_id,
                                        {"status": result.status, "task": run.task_id}, attempt=0))
            if result.status == RunStatus.PENDING_VERSION:
                self.r.events.emit(RunEvent("run_pending_version", run.id, run.env_id, run.snapshot_id,
                                            {"task": run.task_id}, attempt=0))
        return results

    async def check(self, req: TriggerRequest) -> None:
        """Refuse now what :meth:`_prepare` would refuse (bad input, an unknown worker group), without
        creating any run: a batch whose last item is refused must not have made its first ones. Its
        queue is made if missing (as its trigger would: a queue is only settings), so that one past
        the environment's cap (``too_many_queues``) is refused now too."""
        self._validate(req)
        group_id = await self.worker_group(await self.environment(req.env_id), req)
        task = await self._task(req, group_id)
        await self._ensure_queue(req.env_id, req.queue or task.queue or f"task/{req.task_id}",
                                 req.queue_concurrency_limit)

    async def create_debounced(self, req: TriggerRequest, deadline: datetime) -> TriggeredRun | None:
        """Create the DELAYED run of a debounced trigger (``req.delay_until`` in the future) that
        later triggers with its key may push back to ``deadline`` at most. Its insert is a statement
        of its own that gives way to every unique index: None when a run holds the idempotency key
        or a DELAYED run the debounce key (a concurrent trigger won; the caller looks again)."""
        if req.debounce is None:
            raise ValidationError("debounce", "is required here")
        now = self.r.clock.now()
        run, _, jobs, result = await self._prepare(req, now)
        if result.status != RunStatus.DELAYED:
            raise ValidationError("debounce.delay", "must be in the future")
        run = dataclasses.replace(run, debounce_key=req.debounce.key, debounce_deadline=deadline)
        if not await self.r.repo.runs.insert_runs([run], debounced=True):
            return None
        try:
            await self.r.change_jobs(schedule=jobs)
        except Exception:  # stored: the reconciler re-arms the delay of a run not started
            log.warning("run %s stored but its delay job not armed; the reconciler will arm it", run.id, exc_info=True)
        self.r.events.emit(RunEvent("run_created", run.id, run.env_id, run.snapshot_id,
                                    {"status": result.status, "task": run.task_id}, attempt=0))
        return result

    async def _prepare(self, req: TriggerRequest, now: float,
                       ) -> tuple[NewRun, EnqueueItem | None, list[engine_jobs.JobSpec], TriggeredRun]:
        """The run a request creates, its queue item (QUEUED runs only), its engine jobs (delay,
        TTL) and the answer to give once it is stored."""
        self._validate(req)
        jobs: list[engine_jobs.JobSpec] = []
        env = await self.environment(req.env_id)
        group_id = await self.worker_group(env, req)
        task = await self._task(req, group_id)
        queue = req.queue or task.queue or f"task/{req.task_id}"
        await self._ensure_queue(req.env_id, queue, req.queue_concurrency_limit)
        runnable = task.deployment_id is not None
        delayed = req.delay_until is not None and req.delay_until.timestamp() > now
        if delayed:
            engine_status, status = ExecutionStatus.DELAYED, RunStatus.DELAYED
        elif runnable:
            engine_status, status = ExecutionStatus.QUEUED, RunStatus.QUEUED
        else:
            engine_status, status = ExecutionStatus.PENDING_VERSION, RunStatus.PENDING_VERSION
        priority_ms = int(req.priority_s * 1000)
        # a delayed run takes its place in the queue when it becomes due, not when triggered
        created = req.delay_until if delayed and req.delay_until else self._queue_timestamp(now)
        ttl_s = self._ttl(req.ttl_s)
        run_id = req.run_id or new_id("run")
        if delayed and req.delay_until is not None:
            jobs.append(engine_jobs.delayed(run_id, req.env_id, req.delay_until.timestamp()))
        if ttl_s is not None:
            start = req.delay_until.timestamp() if delayed and req.delay_until else now
            jobs.append(engine_jobs.ttl(run_id, req.env_id, start + ttl_s))
        run = NewRun(
            id=run_id,
            snapshot_id=new_id("snapshot"),
            env_id=req.env_id,
            worker_group_id=group_id,
            task_id=req.task_id,
            payload=req.payload,
            payload_type=req.payload_type,
            status=status,
            engine_status=engine_status,
            queue=queue,
            concurrency_key=req.concurrency_key,
            priority_ms=priority_ms,
            tags=req.tags,
            metadata=req.metadata,
            max_attempts=req.max_attempts,
            retry=req.retry,
            max_duration_s=req.max_duration_s,
            machine=req.machine,
            locked_to_deployment_id=task.deployment_id,
            locked_to_version=req.lock_to_version,
            parent_run_id=req.parent_run_id,
            root_run_id=req.root_run_id,
            depth=req.depth,
            batch_id=req.batch_id,
            batch_index=req.batch_index,
            trigger_function=req.trigger_function,
            resume_parent_on_completion=req.resume_parent_on_completion,
            ttl_s=None if ttl_s is None else int(ttl_s),
            delay_until=req.delay_until if delayed else None,
            idempotency_key=req.idempotency_key,
            idempotency_key_expires_at=(
                datetime.fromtimestamp(now + (DEFAULT_IDEMPOTENCY_TTL_S if req.idempotency_key_ttl_s is None
                                              else req.idempotency_key_ttl_s), UTC)
                if req.idempotency_key is not None else None),
            queue_timestamp=created,
            description=("Delayed until " + created.isoformat()) if delayed
            else "Run was created" if runnable else "No deployment has this task yet",
        )
        item = None
        if status == RunStatus.QUEUED:
            item = self.queue_item(run.id, req.env_id, queue, group_id, created.timestamp() * 1000,
                                   priority_ms, req.concurrency_key, req.task_id)
        return run, item, jobs, TriggeredRun(run.id, status, run.snapshot_id, queue)

    async def _cached(self, requests: Sequence[TriggerRequest], new_runs: list[NewRun], results: list[TriggeredRun],
                      inserted: set[str], items: list[EnqueueItem], jobs: list[Any], *, retake: bool = True,
                      ) -> tuple[list[TriggeredRun], list[EnqueueItem], list[Any], list[NewRun]]:
        """Requests whose idempotency key was taken: answer with the run that holds it, and
        enqueue or schedule nothing for them. A key let go between the insert that found it taken
        and the look-up of its holder (a reset; a holder whose TTL had passed, or was 0, released by
        another trigger) is free: those runs are inserted again (``retake``; not after an insert
        with a guard, which is its caller's to repeat), as the insert that found the key free would
        have. A key that keeps changing hands is a conflict of the moment (409: retry)."""
        inserted = set(inserted)
        lost = [(req, run) for req, run in zip(requests, new_runs, strict=True) if run.id not in inserted]
        existing: dict[tuple[str, str, str], RunRow] = {}
        for attempt in range(3):
            for env_id in {req.env_id for req, _ in lost}:
                found = await self.r.repo.runs.runs_by_idempotency_key(
                    env_id, [(req.task_id, req.idempotency_key or "") for req, _ in lost if req.env_id == env_id])
                existing.update({(env_id, *k): v for k, v in found.items()})
            free = [run for req, run in lost if (req.env_id, req.task_id, req.idempotency_key or "") not in existing]
            if not free:
                break
            if not retake or attempt == 2:
                raise ConflictError("idempotency_key", "the key changed hands while this run was triggered; retry")
            inserted |= await self.r.insert_runs(free)
            lost = [(req, run) for req, run in lost if run.id not in inserted]
        out: list[TriggeredRun] = []
        for req, run, result in zip(requests, new_runs, results, strict=True):
            if run.id in inserted:
                out.append(result)
                continue
            holder = existing[(req.env_id, req.task_id, req.idempotency_key or "")]
            out.append(TriggeredRun(holder.id, RunStatus(holder.status), "", holder.queue, is_cached=True))
        keep = {r.id for r in new_runs if r.id in inserted}
        return (out, [i for i in items if i.run_id in keep], [j for j in jobs if j[2]["run_id"] in keep],
                new_runs)

    async def _not_held(self, items: Sequence[EnqueueItem], requests: Sequence[TriggerRequest],
                        now: float) -> list[EnqueueItem]:
        """The items whose requests' idempotency keys no run holds (unexpired) now."""
        keyed: dict[str, list[tuple[str, str]]] = {}
        for req in requests:
            if req.idempotency_key is not None:
                keyed.setdefault(req.env_id, []).append((req.task_id, req.idempotency_key))
        held: set[tuple[str, str, str]] = set()
        for env_id, keys in keyed.items():
            found = await self.r.repo.runs.runs_by_idempotency_key(env_id, keys, datetime.fromtimestamp(now, UTC))
            held |= {(env_id, task, key) for task, key in found}
        return [item for item, req in zip(items, requests, strict=True)
                if (req.env_id, req.task_id, req.idempotency_key or "") not in held]

    async def _check_queue_length(self, items: Sequence[EnqueueItem]) -> None:
        """Refuse the whole call if it would take an environment past its maximum queue length (a
        soft limit: concurrent triggers may overshoot it by what they add at the same moment)."""
        adding: dict[str, int] = {}
        for item in items:
            adding[item.env_id] = adding.get(item.env_id, 0) + 1
        for env_id, n in adding.items():
            limit = self._envs[env_id].max_queue_length if env_id in self._envs else None
            if limit is None:
                continue
            queued = (await self.r.queue.env_stats(env_id)).queued
            if queued + n > limit:
                raise QueueFullError(env_id, queued, n, limit)

    def _ttl(self, ttl_s: float | None) -> float | None:
        """The run's TTL, in whole seconds (it is stored so): the one asked for, rounded down, at
        most ``max_ttl_s``. A TTL of 0 (or under a second) is none of the run's own, as in
        Trigger.dev, whose SDK and server drop a ttl of 0 (``stringifyDuration``): the run then
        has ``max_ttl_s``, the default, like a run triggered without one (it was expired at once)."""
        cap = self.r.settings.max_ttl_s
        if ttl_s is None or ttl_s < 1:
            return cap
        own = float(math.floor(ttl_s))
        return own if cap is None else min(own, cap)

    def _queue_timestamp(self, now: float) -> datetime:
        """``now`` with microseconds, strictly increasing in this process, so that runs
        triggered in the same millisecond (or one batch) keep their order in the queue."""
        micros = max(int(now * 1_000_000), self._last_micros + 1)
        self._last_micros = micros
        return datetime.fromtimestamp(micros / 1_000_000, UTC)

    @staticmethod
    def queue_item(run_id: str, env_id: str, queue: str, worker_group_id: str, queued_at_ms: float,
                   priority_ms: int, concurrency_key: str | None, task: str,
                   available_at_ms: int | None = None, reset_deliveries: bool = False) -> EnqueueItem:
        return EnqueueItem(
            run_id=run_id, env_id=env_id, queue=queue, worker_group=worker_group_id,
            score_ms=queued_at_ms - priority_ms, available_at_ms=available_at_ms,
            concurrency_key=concurrency_key, task=task, reset_deliveries=reset_deliveries,
        )

    def item_for(self, run: RunRow, available_at_ms: int | None = None, *,
                 reset_deliveries: bool = False) -> EnqueueItem:
        """The queue item of an existing run; it keeps its original place (queue timestamp)."""
        queued = run.queue_timestamp or run.created_at
        return self.queue_item(run.id, run.env_id, run.queue, run.worker_group_id,
                               queued.timestamp() * 1000, run.priority_ms, run.concurrency_key,
                               run.task_id, available_at_ms, reset_deliveries)

    def _validate(self, req: TriggerRequest) -> None:
        if not req.task_id or len(req.task_id) > 128:
            raise ValidationError("task_id", "must be 1..128 characters")
        if req.queue is not None and (not req.queue or len(req.queue) > 128):
            raise ValidationError("queue", "must be 1..128 characters")
        if req.idempotency_key is not None and not 1 <= len(req.idempotency_key) <= MAX_IDEMPOTENCY_KEY_CHARS:
            # an empty key would be one more key, that the reset endpoint cannot name
            raise ValidationError("idempotency_key", f"must be 1..{MAX_IDEMPOTENCY_KEY_CHARS} characters")
        if req.priority_s < 0:
            raise ValidationError("priority_s", "must be >= 0")
        if req.ttl_s is not None and not req.ttl_s >= 0:
            raise ValidationError("ttl_s", "must be >= 0")
        if req.max_attempts is not None and req.max_attempts < 1:
            raise ValidationError("max_attempts", "must be >= 1")
        if len(req.tags) > 10:
            raise ValidationError("tags", "at most 10 tags")
