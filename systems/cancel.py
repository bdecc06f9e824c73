"""CancelSystem: queued runs end at once; executing runs go through PENDING_CANCEL until their
worker reports back (or its heartbeat times out)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from run_engine.dependencies import log_failure
from run_engine.errors import StaleSnapshotError
from run_engine.events import RunEvent
from run_engine.statuses import CANCEL_AT_ONCE, EXECUTING, ExecutionStatus, RunStatus
from systems import engine_jobs
from systems.resources import SystemResources

if TYPE_CHECKING:
    from systems.execution_snapshot import ExecutionSnapshotSystem
    from systems.run_attempt import RunAttemptSystem

log = logging.getLogger(__name__)
E = ExecutionStatus
#: how long after a cancel of a run with children it waits on the engine takes the cancel up again
#: (its job fires only when the cancel stopped part way: it is gone once the cancel reached the end)
CASCADE_GRACE_S = 60.0
#: runs below the run one cancel call cancels at most: the rest are its job's, at once (a tree of
#: 100,000 children held the request of a cancel, one lock and transaction each, for minutes)
CASCADE_PAGE = 500
CANCEL_ERROR = {"type": "CANCELED", "message": "Run was cancelled"}


class CancelSystem:
    def __init__(self, resources: SystemResources, *, execution_snapshot: ExecutionSnapshotSystem,
                 run_attempt: RunAttemptSystem) -> None:
        self.r = resources
        self.execution_snapshot = execution_snapshot
        self.run_attempt = run_attempt

    async def cancel(self, run_id: str, *, again: bool = False) -> RunStatus:
        """Cancel a run and the children it waits on, and theirs, a level at a time (a chain of
        any depth: no recursion); a finished run is left as it is. Children cancelled already
        are gone through to theirs: a cancel that stopped part way (its process died, a lock
        was busy) leaves runs below a run it cancelled, which a cancel tried again reaches.
        Returns the run's public status after.

        A run with children it waits on gets a job first that tries the cancel again
        CASCADE_GRACE_S later, and loses it once the cancel reached the end: the run is FINISHED
        (or PENDING_CANCEL) as soon as its own cancel commits, and a cancel that stopped after
        that left its children running for good unless its caller happened to cancel again (a
        dashboard's button, a script, a process that died with nobody to answer). ``again``:
        this is that job (a failure leaves it to the job's own retries).

        The cascade is noted in PostgreSQL (``cancel_cascade``, migration 0052) before the run's
        own cancel, and the note deleted once it reached the end: while it stands the reconciler's
        re-arm arms the job again should Redis no longer hold it (dead after its every attempt,
        or lost with Redis's data).

        One call cancels CASCADE_PAGE runs below the run at most; past them it hands the rest to
        that job at once (the job does the same, a page a time) and returns."""
        children = await self.r.repo.runs.waiting_children([run_id])
        env_id = None
        guard = None
        noted = False
        if children and not again:
            run = await self.r.repo.runs.get_run(run_id, light=True)
            if run is not None:
                env_id = run.env_id
                # noted in PostgreSQL first: a job that failed every attempt (the job DLQ) or was
                # lost with Redis is armed again by the reconciler while this row stands
                await self.r.repo.runs.begin_cancel_cascade(run_id)
                noted = True
                guard = engine_jobs.cancel_cascade(run_id, run.env_id, self.r.clock.now() + CASCADE_GRACE_S)
                try:
                    await self.r.change_jobs(schedule=[guard])
                except Exception as exc:  # Redis away: the cancel goes on, as it did before the job
                    log_failure(log, exc, "cancel of run %s: its job to take it up again could not be armed",
                                run_id)
                    guard = None
        status = await self._cancel_one(run_id)
        left = CASCADE_PAGE if guard is not None or again else None  # no job: all of them here
        level = [run_id]
        while level:  # the run's children read again: one its trigger-and-wait made meanwhile is among them
            children = await self.r.repo.runs.waiting_children(level)
            for child, finished in children:
                if finished:
                    continue
                if left is not None and left <= 0:
                    try:
                        await self._hand_on(run_id, env_id)
                    except Exception as exc:
                        if again:
                            raise  # the job's own retries
                        # the job armed a grace ahead takes the rest up then
                        log_failure(log, exc, "cancel of run %s: the rest could not be handed to its job now",
                                    run_id)
                    return status
                await self._cancel_one(child)
                if left is not None:
                    left -= 1
            level = [child for child, _ in children]
        if noted or again:
            try:
                await self.r.repo.runs.end_cancel_cascade(run_id)
            except Exception as exc:
                if again:
                    raise  # the job's own retries
                # its job (armed a grace ahead, else the reconciler's) ends it then
                log_failure(log, exc, "cancel of run %s: its end could not be noted", run_id)
                return status
        if guard is not None:
            await self.r.after_commit("cancel", self.r.change_jobs(cancel=[guard[0]]))
        return status

    async def _hand_on(self, run_id: str, env_id: str | None) -> None:
        """The runs left below ``run_id`` to its cancel's job, due now (it replaces the job armed
        a grace ahead, or this is that job, armed again)."""
        if env_id is None:
            run = await self.r.repo.runs.get_run(run_id, light=True)
            env_id = run.env_id if run is not None else ""
        await self.r.change_jobs(schedule=[engine_jobs.cancel_cascade(run_id, env_id, self.r.clock.now())])

    async def _cancel_one(self, run_id: str) -> RunStatus:
        # A transition that takes no run lock (a dequeue, a start, a successful completion) may move
        # the run between the read and the compare-and-set below: read again and decide again.
        for _ in range(4):
            try:
                return await self._cancel_latest(run_id)
            except StaleSnapshotError:
                continue
        return await self._cancel_latest(run_id)

    async def _cancel_latest(self, run_id: str) -> RunStatus:
        async with self.r.locker.lock("cancel", run_id):
            latest = await self.execution_snapshot.latest(run_id)
            status = ExecutionStatus(latest.engine_status)
            if status == E.FINISHED or status == E.PENDING_CANCEL:
                return RunStatus(latest.run_status)
            if status in CANCEL_AT_ONCE:
                run = await self.r.repo.runs.get_run(run_id)
                assert run is not None
                # The snapshot first: a dequeue or a start (no lock) that got in before it makes it
                # stale (read again above), and a message handed out after it is dropped by that
                # dequeue's own compare-and-set; then out of the queue (after the commit: a message
                # the removal misses is dropped by the next dequeue, whose compare-and-set fails).
                outcome = await self.run_attempt.finish(
                    run_id, RunStatus.CANCELED, error=CANCEL_ERROR, expected_snapshot_id=latest.id,
                    from_statuses=(status,), description=f"Cancelled while {status}",
                )
                await self.r.after_commit("cancel", self.r.queue.remove(run.env_id, run_id))
                return outcome.status
            if status in EXECUTING:
                result = await self.execution_snapshot.apply(
                    run_id, E.PENDING_CANCEL, RunStatus.EXECUTING, from_statuses=(status,),
                    expected_snapshot_id=latest.id, operation="cancel",
                    description="Cancel requested while executing",
                )
                assert result.snapshot is not None and result.run is not None
                await self.execution_snapshot.after_transition(latest.id, status, result.snapshot)
                self.r.events.emit(RunEvent("run_cancelled", run_id, result.run.env_id, result.snapshot.id,
                                            {"status": "PENDING_CANCEL", "final": False},
                                            attempt=result.run.attempt_number))
                return RunStatus.EXECUTING
            return RunStatus(latest.run_status)
