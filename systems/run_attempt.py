"""RunAttemptSystem: start attempts, complete them, decide retries, finish runs, and handle the
timeouts that end an attempt (stalled heartbeat, max duration).

Retry decisions are data (:class:`AttemptOutcome`), never exceptions."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Literal

from run_engine.db.deployments import DeploymentTask
from run_engine.db.runs import RunRow, Snapshot, TransitionResult
from run_engine.errors import InvalidTransitionError, NotFoundError, StaleSnapshotError, ValidationError
from run_engine.events import RunEvent
from run_engine.records import record
from run_engine.settings import RetryPolicy
from run_engine.statuses import EXECUTING, ExecutionStatus, RunStatus
from systems import engine_jobs
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.dead_letter import DeadLetterSystem
    from systems.enqueue import EnqueueSystem
    from systems.execution_snapshot import ExecutionSnapshotSystem
    from systems.waitpoints import ResolvedJournal, WaitpointsSystem

log = logging.getLogger(__name__)

E = ExecutionStatus

#: error ``type`` values with a fixed meaning
ERROR_TIMED_OUT = "MAX_DURATION_EXCEEDED"
ERROR_ABORT = "ABORT"
ERROR_OOM = "TASK_PROCESS_OOM_KILLED"  # the supervisor killed the attempt for its memory


@record
class StartedAttempt:
    run: RunRow
    snapshot: Snapshot
    attempt_number: int
    retry: RetryPolicy
    max_duration_s: int | None = None
    machine: str | None = None  # the machine preset the attempt runs on (None: the supervisor's default)
    # the resolved journal (its first page) of a run restored or retried, when the dequeue read it
    # with the start (None: not read; ask WaitpointsSystem.resolved_journal)
    journal: ResolvedJournal | None = None


@record
class AttemptOutcome:
    """``finished`` with the run's final status, or ``retry`` after ``delay_ms``."""

    action: Literal["finished", "retry"]
    status: RunStatus
    snapshot_id: str
    delay_ms: int | None = None




