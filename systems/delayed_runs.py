"""DelayedRunsSystem and TTL: a delayed run waits as DELAYED until its engine job (``delay.<run>``)
enqueues it; ``reschedule`` moves that date, and so does ``debounce`` (a trigger joining the run).
A run with a TTL that has not started by then ends EXPIRED (``ttl.<run>``); a retry or a resumed
run is never expired (it has started once)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from run_engine.db.runs import DebounceReplacement, RunRow
from run_engine.errors import InvalidTransitionError, NotFoundError, StaleSnapshotError
from run_engine.events import RunEvent
from run_engine.statuses import ExecutionStatus, RunStatus
from systems import engine_jobs
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.enqueue import EnqueueSystem
    from systems.execution_snapshot import ExecutionSnapshotSystem
    from systems.run_attempt import RunAttemptSystem

E = ExecutionStatus
#: statuses a TTL expires: never started, not running
EXPIRABLE = (E.QUEUED, E.DELAYED, E.PENDING_VERSION)
#: the least a TTL job that found its run handed out (or being handed out) waits to look again
RECHECK_S = 1.0


class DelayedRunsSystem:
    def __init__(self, resources: SystemResources, *, execution_snapshot: ExecutionSnapshotSystem,
                 enqueue: EnqueueSystem, run_attempt: RunAttemptSystem) -> None:
        self.r = resources
        self.execution_snapshot = execution_snapshot
        self.enqueue = enqueue
        self.run_attempt = run_attempt

    async def enqueue_delayed(self, run_id: str) -> None:
        """The delay is over: QUEUED (or PENDING_VERSION when no deployment has the task yet)."""
        async with self.r.locker.lock("enqueue_delayed", run_id):
            found = await self.r.run_with_latest(run_id)
            if found is None or found[1].engine_status != E.DELAYED:
                return  # cancelled, expired or already enqueued
            run, latest = found
            if run.delay_until is not None and run.delay_until.timestamp() > self.r.clock.now() + 0.001:
                return  # rescheduled later; its job was moved with it
            if run.locked_to_deployment_id is None:  # the deployment of the group the run was routed to
                task = await self.enqueue.current_task(run.env_id, run.worker_group_id, run.task_id)
                if task.deployment_id is not None:
                    await self.r.repo.runs.assign_deployment([run_id], task.deployment_id,
                                                        {run.task_id: task.queue or run.queue})
                    assigned = await self.r.repo.runs.get_run(run_id)
                    assert assigned is not None
                    run = assigned
            if run.locked_to_deployment_id is None:
                await self.execution_snapshot.apply(
                    run_id, E.PENDING_VERSION, RunStatus.PENDING_VERSION, from_statuses=(E.DELAYED,),
                    expected_snapshot_id=latest.id, operation="enqueue",
                    description="Delay over; no deployment has this task yet")
                return
            result = await self.execution_snapshot.apply(
                run_id, E.QUEUED, RunStatus.QUEUED, from_statuses=(E.DELAYED,), expected_snapshot_id=latest.id,
                operation="enqueue", description="Delay over")
            assert result.run is not None and result.snapshot is not None
            await self.r.enqueue_items([self.enqueue.item_for(result.run)])
        self.r.events.emit(RunEvent("run_requeued", run_id, run.env_id, result.snapshot.id,
                                    {"reason": "delay"}, attempt=result.run.attempt_number))

    async def reschedule(self, run_id: str, env_id: str, delay_until: datetime) -> RunRow:
        """Move a DELAYED run's date (and its TTL with it); InvalidTransitionError otherwise. A date
        already past is now, as it is for a trigger: kept as given, the TTL counted from it would
        have passed already (the run expired as soon as it was queued) and the run would take a
        place in its queue ahead of the runs queued since that date."""
        now = datetime.fromtimestamp(self.r.clock.now(), UTC)
        delay_until = max(delay_until, now)
        async with self.r.locker.lock("reschedule", run_id):
            run = await self.r.repo.runs.get_run(run_id, env_id)
            if run is None:
                raise NotFoundError("run", run_id)
            latest = await self.execution_snapshot.latest(run_id)
            if latest.engine_status != E.DELAYED:
                raise InvalidTransitionError(run_id, latest.engine_status, "reschedule")
            await self.r.repo.runs.set_delay_until(run_id, delay_until)
            await self.execution_snapshot.apply(
                run_id, E.DELAYED, RunStatus.DELAYED, from_statuses=(E.DELAYED,), expected_snapshot_id=latest.id,
                operation="reschedule", description=f"Rescheduled to {delay_until.isoformat()}")
            jobs = [engine_jobs.delayed(run_id, env_id, delay_until.timestamp())]
            if run.ttl_s is not None:
                jobs.append(engine_jobs.ttl(run_id, env_id, delay_until.timestamp() + run.ttl_s))
            await self.r.change_jobs(schedule=jobs)
            fresh = await self.r.repo.runs.get_run(run_id)
        assert fresh is not None
        self.r.events.emit(RunEvent("run_updated", run_id, env_id, data={"what": "delay"}))
        return fresh

    async def debounce(self, run_id: str, delay_until: datetime,
                       replacement: DebounceReplacement | None = None) -> RunRow | None:
        """A trigger with this DELAYED run's debounce key joins it: the date moves to
        ``delay_until`` (never past the run's debounce deadline), its TTL with it, and a trailing
        trigger's ``replacement`` is applied. None when the run has left DELAYED (enqueued,
        cancelled, expired): the caller creates a new run. Under the run lock, like
        ``enqueue_delayed``, which re-reads the date: a delay job that fires meanwhile finds the
        later date and leaves the run alone, and one that went first leaves nothing DELAYED to join.
        No snapshot is appended (a burst of triggers would add one each); ``updated_at`` moves."""
        async with self.r.locker.lock("debounce", run_id):
            run = await self.r.repo.runs.debounce_delayed(run_id, delay_until, replacement)
            if run is None:
                return None
            due = (run.delay_until or delay_until).timestamp()
            jobs = [engine_jobs.delayed(run_id, run.env_id, due)]
            if run.ttl_s is not None:
                jobs.append(engine_jobs.ttl(run_id, run.env_id, due + run.ttl_s))
            await self.r.change_jobs(schedule=jobs)
        self.r.events.emit(RunEvent("run_updated", run_id, run.env_id, data={"what": "debounced"}))
        return run

    async def expire(self, run_id: str) -> bool:
        """The TTL passed: a run that never started ends EXPIRED (its parent's wait, if any, ends
        with that error). True if it expired.

        A run handed out to a worker but not started (PENDING_EXECUTING, attempt 0) is not expired:
        it may yet start in time. Nor is the TTL given up: its worker may never start it, and the
        PENDING_EXECUTING timeout then puts it back in the queue, never started, long past its TTL;
        so the job is moved to just after that timeout, to look again (as often as the run is
        handed out again). A started run (attempt ≥ 1: a retry, a restore) is never expired. The
        job is moved, not made anew, within the job's own handling: a process that dies first
        leaves the job claimed, and it is delivered again."""
        async with self.r.locker.lock("expire", run_id):
            found = await self.r.run_with_latest(run_id)
            if found is None or found[1].attempt_number > 0:
                return False
            run, latest = found
            status = latest.engine_status
            if run.ttl_s is None or (status not in EXPIRABLE and status != E.PENDING_EXECUTING):
                return False  # no TTL (any more: redriven from the DLQ), or finished: a job left behind
            now = self.r.clock.now()
            # a job of an earlier date (the run was rescheduled or debounced, and the process died
            # before moving the job): not yet; the job goes to the date the TTL ends
            # (from the engine's clock at the trigger, as the job's date: created_at is the database's,
            # later by the insert's time, which put a job off once more; in tests, a fake clock's past)
            ends = (run.delay_until or run.queue_timestamp or run.created_at).timestamp() + run.ttl_s
            if ends > now + 0.001:
                await self.r.change_jobs(schedule=[engine_jobs.ttl(run_id, run.env_id, ends)])
                return False
            if status == E.PENDING_EXECUTING:
                timeout = self.r.settings.heartbeat_timeout_s(E.PENDING_EXECUTING) or 60.0
                requeued_by = latest.created_at.timestamp() + timeout + RECHECK_S
                # past it (the timeout's job is late, or was put off): a whole timeout later
                again = requeued_by if requeued_by > now + RECHECK_S else now + timeout
                await self.r.change_jobs(schedule=[engine_jobs.ttl(run_id, run.env_id, again)])
                return False
            # the snapshot first (a dequeue takes no lock: one that got in first wins, and this one
            # changes nothing); a message handed out after it is dropped by that dequeue
            try:
                await self.run_attempt.finish(
                    run_id, RunStatus.EXPIRED, expected_snapshot_id=latest.id, from_statuses=EXPIRABLE,
                    description="TTL passed before the run started",
                    error={"type": "EXPIRED", "message": f"the run was not started within its TTL of {run.ttl_s}s"})
            except StaleSnapshotError:
                # dequeued meanwhile: handed out, not yet started; look again soon (a start then
                # leaves it alone, a handed-out run is looked at again as above)
                await self.r.change_jobs(schedule=[engine_jobs.ttl(run_id, run.env_id, now + RECHECK_S)])
                return False
            await self.r.queue.remove(run.env_id, run_id)
        return True
