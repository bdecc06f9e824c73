"""ReconcilerSystem and retention: the leader's housekeeping (DESIGN §6, §8).

PostgreSQL is the system of record; the Redis queue is rebuilt from it when they disagree:
* a run whose latest snapshot is QUEUED (or QUEUED_EXECUTING) but which the queue does not know
  (a Redis restart or flush) is enqueued again at its original place;
* such a run the queue holds as handed out although PostgreSQL never saw the dequeue (the process
  died between the two) is made ready again;
* such a run whose message says ready or delayed but which is in no set ("lost": a script that
  failed half-way) is enqueued again;
* a DELAYED run whose date passed long ago (its engine job was lost with Redis) is enqueued;
* a PENDING_VERSION run whose task the current deployment has (it was created from a stale cache
  while that deployment registered, after the registration promoted the runs waiting for it) is
  enqueued;
* a slot held by a run that is finished or suspended (its ack was lost) is freed;
* a queue whose settings in Redis are behind PostgreSQL's (a write to Redis that failed, or a
  process that died, after PostgreSQL's: a pause shown but not applied) is copied again: the queues
  changed lately, by their settings' version, and the next ``reconcile_budget`` of all of them;
* after Redis lost its data, the DLQ entries of the runs PostgreSQL shows dead-lettered are written
  again (``DeadLetterSystem.rebuild``): DLQ_BUDGET_FACTOR × ``reconcile_budget`` runs a pass, from
  the pass that finds the loss until through (and once more from the recheck a grace later).
Each scan reads at most ``reconcile_budget`` rows a pass and goes on where the previous pass
stopped (wrapping at the end), so a pass costs the same whatever the backlog; after Redis lost its
data a pass reads everything at once, and the first pass ``reconcile_grace_s`` later reads it all
again (the runs touched within the grace before the loss, which the first left to their writers).
Retention deletes finished runs (with their snapshots, journals and checkpoints, and first what
Redis holds of them: a DLQ entry, a message) and completed waitpoints that no journal still names,
older than the configured age, in batches; and the job DLQ's entries older than
``job_dlq_retention_days``, walked a page (HSCAN) at a time from where the previous pass stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from run_engine.db.deployments import TaskQueue
from run_engine.db.runs import RunRow, Snapshot
from run_engine.statuses import HANDED_OUT, ExecutionStatus
from systems import engine_jobs
from systems.engine_jobs import JobSpec
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.dead_letter import DeadLetterSystem
    from systems.delayed_runs import DelayedRunsSystem
    from systems.enqueue import EnqueueSystem
    from systems.execution_snapshot import ExecutionSnapshotSystem
    from systems.run_attempt import RunAttemptSystem
    from systems.waiting_for_worker import WaitingForWorkerSystem

log = logging.getLogger(__name__)
BULK_PAGE = 1000  # bulk actions under way re-armed per query
RETENTION_PASS_S = 20.0  # of deleting finished runs, per retention pass
#: the leader cancels a reconcile pass that runs longer (leader.py). A budgeted pass takes well under
#: a second, but one that finds Redis's data lost reads every QUEUED run (~85 µs each: 8.4 s for
#: 100,000, docs/BENCHMARKS.md) and re-arms every engine job, and a cut one is done again whole by the
#: next: a bound below its length would never let it finish. So not the default 10 intervals.
RECONCILE_TIMEOUT_S = 3600.0
SLOT_PAGE = 500  # environments whose slots in use are counted per round trip
#: a queue's settings change is compared again for this long (its version is PostgreSQL's clock when
#: its statement ran, a moment before it commits)
SETTINGS_LAG_S = 60.0
#: a new leader's first pass compares the settings changed this long before it (the walk of every
#: queue, ``reconcile_budget`` a pass, finds the others)
SETTINGS_LOOKBACK_S = 3600.0
T = TypeVar("T")
E = ExecutionStatus
#: execution statuses in which a run legitimately holds a queue slot
HOLDS_SLOT = frozenset({E.PENDING_EXECUTING, E.EXECUTING, E.EXECUTING_WITH_WAITPOINTS, E.PENDING_CANCEL,
                        E.QUEUED, E.QUEUED_EXECUTING})  # queued ones only for the instant of a dequeue


@dataclass
class ReconcileReport:
    requeued_missing: int = 0
    requeued_stuck: int = 0
    delayed_enqueued: int = 0
    pending_version_enqueued: int = 0
    slots_freed: int = 0
    settings_restored: int = 0
    settings_repaired: int = 0  # queues whose settings in Redis were behind PostgreSQL's
    jobs_rearmed: int = 0
    dlq_restored: int = 0  # DLQ entries written again after Redis lost them
    scanned: int = 0  # QUEUED runs read


class ReconcilerSystem:
    PAGE = 500
    #: the DLQ's rebuild reads this many times ``reconcile_budget`` dead runs a pass: a dead run is
    #: a light row and a few Redis commands (2,000 take ~60 ms, docs/BENCHMARKS.md), so a pass
    #: stays well under a second and a DLQ of 100,000 is back in 5 passes rather than 50
    DLQ_BUDGET_FACTOR = 10

    def __init__(self, resources: SystemResources, *, execution_snapshot: ExecutionSnapshotSystem,
                 enqueue: EnqueueSystem, run_attempt: RunAttemptSystem, delayed_runs: DelayedRunsSystem,
                 waiting_for_worker: WaitingForWorkerSystem, dead_letter: DeadLetterSystem) -> None:
        self.r = resources
        self.dead_letter = dead_letter
        self.waiting_for_worker = waiting_for_worker
        self.execution_snapshot = execution_snapshot
        self.enqueue = enqueue
        self.run_attempt = run_attempt
        self.delayed_runs = delayed_runs
        self._cursors: dict[str, str] = {}  # scan → the last id read (leader-local: a new leader starts over)
        # env → {run → latest snapshot id}: runs the last pass saw holding a slot they should not
        self._slot_suspects: dict[str, dict[str, str | None]] = {}
        self._settings_since: int | None = None  # µs of PostgreSQL's clock: settings changed since, to compare
        self._job_dlq_cursor = 0  # retention's walk of the job DLQ: where it goes on (leader-local)

    async def _pages(self, scan: str, fetch: Callable[[str, int], Awaitable[Sequence[T]]],
                     key: Callable[[T], str], full: bool) -> AsyncIterator[Sequence[T]]:
        """Pages of ``scan`` from where its previous pass stopped, up to the budget (``full``: all
        of it, from the start). ``fetch(after_id, limit)`` reads a page ordered by id."""
        budget = None if full else max(1, self.r.settings.reconcile_budget)
        after = "" if full else self._cursors.get(scan, "")
        read = 0
        while budget is None or read < budget:
            limit = self.PAGE if budget is None else min(self.PAGE, budget - read)
            page = await fetch(after, limit)
            read += len(page)
            end = len(page) < limit
            after = "" if end else key(page[-1])
            if not full:
                self._cursors[scan] = after  # before the page is worked: a page that fails is not retried for ever
            if page:
                yield page
            if end:
                return

    async def reconcile(self, grace_s: float | None = None, *, full: bool = False) -> ReconcileReport:
        """One pass; ``grace_s`` (default the setting) skips runs touched more recently than that,
        which an ordinary enqueue or dequeue may still be finishing; ``full`` reads every QUEUED run
        instead of the next ``reconcile_budget`` of them. Each step and each run is repaired on its
        own: one that fails is logged and the pass goes on."""
        grace = self.r.settings.reconcile_grace_s if grace_s is None else grace_s
        report = ReconcileReport()
        began = self.r.clock.now()
        # Redis lost its data (or is new): limits, pauses and rate limits first, then the runs and
        # the engine jobs (timeouts, timers) of everything not finished, all of them now. The
        # epoch is marked once that pass is through: one that fails or is cut short (the leader
        # restarting) is done again whole by the next pass, never left to the budgeted scans.
        # That pass keeps the grace (it must not race a writer in flight), so it skips the runs
        # touched just before the loss, whose messages and jobs were lost as well: the epoch
        # says so (see run_engine.epochs), and the first pass from `grace` later reads everything
        # once more, then marks the epoch whole. (PostgreSQL compares updated_at with its own
        # clock; elapsed time is the same on both, whatever their offset.) The mark lives in
        # Redis: a new leader does that pass too, and a second loss meanwhile is still seen.
        # The engine jobs have their own epoch (on a Redis Cluster they live on another master).
        queue_epoch = await self.r.queue.epoch()
        jobs_epoch = None if queue_epoch is None else await self.r.jobs.epoch()
        queue_full = _everything_due(queue_epoch, began)
        restored = queue_epoch is None
        if restored:
            report.settings_restored = await self._restore_settings()
        if queue_full:
            full = True
        if _everything_due(jobs_epoch, began):
            report.jobs_rearmed = await self.rearm_jobs(grace, full=True)
            await self.r.jobs.mark_epoch(_recheck_at(jobs_epoch, began, grace))
        # each step's coroutine is made only when it runs: a cancel part-way leaves none never awaited
        queued_done = False
        steps: tuple[Callable[[], Awaitable[None]], ...] = (
            lambda: self._queued_runs(grace, report, full), lambda: self._delayed_runs(grace, report),
            lambda: self._pending_version_runs(grace, report), lambda: self._slots(report, grace),
            lambda: self._queue_settings(report, full and not restored),
            lambda: self._dead_letters(report, restart=queue_full))
        for i, step in enumerate(steps):
            try:
                await step()
                queued_done = queued_done or i == 0
            except Exception:
                log.exception("reconciler: a step failed; the others went on")
        if queue_full and queued_done:  # (the other steps are as in any pass: never all of them)
            await self.r.queue.mark_epoch(_recheck_at(queue_epoch, began, grace))
        if (report.requeued_missing or report.requeued_stuck or report.delayed_enqueued or report.slots_freed
                or report.jobs_rearmed or report.pending_version_enqueued or report.settings_repaired
                or report.dlq_restored):
            log.warning("reconciler repaired the queue: %s", report)
        return report

    async def _dead_letters(self, report: ReconcileReport, *, restart: bool) -> None:
        """The DLQ entries Redis lost: the next DLQ_BUDGET_FACTOR × ``reconcile_budget`` dead runs,
        while a rebuild is under way (``restart``: Redis lost its data, or the recheck after the
        loss has come)."""
        budget = max(1, self.DLQ_BUDGET_FACTOR * self.r.settings.reconcile_budget)
        restored, _ = await self.dead_letter.rebuild(budget, restart=restart)
        report.dlq_restored += restored

    async def _delayed_runs(self, grace: float, report: ReconcileReport) -> None:
        for run_id in await self.r.repo.maintenance.due_delayed_runs(grace, self.PAGE):
            try:
                await self.delayed_runs.enqueue_delayed(run_id)
                report.delayed_enqueued += 1
            except Exception:
                log.exception("reconciler: could not enqueue delayed run %s", run_id)

    async def _pending_version_runs(self, grace: float, report: ReconcileReport) -> None:
        by_deployment: dict[str, tuple[list[str], dict[str, str]]] = {}
        for run_id, deployment_id, task, queue in await self.r.repo.maintenance.deployable_pending_runs(
                grace, self.PAGE):
            runs, queue_of = by_deployment.setdefault(deployment_id, ([], {}))
            runs.append(run_id)
            queue_of[task] = queue
        for deployment_id, (runs, queue_of) in by_deployment.items():
            try:
                report.pending_version_enqueued += await self.waiting_for_worker.promote(runs, deployment_id, queue_of)
            except Exception:
                log.exception("reconciler: could not enqueue the runs waiting for deployment %s", deployment_id)

    async def _restore_settings(self) -> int:
        envs = await self.r.repo.maintenance.environment_ids()
        for env_id in envs:
            row = await self.r.repo.tenancy.environment(env_id)
            if row is not None:
                await self.r.queue.set_env_limit(env_id, row.concurrency_limit)
            await self.enqueue.mirror_queues(env_id)
        return len(envs)

    async def _queue_settings(self, report: ReconcileReport, full: bool) -> None:
        """Copy again to Redis the settings of the queues whose copy there is behind PostgreSQL's:
        among the queues whose settings changed since the previous pass (by their version; a new
        leader: in the last SETTINGS_LOOKBACK_S), and the next ``reconcile_budget`` queues of all
        (``full``: all of them). A copy newer than the row read meanwhile (an operator's change
        just made) is kept by Redis."""
        deployments = self.r.repo.deployments
        now_us = await deployments.clock_us()
        since = self._settings_since
        if since is None:
            since = now_us - int(SETTINGS_LOOKBACK_S * 1_000_000)
        after: tuple[int, str] | None = None
        while True:
            page = await deployments.queues_changed_since(since, after, self.PAGE)
            await self._repair_settings(page, report)
            if len(page) < self.PAGE:
                break
            after = (page[-1].settings_version, page[-1].id)
        self._settings_since = now_us - int(SETTINGS_LAG_S * 1_000_000)  # only once compared
        async for rows in self._pages("queue settings", deployments.queues_page, lambda row: row.id, full):
            await self._repair_settings(rows, report)

    async def _repair_settings(self, rows: Sequence[TaskQueue], report: ReconcileReport) -> None:
        stale = await self.enqueue.stale_queue_rows(rows)
        if stale:
            await self.enqueue.mirror_queue_rows(stale, repair=True)
            report.settings_repaired += len(stale)
            log.warning("reconciler: the settings of queues %s in Redis were behind PostgreSQL's; copied again",
                        [(row.env_id, row.name) for row in stale[:10]])

    async def _queued_runs(self, grace: float, report: ReconcileReport, full: bool) -> None:
        async def fetch(after: str, limit: int) -> list[RunRow]:
            return await self.r.repo.maintenance.queued_runs_page(after, grace, limit)

        async for runs in self._pages("queued", fetch, _run_id, full):
            report.scanned += len(runs)
            # a run handed out less than the grace ago is a dequeue still writing its snapshot
            states = await self.r.queue.placements([(r.env_id, r.id) for r in runs], now_ms=self.r.now_ms(),
                                                   held_grace_ms=grace * 1000)
            # "dlq": a process died between a run's move to the DLQ and its SYSTEM_FAILURE snapshot,
            # or between a redrive's QUEUED snapshot and its move out of the DLQ; either way the
            # run is QUEUED and nothing would hand it out: it goes back to its queue afresh
            suspect = [(run, state) for run, state in zip(runs, states, strict=True)
                       if state in (None, "held", "lost", "dlq")]
            if broken := [run.id for run, state in zip(runs, states, strict=True) if state == "broken"]:
                log.error("reconciler: the queue messages of runs %s cannot be read (not hashes)", broken[:20])
            if suspect:
                outcomes = await asyncio.gather(*(self._requeue(run, state, report, grace) for run, state in suspect),
                                                return_exceptions=True)
                for (run, _), outcome in zip(suspect, outcomes, strict=True):
                    if isinstance(outcome, Exception):
                        log.error("reconciler: could not requeue run %s: %r", run.id, outcome)

    async def _requeue(self, run, state, report: ReconcileReport, grace: float) -> None:  # type: ignore[no-untyped-def]
        async with self.r.locker.lock("reconcile", run.id):
            latest = await self.r.repo.runs.latest_snapshot(run.id)
            if latest is None or latest.engine_status not in (E.QUEUED, E.QUEUED_EXECUTING):
                return  # moved on meanwhile
            current = (await self.r.queue.placements([(run.env_id, run.id)], now_ms=self.r.now_ms(),
                                                     held_grace_ms=grace * 1000))[0]
            if current != state:
                return
            stuck = await self.r.queue.delivery(run.env_id, run.id) if state == "held" else None
            await self.r.enqueue_items([self.enqueue.item_for(run, reset_deliveries=state in (None, "dlq"))])
            if stuck is not None:
                # Its dequeue (stalled, not dead) may have written the run since the read above,
                # and found its delivery still held when it looked: the run is handed out, and
                # would run with no slot. Taken back here (a dequeue that writes it from now on
                # takes it back itself).
                again = await self.r.repo.runs.latest_snapshot(run.id)
                if again is not None and again.engine_status in HANDED_OUT:
                    await self.r.queue.reclaim_many([(run.env_id, run.id, *stuck)], self.r.now_ms())
                    return
        if state is None:
            report.requeued_missing += 1
        else:
            report.requeued_stuck += 1

    async def _slots(self, report: ReconcileReport, grace: float) -> None:
        """Each environment that holds slots (or had suspects last pass) is looked at; which ones
        hold any is asked of Redis a page of environments at a time, not one round trip each."""
        envs = await self.r.repo.maintenance.environment_ids()
        for start in range(0, len(envs), SLOT_PAGE):
            page = envs[start:start + SLOT_PAGE]
            try:
                counts = await self.r.queue.running_counts(page)
            except Exception:
                log.exception("reconciler: could not count the slots in use of %d environments", len(page))
                continue
            for env_id, n in zip(page, counts, strict=True):
                if n == 0 and env_id not in self._slot_suspects:
                    continue
                try:
                    await self._env_slots(env_id, report, grace)
                except Exception:
                    log.exception("reconciler: could not check the slots of environment %s", env_id)

    async def _env_slots(self, env_id: str, report: ReconcileReport, grace: float) -> None:
        """Free the slots of runs that hold one in the queue but not in PostgreSQL. A finished run's
        snapshot commits a moment before its ack frees its slot, so a slot is freed only when the
        previous pass saw the same run, at the same latest snapshot, not holding it (``grace`` ≤ 0:
        at once): a pass never races an ack on its way, nor reports it as a repair."""
        holding = sorted(await self.r.queue.running_ids(env_id))
        suspects: dict[str, str | None] = {}
        for start in range(0, len(holding), self.PAGE):
            page = holding[start:start + self.PAGE]
            latest = await self.r.repo.runs.slot_holders(page)
            for rid in page:
                status, snapshot_id = latest.get(rid, (None, None))
                if status not in HOLDS_SLOT:
                    suspects[rid] = snapshot_id
            before = self._slot_suspects.get(env_id, {})
            stale = [rid for rid in page if rid in suspects
                     and (grace <= 0 or (rid in before and before[rid] == suspects[rid]))]
            if stale:
                # held only: a run enqueued again since (a suspended run continued) has given its
                # slot back already and keeps its new message
                await self.r.queue.ack([(env_id, rid) for rid in stale], held_only=[True] * len(stale))
                report.slots_freed += len(stale)
        if suspects:
            self._slot_suspects[env_id] = suspects
        else:
            self._slot_suspects.pop(env_id, None)

    async def rearm_jobs(self, grace_s: float | None = None, *, full: bool = False) -> int:
        """Schedule again every engine job that a run or waitpoint not yet finished needs and that
        Redis does not hold (lost to a flush, a restart without persistence, or a process that died
        between its PostgreSQL write and the job): heartbeat timeouts and max durations of held
        runs, delays and TTLs of runs not started, dates and timeouts of waitpoints, the sweeper,
        bulk actions under way, and the cancels whose cascade is not through (``cancel_cascade``).
        Each of the four scans reads the next ``reconcile_budget`` rows (``full``: all). Fixed job
        ids make this idempotent. Returns how many were scheduled."""
        grace = self.r.settings.reconcile_grace_s if grace_s is None else grace_s
        now = self.r.clock.now()
        total = 0
        total += await self._schedule_missing(  # the sweeper re-arms itself, from the first one on
            [engine_jobs.sweep(now + self.r.settings.waitpoint_sweep_interval_s)])
        after = ""
        while True:  # bulk actions under way go on
            pending = await self.r.repo.bulk_actions.pending(after, BULK_PAGE)
            total += await self._schedule_missing([engine_jobs.bulk_action(a, env_id, now) for a, env_id in pending])
            if len(pending) < BULK_PAGE:
                break
            after = pending[-1][0]

        async def cascades(after: str, limit: int) -> list[tuple[str, str]]:
            return await self.r.repo.maintenance.cancel_cascades_page(after, grace, limit)

        # cancels whose way down their runs' children is not through (systems/cancel.py): a job
        # dead after its every attempt (the job DLQ) or lost with Redis's data left them running
        async for cancels in self._pages("cancel cascades", cascades, lambda row: row[0], full):
            total += await self._schedule_missing([engine_jobs.cancel_cascade(run_id, env_id, now)
                                                   for run_id, env_id in cancels])

        async def active(after: str, limit: int) -> list[tuple[RunRow, Snapshot]]:
            return await self.r.repo.maintenance.active_runs_page(after, grace, limit)

        async for page in self._pages("active", active, lambda row: row[0].id, full):
            wanted: list[JobSpec] = []
            for run, snapshot in page:
                try:
                    wanted += await self._held_run_jobs(run, snapshot, now)
                except Exception:
                    log.exception("reconciler: could not work out the jobs of run %s", run.id)
            total += await self._schedule_missing(wanted)
        async for runs in self._pages("not started", self.r.repo.maintenance.not_started_runs_page, _run_id, full):
            wanted = []
            for run in runs:
                if run.status == "DELAYED" and run.delay_until is not None:
                    wanted.append(engine_jobs.delayed(run.id, run.env_id, run.delay_until.timestamp()))
                if run.ttl_s is not None and run.attempt_number == 0:
                    start = run.delay_until or run.created_at
                    wanted.append(engine_jobs.ttl(run.id, run.env_id, start.timestamp() + run.ttl_s))
            total += await self._schedule_missing(wanted)
        async for waitpoints in self._pages("timed waitpoints", self.r.repo.waitpoints.timed_waitpoints_page,
                                            lambda row: row[0], full):
            wanted = []
            for wp_id, env_id, kind, completed_after, timeout_at in waitpoints:
                if kind == "DATETIME" and completed_after is not None:
                    wanted.append(engine_jobs.waitpoint_datetime(wp_id, env_id, completed_after.timestamp()))
                if timeout_at is not None:
                    wanted.append(engine_jobs.waitpoint_timeout(wp_id, env_id, timeout_at.timestamp()))
            total += await self._schedule_missing(wanted)
        if total:
            log.warning("reconciler: re-armed %d lost engine jobs", total)
        return total

    async def _held_run_jobs(self, run: RunRow, snapshot: Snapshot, now: float) -> list[JobSpec]:
        status = ExecutionStatus(snapshot.engine_status)
        wanted: list[JobSpec] = []
        if self.r.settings.heartbeat_timeout_s(status) is not None:
            wanted += self.execution_snapshot.rearm(None, None, snapshot)[1]
        if status in (E.EXECUTING, E.EXECUTING_WITH_WAITPOINTS, E.PENDING_CANCEL):
            max_duration = run.max_duration_s
            if max_duration is None:
                task = await self.run_attempt.deployment_task(run)
                max_duration = task.max_duration_s if task else None
            if max_duration:
                # the attempt began at or before its latest snapshot: never later than this
                deadline = max(now, snapshot.created_at.timestamp() + max_duration
                               + self.r.settings.max_duration_grace_s)
                wanted.append(engine_jobs.max_duration(run.id, run.attempt_number, deadline))
        return wanted

    async def _schedule_missing(self, wanted: list[JobSpec]) -> int:
        # a job in another lane than it belongs to (scheduled by a version before lanes) moves too
        missing = set(await self.r.jobs.misplaced([(j[0], j[4]) for j in wanted]))
        if missing:
            await self.r.change_jobs(schedule=[j for j in wanted if j[0] in missing])
        return len(missing)

    async def trim_job_dlq(self) -> int:
        """Delete the job DLQ's entries that died more than ``job_dlq_retention_s`` ago: HSCAN pages of
        about ``retention_batch`` entries from where the previous pass stopped, at most
        RETENTION_PASS_S a pass (the walk goes on next pass). An entry with no time of death (written
        before entries carried one) is stamped with the time the walk first meets it. Without this,
        the entries of the kinds nothing arms again (promoting the runs waiting for a deployment,
        continuing unblocked runs) stayed for ever. Returns how many were deleted."""
        age = self.r.settings.job_dlq_retention_s
        if age is None:
            return 0
        ends = time.monotonic() + RETENTION_PASS_S
        deleted = stamped = 0
        while True:
            self._job_dlq_cursor, gone, marked = await self.r.jobs.trim_dead(
                self._job_dlq_cursor, max(1, self.r.settings.retention_batch), self.r.clock.now() - age)
            deleted += gone
            stamped += marked
            if self._job_dlq_cursor == 0 or time.monotonic() > ends:
                break
            await asyncio.sleep(0.05)  # leave room for the hot path between pages
        if deleted or stamped:
            log.info("retention: deleted %d job DLQ entries older than %.0f s (%d without a time of death "
                     "stamped with now)", deleted, age, stamped)
        return deleted

    async def retention(self) -> int:
        """Delete what finished more than ``retention_s`` ago, a batch at a time; and uploaded
        packets that expired (whatever the retention: they are a trigger's input, not history).
        First the job DLQ's old entries (:meth:`trim_job_dlq`, its own setting; not counted in the
        rows returned)."""
        try:
            await self.trim_job_dlq()
        except Exception:
            log.exception("retention: the job DLQ could not be trimmed; the rest goes on")
        total = 0
        while (expired := await self.r.repo.packets.delete_expired(self.r.settings.retention_batch)) > 0:
            total += expired
            if expired < self.r.settings.retention_batch:
                break
            await asyncio.sleep(0.05)
        age = self.r.settings.retention_s
        if age is None:
            if total:
                log.info("retention: deleted %d expired uploaded packets", total)
            return total
        # at most RETENTION_PASS_S a pass: a backlog of millions (retention just lowered) is hours,
        # and its deletes compete with the hot path (the leader's other duties run beside it)
        ends = time.monotonic() + RETENTION_PASS_S
        # each walk goes on from where the last batch stopped (past the rows that must stay), and one
        # that reached its end last pass starts over: the rows that must stay are read once a pass
        self.r.repo.maintenance.rewind()
        while True:
            deleted = await self.r.repo.maintenance.delete_finished_before(age, self.r.settings.retention_batch,
                                                               self.r.queue.remove_many)
            total += deleted
            if deleted < self.r.settings.retention_batch:
                break
            if time.monotonic() > ends:
                log.info("retention: %d rows deleted this pass; the rest next pass", total)
                break
            await asyncio.sleep(0.05)  # leave room for the hot path between batches
        # batches whose runs are gone (one row per batch request, kept for ever before): within the
        # same pass's time, a pause between batches (the first pass after an upgrade finds them all)
        while time.monotonic() <= ends and (gone := await self.r.repo.maintenance.delete_finished_batches_before(
                age, self.r.settings.retention_batch)):
            total += gone
            if gone < self.r.settings.retention_batch:
                break
            await asyncio.sleep(0.05)
        while (gone := await self.r.repo.bulk_actions.delete_finished_before(age, self.r.settings.retention_batch)):
            total += gone  # finished bulk actions: a tenant may make and abort them at will
            if gone < self.r.settings.retention_batch:
                break
        if total:
            log.info("retention: deleted %d rows older than %.0f s", total, age)
        return total


def _run_id(run: RunRow) -> str:
    return run.id


def _everything_due(epoch: float | None, now: float) -> bool:
    """Whether a pass is to read everything: Redis lost the data (no epoch), or the time to read
    it once more after the loss has come."""
    return epoch is None or 0 < epoch <= now


def _recheck_at(epoch: float | None, began: float, grace: float) -> float | None:
    """After a pass that read everything from ``began`` on: when the next pass is to read it all
    once more (the first after a loss skipped what was touched within ``grace``), or None."""
    return began + grace if epoch is None and grace > 0 else None