class RunAttemptSystem:
    def __init__(self, resources: SystemResources, *, execution_snapshot: ExecutionSnapshotSystem,
                 enqueue: EnqueueSystem, waitpoints: WaitpointsSystem, dead_letter: DeadLetterSystem) -> None:
        self.r = resources
        self.execution_snapshot = execution_snapshot
        self.enqueue = enqueue
        self.waitpoints = waitpoints
        self.dead_letter = dead_letter
        # A deployment's task catalogue never changes, so it is cached for the process's life.
        self._tasks: dict[tuple[str, str], DeploymentTask | None] = {}

    async def deployment_task(self, run: RunRow) -> DeploymentTask | None:
        if not run.locked_to_deployment_id:
            return None
        key = (run.locked_to_deployment_id, run.task_id)
        if key not in self._tasks:
            if len(self._tasks) > 10_000:
                self._tasks.clear()
            self._tasks[key] = await self.r.repo.deployments.deployment_task(*key)
        return self._tasks[key]

    async def retry_policy(self, run: RunRow) -> RetryPolicy:
        """The task's policy over the engine's default, the run's over it. A layer that cannot
        apply over the one below (bounds that contradict it) is left out, with a warning: a run
        whose policy cannot be worked out could neither start nor fail."""
        task = await self.deployment_task(run)

        def over(data: dict[str, Any] | None, base: RetryPolicy) -> RetryPolicy:
            try:
                return RetryPolicy.from_json(data, base)
            except ValidationError as exc:
                log.warning("run %s: retry options %s left out: %s", run.id, data, exc)
                return base

        policy = over(task.retry if task else None, self.r.settings.default_retry)
        policy = over(run.retry, policy)
        if run.max_attempts is not None:
            policy = over({"max_attempts": run.max_attempts}, policy)
        return policy

    async def start_attempt(self, run_id: str, snapshot_id: str, worker_id: str | None = None) -> StartedAttempt:
        """Start the next attempt of a dequeued run; a run restored from a checkpoint (dequeued
        after a suspension) resumes its attempt instead, by journal replay.

        No run lock: the compare-and-set from the caller's PENDING_EXECUTING snapshot decides
        (see :meth:`_succeed`); the transitions that race it (a cancel, the PENDING_EXECUTING
        timeout) apply theirs before touching the queue, and the jobs below are keyed by snapshot
        and attempt, so one that lands after another transition is stale when it fires."""
        result = await self.execution_snapshot.apply(
            run_id, E.EXECUTING, RunStatus.EXECUTING, **self.start_transition(snapshot_id, worker_id),
            operation="start an attempt of",
        )
        assert result.run is not None and result.snapshot is not None
        started, cancel, schedule = await self.attempt_started(result.run, result.snapshot, snapshot_id,
                                                               pending_job=True)
        await self.r.after_commit("start", self.r.change_jobs(cancel, schedule))
        self.emit_started(started)
        return started

    START_DESCRIPTION = "Attempt started"

    @classmethod
    def start_transition(cls, snapshot_id: str, worker_id: str | None) -> dict[str, Any]:
        """The changes of a start, from the dequeued run's PENDING_EXECUTING ``snapshot_id`` (the
        dequeue that starts its runs makes the same changes: ``RunRepository.dequeue_and_start``)."""
        return {"from_statuses": (E.PENDING_EXECUTING,), "expected_snapshot_id": snapshot_id,
                "description": cls.START_DESCRIPTION, "attempt_delta": 1, "set_started": True, "worker_id": worker_id,
                "resume_checkpoint": True}

    async def attempt_started(self, run: RunRow, snapshot: Snapshot, pending_snapshot_id: str, *, pending_job: bool,
                              journal: ResolvedJournal | None = None,
                              ) -> tuple[StartedAttempt, list[str], list[engine_jobs.JobSpec]]:
        """What a start applied means: the attempt, and the engine jobs to cancel and schedule
        (the pending snapshot's heartbeat job when ``pending_job``, the TTL; the new heartbeat, the
        max duration)."""
        if pending_job:
            cancel, schedule = self.execution_snapshot.rearm(pending_snapshot_id, E.PENDING_EXECUTING, snapshot)
        else:
            cancel, schedule = self.execution_snapshot.rearm(None, None, snapshot)
        if run.ttl_s is not None and run.attempt_number == 1:
            cancel.append(engine_jobs.ttl_id(run.id))  # started in time: the TTL no longer applies
        policy = await self.retry_policy(run)
        task = await self.deployment_task(run)  # cached per deployment: no query per run
        max_duration = run.max_duration_s if run.max_duration_s is not None else (
            task.max_duration_s if task else None)
        # the run's own machine (a trigger's, or the larger one after running out of memory), else its task's
        machine = run.machine or (task.machine if task else None)
        if max_duration:
            # one job per attempt: it survives the attempt's waits and continuations
            schedule.append(engine_jobs.max_duration(
                run.id, run.attempt_number,
                self.r.clock.now() + max_duration + self.r.settings.max_duration_grace_s))
        started = StartedAttempt(run, snapshot, run.attempt_number, policy, max_duration, machine, journal)
        return started, cancel, schedule

    def emit_started(self, started: StartedAttempt) -> None:
        run, snapshot = started.run, started.snapshot
        data: dict[str, Any] = {"attempt": run.attempt_number}
        if run.attempt_number == 1 and snapshot.checkpoint_id is None and run.queued_at is not None:
            # trigger → start: from the run becoming QUEUED (trigger, delay over, deployed, redriven)
            data["queued_s"] = max(0.0, (snapshot.created_at - run.queued_at).total_seconds())
        self.r.events.emit(RunEvent("attempt_started", run.id, run.env_id, snapshot.id, data,
                                    attempt=run.attempt_number))

    async def complete_attempt(
        self, run_id: str, snapshot_id: str, *, ok: bool, output: Any = None,
        output_type: str = "application/json", error: dict[str, Any] | None = None,
        retryable: bool | None = None,
    ) -> AttemptOutcome:
        if ok:
            return await self._succeed(run_id, snapshot_id, output, output_type)
        async with self.r.locker.lock("complete_attempt", run_id):
            return await self._fail(run_id, snapshot_id, error or {"type": "UNKNOWN", "message": "unknown error"},
                                    retryable=retryable)

    async def _succeed(self, run_id: str, snapshot_id: str, output: Any, output_type: str) -> AttemptOutcome:
        """No run lock: the snapshot's compare-and-set decides (one statement, and the chain's
        unique index makes a concurrent transition after the same snapshot lose), and every other
        transition out of EXECUTING writes its side effects only after its own has applied; once
        FINISHED (COMPLETED) nothing moves the run again, so the ack and the jobs below are the
        last word whatever runs beside them."""
        try:
            result = await self.execution_snapshot.apply(
                run_id, E.FINISHED, RunStatus.COMPLETED,
                from_statuses=EXECUTING, expected_snapshot_id=snapshot_id,
                operation="complete", description="Attempt succeeded", set_finished=True,
                output=output, output_type=output_type,
            )
        except StaleSnapshotError as exc:
            if exc.latest_status == E.PENDING_CANCEL:
                async with self.r.locker.lock("complete_attempt", run_id):
                    return await self.finish_cancel_requested(run_id, exc.latest_snapshot_id)
            raise
        await self._finalize(result)
        assert result.run is not None and result.snapshot is not None
        self.r.events.emit(RunEvent("run_succeeded", run_id, result.run.env_id, result.snapshot.id,
                                    attempt=result.run.attempt_number))
        return AttemptOutcome("finished", RunStatus.COMPLETED, result.snapshot.id)

    async def _fail(self, run_id: str, snapshot_id: str, error: dict[str, Any], *, retryable: bool | None,
                    forced_delay_s: float | None = None) -> AttemptOutcome:
        latest = await self.execution_snapshot.latest(run_id)
        if latest.id != snapshot_id:
            if latest.engine_status == E.PENDING_CANCEL:
                return await self.finish_cancel_requested(run_id, latest.id)
            raise StaleSnapshotError(run_id, snapshot_id, latest.id, latest.engine_status)
        if latest.engine_status not in EXECUTING:
            raise InvalidTransitionError(run_id, latest.engine_status, "fail an attempt of")
        run = await self.r.repo.runs.get_run(run_id)
        if run is None:
            raise NotFoundError("run", run_id)
        policy = await self.retry_policy(run)
        final_status: RunStatus | None = None
        if error.get("type") == ERROR_TIMED_OUT:
            final_status = RunStatus.TIMED_OUT
        elif retryable is False or error.get("type") == ERROR_ABORT:
            final_status = RunStatus.FAILED
        elif run.attempt_number >= policy.max_attempts:
            final_status = RunStatus.FAILED
        if final_status is not None:
            return await self.finish(run_id, final_status, error=error, expected_snapshot_id=snapshot_id,
                                     from_statuses=EXECUTING, description="Attempt failed, no retry")
        delay_s = forced_delay_s if forced_delay_s is not None else policy.delay_s(run.attempt_number, self.r.rng)
        if error.get("type") == ERROR_OOM and policy.oom_machine and run.machine != policy.oom_machine:
            # (run.machine None: it ran on its task's machine)
            # the next attempt runs on the larger machine (set first: a crash before the retry is
            # recorded leaves the run bigger, never smaller)
            await self.r.repo.runs.set_machine(run_id, policy.oom_machine)
        result = await self.execution_snapshot.apply(
            run_id, E.QUEUED, RunStatus.QUEUED, from_statuses=EXECUTING, expected_snapshot_id=snapshot_id,
            operation="retry", description=f"Retrying after attempt {run.attempt_number} failed", error=error,
        )
        assert result.run is not None and result.snapshot is not None
        available_at = self.r.now_ms() + int(delay_s * 1000)
        await self.r.after_commit(
            "retry", self._ack_attempt_jobs(run_id, snapshot_id, run.attempt_number),
            self.r.enqueue_items([self.enqueue.item_for(result.run, available_at, reset_deliveries=True)]))
        self.r.events.emit(RunEvent("run_failed", run_id, run.env_id, result.snapshot.id,
                                    {"error": error, "final": False}, attempt=run.attempt_number))
        self.r.events.emit(RunEvent("retry_scheduled", run_id, run.env_id, result.snapshot.id,
                                    {"delay_ms": int(delay_s * 1000), "attempt": run.attempt_number, "error": error},
                                    attempt=run.attempt_number))
        return AttemptOutcome("retry", RunStatus.QUEUED, result.snapshot.id, int(delay_s * 1000))

    async def finish(self, run_id: str, status: RunStatus, *, error: dict[str, Any] | None = None,
                     expected_snapshot_id: str | None,
                     from_statuses: frozenset[ExecutionStatus] | tuple[ExecutionStatus, ...],
                     description: str) -> AttemptOutcome:
        """End the run (caller holds the run lock): FINISHED snapshot, queue slot and jobs released."""
        result = await self.execution_snapshot.apply(
            run_id, E.FINISHED, status, from_statuses=from_statuses, expected_snapshot_id=expected_snapshot_id,
            operation="finish", description=description, set_finished=True, error=error,
        )
        assert result.run is not None and result.snapshot is not None
        await self._finalize(result)
        name = {RunStatus.CANCELED: "run_cancelled"}.get(status, "run_failed")
        self.r.events.emit(RunEvent(name, run_id, result.run.env_id, result.snapshot.id,
                                    {"status": status, "error": error, "final": True},
                                    attempt=result.run.attempt_number))
        return AttemptOutcome("finished", status, result.snapshot.id)

    async def _finalize(self, result: TransitionResult) -> None:
        """After a run finished: free its queue slots, cancel its timeout jobs, complete the
        waitpoint a parent may wait on."""
        assert result.run is not None and result.snapshot is not None
        run = result.run
        previous = result.snapshot.previous_snapshot_id
        cancel = [engine_jobs.heartbeat_id(run.id, previous)] if previous else []
        if run.attempt_number:
            cancel.append(engine_jobs.max_duration_id(run.id, run.attempt_number))
        await self.r.after_commit("finish", self.r.ack_many([(run.env_id, run.id, run.worker_group_id)]),
                                  self.r.change_jobs(cancel))
        if run.resume_parent_on_completion:
            try:
                await self.waitpoints.on_runs_finished([run])
            except Exception:  # the sweeper completes the RUN waitpoints of finished runs
                log.warning("run %s finished; completing what its parent waits on failed (the sweeper will)",
                            run.id, exc_info=True)

    async def _ack_attempt_jobs(self, run_id: str, snapshot_id: str, attempt: int) -> None:
        await self.r.change_jobs([engine_jobs.heartbeat_id(run_id, snapshot_id),
                                  engine_jobs.max_duration_id(run_id, attempt)])

    async def finish_cancel_requested(self, run_id: str, pending_cancel_snapshot_id: str) -> AttemptOutcome:
        return await self.finish(run_id, RunStatus.CANCELED, expected_snapshot_id=pending_cancel_snapshot_id,
                                 from_statuses=(E.PENDING_CANCEL,), description="Cancelled while executing",
                                 error={"type": "CANCELED", "message": "Run was cancelled"})

    # --- timeouts ---------------------------------------------------------------------------

    async def on_heartbeat_timeout(self, run_id: str, snapshot_id: str, *, graced: bool = False) -> None:
        """The heartbeat job of ``snapshot_id`` fired: the worker went quiet."""
        async with self.r.locker.lock("heartbeat_timeout", run_id):
            latest = await self.r.repo.runs.latest_snapshot(run_id)
            if latest is None or latest.id != snapshot_id:
                return  # the run moved on; this job is stale
            status = ExecutionStatus(latest.engine_status)
            if (status in (E.PENDING_EXECUTING, E.EXECUTING) and not graced
                    and await self._not_heard_long_enough(latest, status)):
                return
            if status == E.PENDING_EXECUTING:
                with contextlib.suppress(StaleSnapshotError):  # started meanwhile (a start takes no lock)
                    await self.dead_letter.requeue_undelivered(run_id, latest)
            elif status == E.EXECUTING_WITH_WAITPOINTS:
                # Its worker went away while the run waited: checkpoint it on the worker's behalf;
                # it is restored by replay when its waitpoints complete.
                await self.waitpoints.suspend(run_id, snapshot_id)
            elif status in EXECUTING:
                await self._fail(run_id, snapshot_id,
                                 {"type": "INTERNAL_ERROR", "code": "TASK_RUN_STALLED_EXECUTING",
                                  "message": "The run stopped sending heartbeats"},
                                 retryable=True, forced_delay_s=self.r.settings.stalled_retry_delay_s)
            elif status == E.PENDING_CANCEL:
                await self.finish_cancel_requested(run_id, snapshot_id)

    async def _not_heard_long_enough(self, latest: Snapshot, status: ExecutionStatus) -> bool:
        """True (and the timeout is armed again) when this process has not been able to hear the
        run's heartbeats for a whole timeout: it started, or Redis came back, less than one ago.
        A timeout that came due while no heartbeat could be recorded (the engine restarted after
        an outage longer than the timeout) says nothing of the worker, which is most likely still
        running the run or retrying its completion: failing the attempt then would run the run
        again beside it. It gets one timeout from then, once per snapshot (Redis failing now and
        then must not keep a dead worker's run forever): a worker really gone is still caught."""
        timeout = self.r.settings.heartbeat_timeout_s(status)
        if timeout is None:
            return False
        until = self.r.jobs.heard_since + timeout
        if self.r.clock.now() >= until:
            return False
        log.warning("run %s: its heartbeat timeout came due while heartbeats could not be heard (a restart or "
                    "Redis away); it is given until %s", latest.run_id, until)
        await self.r.change_jobs(schedule=[engine_jobs.heartbeat(latest.run_id, latest.id, until, graced=True)])
        return True

    async def on_max_duration(self, run_id: str, attempt: int) -> None:
        async with self.r.locker.lock("max_duration", run_id):
            latest = await self.r.repo.runs.latest_snapshot(run_id)
            if latest is None or latest.attempt_number != attempt or latest.engine_status not in EXECUTING:
                return
            await self.finish(run_id, RunStatus.TIMED_OUT, expected_snapshot_id=latest.id, from_statuses=EXECUTING,
                              error={"type": ERROR_TIMED_OUT, "message": "Run exceeded its maximum duration"},
                              description="Max duration exceeded")
