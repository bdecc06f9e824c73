"""RunEngine: composes the systems over one SystemResources; the engine's public methods.

The facade holds no logic of its own: every method delegates to one system.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis

from run_engine import heap
from run_engine.batching import Batcher
from run_engine.clock import Clock, SystemClock
from run_engine.db.bulk_actions import BulkAction
from run_engine.db.deployments import CronSpec, QueueSpec, RateLimitSpec, TaskQueue, TaskSpec, queue_type
from run_engine.db.packets import UploadedPacket
from run_engine.db.repository import Repository
from run_engine.db.runs import PAGE_BYTES, BatchView, RunPackets, RunRow, ShapeRead, Snapshot
from run_engine.db.schedules import Schedule
from run_engine.db.tenancy import Environment, GroupListing, WorkerGroup, WorkerView
from run_engine.db.waitpoints import BatchItemError, BatchRecord, JournalEntry, JournalPage, SweepCursors, Waitpoint
from run_engine.errors import NotFoundError
from run_engine.events import EventBus, RunEvent
from run_engine.ids import new_id
from run_engine.jobs import Job, JobQueue, JobWorker
from run_engine.leader import LeaderLease, default_duty_timeout
from run_engine.locking import RunLocker
from run_engine.metadata_ops import MAX_OPERATIONS as MAX_METADATA_OPERATIONS
from run_engine.metadata_ops import MetadataOp, parse_op
from run_engine.redis_connect import close_fully
from run_engine.redis_connect import connect as connect_redis
from run_engine.run_queue import Handed, QueueStats, RunQueue
from run_engine.settings import EngineSettings
from run_engine.statuses import RunStatus
from systems import engine_jobs as J
from systems.bulk_actions import RunFilter, replay_request
from systems.dead_letter import DeadRun
from systems.dequeue import DequeuedRun
from systems.enqueue import DEFAULT_IDEMPOTENCY_TTL_S, Debounce, TriggeredRun, TriggerRequest
from systems.explain import Explanation
from systems.reconciler import RECONCILE_TIMEOUT_S
from systems.registry import Systems
from systems.resources import SystemResources
from systems.run_attempt import AttemptOutcome, StartedAttempt
from systems.waiting_for_worker import Deployed, Promoted
from systems.waitpoints import BlockOutcome, ResolvedJournal, WaitpointsSystem, is_batch_entry

__all__ = ["RunEngine", "TriggerRequest", "Debounce", "TriggeredRun", "DeadRun", "DequeuedRun", "StartedAttempt",
           "AttemptOutcome", "RunRow", "Snapshot", "Waitpoint", "JournalEntry", "QueueStats", "BlockOutcome",
           "Explanation", "Environment", "WorkerGroup", "TaskQueue", "Schedule", "TaskSpec", "QueueSpec", "CronSpec",
           "RateLimitSpec", "Deployed", "Promoted", "queue_type", "BatchView", "WorkerView", "BulkAction", "RunFilter",
           "GroupListing", "RunPackets", "UploadedPacket", "BatchRecord", "BatchItemError", "ShapeRead", "PACKET_TTL_S",
           "PACKET_BYTES_PER_ENV", "PACKET_MIN_BYTES", "is_batch_entry", "JournalPage", "ResolvedJournal", "MetadataOp",
           "parse_op", "MAX_METADATA_OPERATIONS"]

#: how long a packet uploaded for a trigger is kept (the trigger reads it at once; a retried one later)
PACKET_TTL_S = 3600.0
#: what an environment's uploaded packets waiting for their triggers may take in all
PACKET_BYTES_PER_ENV = 256 * 1024 * 1024
#: what an uploaded packet counts as at least (the SDK uploads those of 128 KiB or more): at most
#: 4,096 packets an environment, whose sizes each upload adds up
PACKET_MIN_BYTES = 64 * 1024


#: how long a stop lets the grouped writes and reads under way end before it cancels them
BATCH_DRAIN_S = 10.0

class RunEngine:
    def __init__(self, resources: SystemResources, redis: aioredis.Redis, *, run_jobs: bool = True) -> None:
        self.resources = resources
        self.systems = Systems.build(resources)
        self.redis = redis
        self.events = resources.events
        self.jobs = JobWorker(
            resources.jobs,
            {J.HEARTBEAT: self._on_heartbeat_job, J.MAX_DURATION: self._on_max_duration_job,
             J.WAITPOINT_DATETIME: self._on_datetime_job, J.WAITPOINT_TIMEOUT: self._on_timeout_job,
             J.WAITPOINT_SWEEP: self._on_sweep_job, J.DELAYED: self._on_delayed_job, J.TTL: self._on_ttl_job,
             J.BULK_ACTION: self._on_bulk_action_job, J.CONTINUE_BLOCKED: self._on_continue_blocked_job,
             J.PROMOTE_PENDING: self._on_promote_pending_job, J.CANCEL_CASCADE: self._on_cancel_cascade_job},
            concurrency=resources.settings.job_concurrency,
            poll_interval_s=resources.settings.job_poll_interval_s,
        )
        self._run_jobs = run_jobs
        self._lock_nodes: list[aioredis.Redis] = []  # the run locks' own Redis nodes (RUN_ENGINE_LOCK_REDIS_URLS)
        s = resources.settings
        self.leader = LeaderLease(resources.repo, ttl_s=s.lease_ttl_s, renew_s=s.lease_renew_s)
        # each run bounded (leader.py): rearm jobs (budgeted scans, ~1 s) 10 min, retention (20 s of
        # deleting runs a pass, then batches and expired packets) 50 min; a reconcile pass after Redis
        # lost its data reads everything, so its own bound (RECONCILE_TIMEOUT_S)
        self.leader.add_duty("reconcile", s.reconcile_interval_s, self.systems.reconciler.reconcile,
                             timeout_s=max(RECONCILE_TIMEOUT_S, default_duty_timeout(s.reconcile_interval_s)))
        self.leader.add_duty("rearm jobs", s.rearm_interval_s, self.systems.reconciler.rearm_jobs)
        self.leader.add_duty("retention", s.retention_interval_s, self.systems.reconciler.retention)

    @classmethod
    async def create(
        cls, settings: EngineSettings, *, clock: Clock | None = None, run_jobs: bool = True,
    ) -> RunEngine:
        """Connect to PostgreSQL and Redis (``settings.database_url`` / ``redis_url``) and start
        the background job worker unless ``run_jobs`` is False (tests drive it step by step). Sets
        the process's young garbage collections to ``settings.gc_threshold`` (run_engine/heap.py)."""
        heap.tune(settings.gc_threshold)
        clock = clock or SystemClock()
        # A standalone server or a cluster, whichever REDIS_URL names; a connect gives up after
        # 5 s (Redis down later: the API answers 503, never hangs).
        redis = await connect_redis(settings.redis_url)
        try:
            repo = await Repository.open(settings.database_url, min_size=settings.db_pool_min,
                                         max_size=settings.db_pool_max)
        except BaseException:
            await close_fully(redis)  # a cancelled start (a stop signal) leaves no socket open
            raise
        queue = RunQueue(redis, prefix=f"{settings.key_prefix}:q", shards=settings.queue_shards,
                         max_deliveries=settings.max_deliveries, default_env_limit=settings.env_concurrency)
        # RedLock over independent nodes when configured (a lock needs a majority); else REDIS_URL
        lock_nodes = [aioredis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0)
                      for url in settings.lock_redis_urls]
        locker = RunLocker(lock_nodes or [redis], prefix=settings.key_prefix)
        jobs = JobQueue(redis, prefix=f"{settings.key_prefix}:jobs", clock=clock)
        resources = SystemResources(repo=repo, queue=queue, locker=locker, jobs=jobs, events=EventBus(),
                                    clock=clock, settings=settings)
        engine = cls(resources, redis, run_jobs=run_jobs)
        engine._lock_nodes = lock_nodes
        try:
            await queue.load_scripts()
            await engine.start()
        except BaseException:  # a failed or cancelled start (Ctrl-C at start-up) leaves nothing running
            await asyncio.shield(engine.close())
            raise
        return engine

    async def start(self) -> None:
        await self.resources.locker.start()
        if self._run_jobs:
            # armed if missing only: the sweep job carries where its walk stands, which a start
            # (every deploy) must not take back to the beginning
            if await self.resources.jobs.missing([J.SWEEP_ID]):
                await self._schedule_sweep()
            await self.jobs.start()
            await self.leader.start()
            await self.systems.schedules.start()

    async def close(self) -> None:
        """Stop the background work, then close PostgreSQL and Redis: each step runs whatever the
        ones before it raised (a stop cut short must not leave the pools open)."""
        errors: list[BaseException] = []
        for step in (self.systems.schedules.stop, self.leader.stop, self.jobs.stop, self.resources.locker.stop,
                     self._drain_batches, self.resources.repo.close, self.redis.aclose,
                     *(n.aclose for n in self._lock_nodes)):
            try:
                await step()
            except BaseException as exc:  # noqa: PERF203 (a handful of steps)
                errors.append(exc)
        if errors:
            raise errors[0]

    async def _drain_batches(self) -> None:
        """The grouped writes and reads under way end before the pools they use are closed (a
        server's stop cancels the requests that were waiting on them, not the flushes)."""
        owners = (self.resources, self.resources.locker, self.jobs.queue, self.systems.waitpoints)
        batchers = [b for owner in owners for b in vars(owner).values() if isinstance(b, Batcher)]
        await asyncio.gather(*(b.drain(BATCH_DRAIN_S) for b in batchers))

    # --- runs ---------------------------------------------------------------------------------

    async def trigger(self, request: TriggerRequest) -> TriggeredRun:
        return (await self.systems.debounce.trigger_many([request]))[0]

    async def trigger_many(self, requests: Sequence[TriggerRequest]) -> list[TriggeredRun]:
        """Create runs; requests with ``debounce`` join their key's DELAYED run when there is one."""
        return await self.systems.debounce.trigger_many(requests)

    async def trigger_each(self, requests: Sequence[TriggerRequest]) -> list[TriggeredRun | Exception]:
        """:meth:`trigger_many`, a debounced request that fails after the others' runs were made
        answered by its error in its place (a refusal found before any run is made still raises)."""
        return await self.systems.debounce.trigger_each(requests)

    async def check_trigger(self, request: TriggerRequest) -> None:
        """Raise what :meth:`trigger_many` would refuse the request for (bad input, an unknown
        worker group, a queue past the environment's cap), creating no run."""
        await self.systems.debounce.check(request)

    def new_batch_id(self) -> str:
        return new_id("batch")

    async def open_batch(self, env_id: str, size: int, idempotency_key: str | None = None,
                         idempotency_key_ttl_s: float | None = None, *,
                         two_phase: bool = True, made_by: str | None = None) -> tuple[str, int, bool]:
        """A batch, whose runs are triggered later (Trigger.dev's two-phase batch, or a one-request
        batch's, ``two_phase`` False): (id, expected size, whether the idempotency key had made it
        before and has not expired: default 30 days, as a run's). ``made_by``: the identity of the
        credential making it, kept on its row (:attr:`BatchRecord.made_by`)."""
        now = self.now()
        expires = (datetime.fromtimestamp(now + (DEFAULT_IDEMPOTENCY_TTL_S if idempotency_key_ttl_s is None
                                                 else idempotency_key_ttl_s), UTC)
                   if idempotency_key is not None else None)
        return await self.resources.repo.waitpoints.open_batch(new_id("batch"), env_id, size, idempotency_key,
                                                               expires_at=expires, now=datetime.fromtimestamp(now, UTC),
                                                               two_phase=two_phase, made_by=made_by)

    async def open_batch_items(self, env_id: str, batch_id: str) -> tuple[int, set[int]] | None:
        """A batch of the environment that takes items: its expected size and the indexes of the
        items triggered so far; None for a run's batchTriggerAndWait batch or none."""
        return await self.resources.repo.waitpoints.open_batch_items(batch_id, env_id)

    async def batch_indexes_run(self, batch_id: str, indexes: Sequence[int]) -> set[int]:
        """Which of ``indexes`` of a streamed batch have a run of it, whatever their task or key (made
        by a stream that may have died before noting them)."""
        return await self.resources.repo.waitpoints.batch_indexes_run(batch_id, indexes) if indexes else set()

    async def reset_idempotency_key(self, env_id: str, task_id: str, key: str) -> bool:
        """Free an idempotency key of the task before its TTL, and the same key of the environment's
        batches; False when no run or batch holds it."""
        runs = await self.resources.repo.runs.reset_idempotency_key(env_id, task_id, key)
        return runs + await self.resources.repo.waitpoints.reset_batch_idempotency_key(env_id, key) > 0

    async def release_empty_batch_key(self, env_id: str, batch_id: str) -> bool:
        """Free the idempotency key of a batch that has no run (its request failed before making
        any), so that the key's retry makes a new batch; whether it was freed."""
        return await self.resources.repo.waitpoints.release_empty_batch_key(batch_id, env_id)

    async def runs_holding_keys(self, env_id: str, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], RunRow]:
        """The environment's runs holding these (task, idempotency key) pairs, keys not expired:
        the runs a trigger with them would be answered with."""
        if not keys:
            return {}
        return await self.resources.repo.runs.runs_by_idempotency_key(env_id, keys,
                                                                      datetime.fromtimestamp(self.now(), UTC))

    async def batch_record(self, env_id: str, batch_id: str) -> BatchRecord | None:
        """The environment's batch as it was made (expected size, idempotency key, parent run)."""
        return await self.resources.repo.waitpoints.batch_record(batch_id, env_id)

    async def note_batch_items(self, batch_id: str, indexes: Sequence[int],
                               failed: Mapping[int, BatchItemError] | None = None) -> int:
        """Record the triggered items of a two-phase batch, and those that failed on their own (each
        counts as sent and as finished; the first failure of an index not sent before is kept); how
        many of its indexes have been sent."""
        return await self.resources.repo.waitpoints.note_batch_items(batch_id, indexes, failed)

    async def trigger_batch(self, env_id: str, batch_id: str, requests: Sequence[TriggerRequest]) -> list[TriggeredRun]:
        """Record a batch and create its runs: one insert for the runs, one queue call."""
        await self.resources.repo.waitpoints.insert_batch(batch_id, env_id, len(requests))
        return await self.systems.debounce.trigger_many(requests)

    async def trigger_batch_each(self, env_id: str, batch_id: str,
                                 requests: Sequence[TriggerRequest]) -> list[TriggeredRun | Exception]:
        """:meth:`trigger_batch`, a debounced request that fails after the others' runs were made
        answered by its error in its place (:meth:`trigger_each`)."""
        await self.resources.repo.waitpoints.insert_batch(batch_id, env_id, len(requests))
        return await self.systems.debounce.trigger_each(requests)

    async def dequeue(self, worker_group_id: str, max_runs: int = 1, worker_id: str | None = None,
                      environments: Sequence[str] = (), deployments: Sequence[str] = (),
                      start: bool = False) -> Handed:
        """Runs of the group for a worker (only of ``environments`` when given; only of tasks its
        ``deployments`` have when given); with ``start``, their attempts started in the same
        transaction (each :class:`DequeuedRun`'s ``started``)."""
        return await self.systems.dequeue.dequeue(worker_group_id, max_runs, worker_id, environments, deployments,
                                                  start)

    async def start_attempt(self, run_id: str, snapshot_id: str, worker_id: str | None = None) -> StartedAttempt:
        return await self.systems.run_attempt.start_attempt(run_id, snapshot_id, worker_id)

    async def complete_attempt(self, run_id: str, snapshot_id: str, *, ok: bool, output: Any = None,
                               error: dict[str, Any] | None = None, retryable: bool | None = None) -> AttemptOutcome:
        return await self.systems.run_attempt.complete_attempt(run_id, snapshot_id, ok=ok, output=output,
                                                               error=error, retryable=retryable)

    async def heartbeat(self, run_id: str, snapshot_id: str) -> None:
        await self.systems.execution_snapshot.heartbeat(run_id, snapshot_id)

    async def replay(self, run: RunRow) -> TriggeredRun:
        """A new run with the task, payload and options of ``run`` (the metadata it was triggered with)."""
        seeds = await self.resources.repo.runs.seed_metadata([run.id])
        return await self.trigger(replay_request(run, seed=seeds[run.id]) if run.id in seeds else replay_request(run))

    async def create_bulk_action(self, env_id: str, kind: str, run_filter: RunFilter,
                                 idempotency_key: str | None = None, name: str | None = None,
                                 ) -> tuple[BulkAction, bool]:
        """Cancel or replay (``kind``) every run matching ``run_filter``, a page at a time in the
        background; the same ``idempotency_key`` answers with the action it made before (and True)."""
        return await self.systems.bulk_actions.create(env_id, kind, run_filter, idempotency_key, name)

    async def bulk_action(self, env_id: str, action_id: str) -> BulkAction | None:
        """An action of the environment with its progress."""
        return await self.systems.bulk_actions.get(env_id, action_id)

    async def list_bulk_actions(self, env_id: str, limit: int,
                                after: tuple[datetime, str] | None = None) -> list[BulkAction]:
        """The environment's bulk actions, newest first."""
        return await self.systems.bulk_actions.page(env_id, limit, after)

    async def abort_bulk_action(self, env_id: str, action_id: str) -> BulkAction | None:
        """Stop an action under way (ABORTED); the action as it is then, or None."""
        return await self.systems.bulk_actions.abort(env_id, action_id)

    async def cancel(self, run_id: str) -> RunStatus:
        return await self.systems.cancel.cancel(run_id)

    async def reschedule(self, env_id: str, run_id: str, delay_until: datetime) -> RunRow:
        return await self.systems.delayed_runs.reschedule(run_id, env_id, delay_until)

    async def redrive(self, env_id: str, run_id: str) -> str:
        return await self.systems.dead_letter.redrive(env_id, run_id)

    async def redrive_all(self, env_id: str, tasks: Collection[str] = (), queues: Collection[str] = (),
                          after: str | None = None) -> tuple[int, str | None]:
        """Redrive matching dead-lettered runs, a bounded part of the DLQ a call: (how many, the
        cursor to go on from or None)."""
        return await self.systems.dead_letter.redrive_all(env_id, tasks, queues, after)

    async def list_dead(self, env_id: str, size: int, after: str | None = None, tasks: Collection[str] = (),
                        queues: Collection[str] = ()) -> tuple[list[DeadRun], str | None]:
        """A page of the DLQ and the cursor of the next one (None: the last page); see
        :meth:`DeadLetterSystem.list_dead`."""
        return await self.systems.dead_letter.list_dead(env_id, size, after, tasks, queues)

    async def get_run(self, run_id: str, env_id: str | None = None, *, light: bool = False) -> RunRow | None:
        """The run (of the environment, when one is given); ``light``: without payload, output,
        metadata and error."""
        return await self.resources.repo.runs.get_run(run_id, env_id, light=light)

    async def shape_runs(self, env_id: str, *, tags: Sequence[str] = (), tasks: Sequence[str] = (),
                         batches: Sequence[str] = (), ids: Sequence[str] = (), limit: int,
                         created_from: datetime | None = None, updated_after: datetime | None = None) -> ShapeRead:
        """A realtime shape's runs, light, with what tells a late commit apart: see
        :meth:`RunRepository.shape_runs`. Like every read of many runs or tokens here, bounded by
        ``costly_read_timeout_s`` (ReadTimeoutError past it)."""
        return await self.resources.repo.runs.shape_runs(env_id, tags=tags, tasks=tasks, batches=batches, ids=ids,
                                                         limit=limit, created_from=created_from,
                                                         updated_after=updated_after, timeout_s=self._read_bound)

    async def put_packet(self, env_id: str, path: str, content_type: str, data: str) -> bool:
        """Keep a packet a client uploaded for a trigger to name (``application/store``) for
        :data:`PACKET_TTL_S`; False when the environment's waiting packets would pass
        :data:`PACKET_BYTES_PER_ENV` (each counted as :data:`PACKET_MIN_BYTES` at least)."""
        return await self.resources.repo.packets.put(env_id, path, content_type, data, PACKET_TTL_S,
                                                     PACKET_BYTES_PER_ENV, PACKET_MIN_BYTES)

    async def uploaded_packets(self, env_id: str, paths: Sequence[str]) -> dict[str, UploadedPacket]:
        """The environment's unexpired uploaded packets among ``paths``, by path."""
        return await self.resources.repo.packets.get_many(env_id, paths)

    async def packet_text(self, env_id: str, run_id: str, field: str) -> str | None:
        """The run's ``payload`` or ``output`` as JSON text (None: it has none)."""
        return await self.resources.repo.runs.packet_text(env_id, run_id, field)

    async def run_packets(self, env_id: str, run_ids: Sequence[str], *, item_bytes: int, budget_bytes: int,
                          answer_bytes: int, skip: Collection[str] = ()) -> tuple[dict[str, RunPackets], int]:
        """The payload, output, metadata and error of the first runs that an answer bounded in
        bytes holds, and how many runs that is: see :meth:`RunRepository.run_packets`."""
        return await self.resources.repo.runs.run_packets(env_id, run_ids, item_bytes=item_bytes,
                                                          budget_bytes=budget_bytes, answer_bytes=answer_bytes,
                                                          skip=skip, timeout_s=self._read_bound)

    async def latest_snapshot(self, run_id: str) -> Snapshot:
        return await self.systems.execution_snapshot.latest(run_id)

    async def latest_snapshot_since(self, run_id: str, snapshot_id: str) -> tuple[Snapshot, bool]:
        """The latest snapshot, and whether it continues the execution that held ``snapshot_id``
        (see :meth:`ExecutionSnapshotSystem.latest_since`)."""
        return await self.systems.execution_snapshot.latest_since(run_id, snapshot_id)

    async def snapshots(self, run_id: str) -> list[Snapshot]:
        return await self.resources.repo.runs.snapshots(run_id)

    async def list_runs(self, env_id: str, *, statuses: Sequence[str] = (), tasks: Sequence[str] = (),
                        tags: Sequence[str] = (), queues: Sequence[str] = (), batches: Sequence[str] = (),
                        limit: int = 25, after: tuple[datetime, str] | None = None,
                        created_from: datetime | None = None, created_to: datetime | None = None,
                        updated_after: datetime | None = None, light: bool = False) -> list[RunRow]:
        """Newest first; ``after`` is the (created_at, id) of the last run of the previous page;
        ``light``: without payload, output, metadata and error."""
        return await self.resources.repo.runs.list_runs(env_id, statuses=statuses, tasks=tasks, tags=tags,
                                                        queues=queues, batches=batches, limit=limit, after=after,
                                                        created_from=created_from, created_to=created_to,
                                                        updated_after=updated_after, light=light,
                                                        timeout_s=self._read_bound)

    async def page_runs(self, env_id: str, *, limit: int, max_bytes: int = PAGE_BYTES, statuses: Sequence[str] = (),
                        tasks: Sequence[str] = (), tags: Sequence[str] = (), queues: Sequence[str] = (),
                        batches: Sequence[str] = (), after: tuple[datetime, str] | None = None,
                        created_from: datetime | None = None, created_to: datetime | None = None,
                        updated_after: datetime | None = None) -> tuple[list[RunRow], bool]:
        """Whole runs, newest first, fewer than ``limit`` when their payloads, outputs and metadata
        pass ``max_bytes``; and whether more match after the last of them."""
        return await self.resources.repo.runs.page_runs(
            env_id, limit=limit, max_bytes=max_bytes, statuses=statuses, tasks=tasks, tags=tags, queues=queues,
            batches=batches, after=after, created_from=created_from, created_to=created_to,
            updated_after=updated_after, timeout_s=self._read_bound)

    async def list_batches(self, env_id: str, limit: int = 50) -> list[BatchView]:
        return await self.resources.repo.runs.list_batches(env_id, limit, timeout_s=self._read_bound)

    @property
    def _read_bound(self) -> float | None:
        """The statement timeout of the reads whose cost a tenant's data decides (lists, shapes)."""
        return self.resources.settings.costly_read_timeout_s or None

    async def child_runs(self, run_id: str) -> list[str]:
        return await self.resources.repo.runs.child_runs(run_id)

    async def set_metadata(self, env_id: str, run_id: str, metadata: Any) -> None:
        await self.resources.repo.runs.set_metadata(run_id, metadata)
        self.resources.events.emit(RunEvent("run_updated", run_id, env_id, data={"what": "metadata"}))

    async def change_metadata(self, run: RunRow, operations: Sequence[MetadataOp],
                              parent_operations: Sequence[MetadataOp] = (),
                              root_operations: Sequence[MetadataOp] = (), *,
                              request: tuple[str, str] | None = None) -> dict[str, Any]:
        """Metadata operations on ``run`` and on its parent and root, in one transaction; the
        run's metadata after them (``systems/run_metadata.py``). ``request``: its idempotency key
        and the digest of its body (a request sent again is applied once)."""
        return await self.systems.run_metadata.change(run, operations, parent_operations, root_operations, request)

    async def add_tags(self, env_id: str, run_id: str, tags: Sequence[str], limit: int) -> list[str] | None:
        """Add tags (kept once, in order); ``None`` if the run would have more than ``limit``."""
        added = await self.resources.repo.runs.add_tags(run_id, tags, limit)
        if added is not None:
            self.resources.events.emit(RunEvent("run_updated", run_id, env_id, data={"what": "tags"}))
        return added

    async def explain(self, env_id: str, run_id: str) -> Explanation:
        return await self.systems.explain.explain(env_id, run_id)

    # --- the clock, settings, health ------------------------------------------------------------

    @property
    def settings(self) -> EngineSettings:
        return self.resources.settings

    def now(self) -> float:
        """The engine's clock (a fake one in tests), epoch seconds."""
        return self.resources.clock.now()

    async def ping(self, timeout_s: float = 2.0) -> dict[str, bool]:
        """Whether PostgreSQL and Redis each answer within ``timeout_s``."""
        async def answers(check: Awaitable[Any]) -> bool:
            try:
                await asyncio.wait_for(check, timeout_s)
            except Exception:
                return False
            return True

        pg, rd = await asyncio.gather(answers(self.resources.repo.ping()), answers(self.redis.ping()))
        return {"postgres": pg, "redis": rd}

    # --- credentials and workers ----------------------------------------------------------------

    async def environment(self, env_id: str) -> Environment | None:
        return await self.resources.repo.tenancy.environment(env_id)

    async def environment_by_key_hash(self, key_hash: str) -> Environment | None:
        return await self.resources.repo.tenancy.environment_by_key_hash(key_hash)

    async def worker_group_by_token_hash(self, token_hash: str) -> WorkerGroup | None:
        return await self.resources.repo.tenancy.worker_group_by_token_hash(token_hash)

    async def environments_of_worker_group(self, worker_group_id: str) -> list[Environment]:
        return await self.resources.repo.tenancy.environments_of_worker_group(worker_group_id)

    async def connect_worker_instance(self, worker_group_id: str, name: str, concurrency: int | None = None) -> str:
        """Record (or refresh) a worker instance by name; returns its id."""
        return await self.resources.repo.tenancy.upsert_worker_instance(new_id("wi"), worker_group_id, name,
                                                                        concurrency)

    async def worker_groups(self, env_id: str) -> list[GroupListing]:
        """The worker groups runs of the environment may be sent to (``workerGroup``), with instances."""
        return await self.resources.repo.tenancy.routable_worker_groups(env_id)

    async def workers(self, env_id: str) -> list[WorkerView]:
        """The worker groups serving an environment, their instances and current deployment."""
        return await self.resources.repo.tenancy.workers_of_environment(env_id)

    async def touch_worker_instance(self, worker_group_id: str, name: str) -> bool:
        """A heartbeat of a worker instance; False when it is not known (connect it)."""
        return await self.resources.repo.tenancy.touch_worker_instance(worker_group_id, name)

    # --- waitpoints --------------------------------------------------------------------------

    @property
    def waitpoints(self) -> WaitpointsSystem:
        """The WaitpointsSystem: tokens, blocking, continuing, suspending, the journal."""
        return self.systems.waitpoints

    async def create_token(self, env_id: str, *, idempotency_key: str | None = None,
                           idempotency_key_ttl_s: float | None = None, timeout_s: float | None = None,
                           tags: Sequence[str] = ()) -> tuple[Waitpoint, bool]:
        """A MANUAL waitpoint (a token) and whether the idempotency key returned an existing one."""
        return await self.systems.waitpoints.create_token(env_id, idempotency_key=idempotency_key,
                                                          idempotency_key_ttl_s=idempotency_key_ttl_s,
                                                          timeout_s=timeout_s, tags=tags)

    async def create_datetime_waitpoint(self, env_id: str, at: datetime, *,
                                        idempotency_key: str | None = None) -> Waitpoint:
        return await self.systems.waitpoints.create_datetime(env_id, at, idempotency_key=idempotency_key)

    async def get_waitpoint(self, waitpoint_id: str, env_id: str | None = None) -> Waitpoint | None:
        return await self.systems.waitpoints.get(waitpoint_id, env_id)

    async def list_tokens(self, env_id: str, *, statuses: Sequence[str] = (), timed_out: bool | None = None,
                          tags: Sequence[str] = (), idempotency_key: str | None = None,
                          created_from: datetime | None = None, created_to: datetime | None = None,
                          limit: int = 25, after: tuple[datetime, str] | None = None) -> tuple[list[Waitpoint], bool]:
        """Tokens newest first, fewer than ``limit`` when their outputs pass PAGE_BYTES; and
        whether more follow."""
        return await self.resources.repo.waitpoints.list_tokens(
            env_id, statuses=statuses, timed_out=timed_out, tags=tags, idempotency_key=idempotency_key,
            created_from=created_from, created_to=created_to, limit=limit, after=after, timeout_s=self._read_bound)

    async def run_waitpoint(self, env_id: str, run_id: str, waiter_id: str | None = None) -> Waitpoint:
        """The RUN waitpoint of a run of the environment (made on demand; NotFoundError otherwise).
        ``waiter_id``: the run about to wait on it; if that is the run itself or descends from it
        (the run finishes only after the wait), a waitpoint of its own, completed at once with a
        ``WAIT_DEADLOCK`` error, so that the wait ends instead of blocking for ever."""
        return await self.systems.waitpoints.run_waitpoint(env_id, run_id, waiter_id)

    async def complete_waitpoint(self, waitpoint_id: str, output: Any = None, *, is_error: bool = False,
                                 env_id: str | None = None) -> bool:
        """Complete a waitpoint; False when it was complete already (the first output stays). With
        ``env_id``, only a token (MANUAL) of that environment: False for any other waitpoint."""
        return await self.systems.waitpoints.complete(waitpoint_id, output, is_error=is_error, env_id=env_id)

    async def blocking_waitpoints(self, run_id: str) -> list[Waitpoint]:
        """The pending waitpoints a run waits on."""
        return await self.resources.repo.waitpoints.blocking(run_id)

    async def journal(self, run_id: str, from_sequence: int = 0) -> JournalPage:
        """A page of the run's journal as stored (see :func:`run_engine.db.runs.journal_page`)."""
        return await self.resources.repo.waitpoints.journal(run_id, from_sequence)

    async def resolved_journal(self, run_id: str, from_sequence: int = 0) -> ResolvedJournal:
        """A page of the run's journal as a replay reads it, and where the next page starts."""
        return await self.systems.waitpoints.resolved_journal(run_id, from_sequence)

    async def append_journal(self, run_id: str, snapshot_id: str, sequence: int, kind: str, key: str,
                             result: Any) -> None:
        await self.systems.waitpoints.append_journal(run_id, snapshot_id, sequence, kind, key, result)

    async def block(self, run_id: str, snapshot_id: str, *, sequence: int, kind: str, key: str,
                    waitpoint_ids: Sequence[str], result: Any = None, suspend: bool = False,
                    env_id: str | None = None) -> BlockOutcome:
        """Block the executing run on waitpoints (journaled at ``sequence``); with ``suspend``,
        checkpoint it at once if it is blocked (``BlockOutcome.suspended``). With ``env_id``, the
        one waitpoint must be of that environment (else NotFoundError) and keys the entry."""
        return await self.systems.waitpoints.block(run_id, snapshot_id, sequence=sequence, kind=kind, key=key,
                                                   waitpoint_ids=waitpoint_ids, result=result, suspend=suspend,
                                                   env_id=env_id)

    async def trigger_and_wait(self, parent_run_id: str, snapshot_id: str, sequence: int,
                               requests: Sequence[TriggerRequest], *, batch: bool = False,
                               suspend: bool = False) -> tuple[list[str], BlockOutcome]:
        """Trigger children of an executing run and block it until they finish (one RUN
        waitpoint, or one BATCH waitpoint for ``batch``); journaled at ``sequence``."""
        parent = await self.resources.repo.runs.get_run(parent_run_id)
        if parent is None:
            raise NotFoundError("run", parent_run_id)
        children = [dataclasses.replace(r, parent_run_id=parent.id, root_run_id=parent.root_run_id or parent.id,
                                        depth=parent.depth + 1) for r in requests]
        return await self.systems.waitpoints.trigger_and_wait(parent, snapshot_id, sequence, children, batch=batch,
                                                              suspend=suspend)

    async def suspend(self, run_id: str, snapshot_id: str) -> Snapshot:
        return await self.systems.waitpoints.suspend(run_id, snapshot_id)

    # --- deployments and queues ---------------------------------------------------------------

    async def deploy(self, group: WorkerGroup, *, version: str | None, content_hash: str,
                     tasks: Sequence[TaskSpec], queues: Sequence[QueueSpec] = (),
                     environments: Sequence[str] = ()) -> list[Deployed]:
        """Register a worker's deployment in the environments its group serves (see the system)."""
        return await self.systems.waiting_for_worker.deploy(group, version=version, content_hash=content_hash,
                                                            tasks=tasks, queues=queues, environments=environments)

    async def register_deployment(self, *, env_id: str, worker_group_id: str, version: str, content_hash: str,
                                  tasks: Sequence[TaskSpec], queues: Sequence[QueueSpec] = ()) -> tuple[str, int]:
        """Register a deployment in one environment: (deployment id, waiting runs enqueued)."""
        return await self.systems.waiting_for_worker.register_deployment(
            env_id=env_id, worker_group_id=worker_group_id, version=version, content_hash=content_hash,
            tasks=tasks, queues=queues)

    async def promote_deployment(self, env_id: str, version: str, *,
                                 worker_group: str | None = None) -> list[Promoted]:
        """Make the environment's deployments of ``version`` current, in every worker group that
        has one (or in the group named ``worker_group``); [] when none has (see the system)."""
        return await self.systems.waiting_for_worker.promote_version(env_id, version, worker_group)

    async def pause_queue(self, env_id: str, queue: str) -> None:
        await self._set_queue_paused(env_id, queue, True)

    async def resume_queue(self, env_id: str, queue: str) -> None:
        await self._set_queue_paused(env_id, queue, False)

    async def _set_queue_paused(self, env_id: str, queue: str, paused: bool) -> None:
        """PostgreSQL first, then its row (with its settings' version) copied to Redis: a copy of an
        older row by another process (a trigger's) arriving later is ignored there; a copy that
        fails here is an error for the caller, and the reconciler copies the row again."""
        row = await self.resources.repo.deployments.set_queue_paused(env_id, queue, paused)
        if row is None:
            raise NotFoundError("queue", queue)
        await self.systems.enqueue.mirror_queue(row)

    async def task_queue(self, env_id: str, name: str) -> TaskQueue | None:
        return await self.resources.repo.deployments.task_queue(env_id, name)

    async def list_queues(self, env_id: str) -> list[TaskQueue]:
        return await self.resources.repo.deployments.list_queues(env_id)

    async def queue_by_id(self, env_id: str, queue_id: str) -> TaskQueue | None:
        return await self.resources.repo.deployments.queue_by_id(env_id, queue_id)

    async def queue_stats(self, env_id: str, name: str) -> QueueStats:
        return await self.resources.queue.queue_stats(env_id, name)

    async def queue_counts(self, env_id: str, names: Sequence[str]) -> list[tuple[int, int]]:
        """(queued, running) of each of the environment's queues ``names``, in one round trip."""
        return await self.resources.queue.queue_counts([(env_id, name) for name in names])

    async def set_queue_concurrency_override(self, env_id: str, queue: str, limit: int | None) -> TaskQueue:
        """Override a queue's deployed concurrency limit (``None`` resets it)."""
        row = await self.resources.repo.deployments.set_queue_override(env_id, queue, limit)
        if row is None:
            raise NotFoundError("queue", queue)
        await self.systems.enqueue.mirror_queue(row)
        return row

    # --- schedules ----------------------------------------------------------------------------

    async def upsert_schedule(self, env_id: str, *, task: str, cron: str, timezone: str = "UTC",
                              external_id: str | None = None, deduplication_key: str | None = None) -> Schedule:
        return await self.systems.schedules.upsert(env_id, task=task, cron=cron, timezone=timezone,
                                                   external_id=external_id, deduplication_key=deduplication_key)

    async def update_schedule(self, env_id: str, schedule_id: str, *, task: str, cron: str, timezone: str = "UTC",
                              external_id: str | None = None) -> Schedule:
        return await self.systems.schedules.update(env_id, schedule_id, task=task, cron=cron, timezone=timezone,
                                                   external_id=external_id)

    async def set_schedule_active(self, env_id: str, schedule_id: str, active: bool) -> Schedule:
        return await self.systems.schedules.set_active(env_id, schedule_id, active)

    async def get_schedule(self, schedule_id: str, env_id: str | None = None) -> Schedule | None:
        return await self.resources.repo.schedules.get(schedule_id, env_id)

    async def list_schedules(self, env_id: str, limit: int,
                             after: tuple[datetime, str] | None, offset: int = 0) -> list[Schedule]:
        return await self.resources.repo.schedules.page(env_id, limit, after, offset)

    async def count_schedules(self, env_id: str, after: tuple[datetime, str] | None = None) -> tuple[int, int]:
        """(schedules of the environment, how many come before ``after`` in list order)."""
        return await self.resources.repo.schedules.count(env_id, after)

    async def delete_schedule(self, schedule_id: str, env_id: str) -> bool:
        return await self.resources.repo.schedules.delete(schedule_id, env_id)

    # --- engine jobs --------------------------------------------------------------------------

    async def run_due_jobs(self) -> int:
        """Run every engine job that is due now (tests with a fake clock call this)."""
        return await self.jobs.run_due_once()

    async def _on_heartbeat_job(self, job: Job) -> None:
        await self.systems.run_attempt.on_heartbeat_timeout(job.payload["run_id"], job.payload["snapshot_id"],
                                                            graced=bool(job.payload.get("graced")))

    async def _on_delayed_job(self, job: Job) -> None:
        await self.systems.delayed_runs.enqueue_delayed(job.payload["run_id"])

    async def _on_ttl_job(self, job: Job) -> None:
        await self.systems.delayed_runs.expire(job.payload["run_id"])

    async def _on_datetime_job(self, job: Job) -> None:
        await self.systems.waitpoints.on_datetime(job.payload["waitpoint_id"])

    async def _on_timeout_job(self, job: Job) -> None:
        await self.systems.waitpoints.on_timeout(job.payload["waitpoint_id"])

    async def _schedule_sweep(self, cursors: SweepCursors | None = None) -> None:
        interval = self.resources.settings.waitpoint_sweep_interval_s
        cursors = cursors or SweepCursors()
        await self.resources.change_jobs(schedule=[J.sweep(self.resources.clock.now() + interval, cursors.runs,
                                                           cursors.waitpoints)])

    async def _on_sweep_job(self, job: Job) -> None:
        # where the last pass stopped (a job of an engine before the walks has no cursors: the start)
        given = job.payload
        cursors = SweepCursors(runs=str(given.get("runs_after") or ""),
                               waitpoints=str(given.get("waitpoints_after") or ""))
        try:
            _, cursors = await self.systems.waitpoints.sweep(self.resources.settings.batch_creation_grace_s, cursors)
        finally:
            await self._schedule_sweep(cursors)

    async def _on_continue_blocked_job(self, job: Job) -> None:
        waitpoints = job.payload["waitpoint_ids"]
        after = await self.systems.waitpoints.continue_page(waitpoints, job.payload["after"])
        if after is not None:
            await self.resources.change_jobs(schedule=[J.continue_blocked(waitpoints, after, job.lane, self.now())])

    async def _on_promote_pending_job(self, job: Job) -> None:
        p = job.payload
        if await self.systems.waiting_for_worker.promote_page(p["deployment_id"], p["env_id"], p["worker_group_id"]):
            await self.resources.change_jobs(schedule=[J.promote_pending(p["deployment_id"], p["env_id"],
                                                                         p["worker_group_id"], self.now())])

    async def _on_bulk_action_job(self, job: Job) -> None:
        bulk_id = job.payload["bulk_id"]
        if await self.systems.bulk_actions.run_page(bulk_id):
            lane = job.lane
            if not lane:  # a job of the version before lanes: the next page goes to its environment's
                action = await self.resources.repo.bulk_actions.get(bulk_id)
                lane = action.env_id if action is not None else ""
            await self.resources.change_jobs(schedule=[J.bulk_action(bulk_id, lane, self.now())])

    async def _on_cancel_cascade_job(self, job: Job) -> None:
        # a run deleted since (retention) has nothing left to cancel; any other error is tried again
        with contextlib.suppress(NotFoundError):
            await self.systems.cancel.cancel(job.payload["run_id"], again=True)

    async def _on_max_duration_job(self, job: Job) -> None:
        await self.systems.run_attempt.on_max_duration(job.payload["run_id"], job.payload["attempt"])
