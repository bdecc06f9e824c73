"""ExecutionSnapshotSystem: append snapshots (through the group-commit writer), arm heartbeat
timeouts, take heartbeats, answer "what is the latest snapshot"."""

from __future__ import annotations

from collections.abc import Sequence

from run_engine.db.runs import Snapshot, Transition, TransitionResult
from run_engine.errors import InvalidTransitionError, NotFoundError, StaleSnapshotError
from run_engine.ids import new_id
from run_engine.statuses import ExecutionStatus, RunStatus
from systems import engine_jobs
from systems.engine_jobs import JobSpec
from systems.resources import SystemResources


class ExecutionSnapshotSystem:
    def __init__(self, resources: SystemResources) -> None:
        self.r = resources

    async def apply(
        self,
        run_id: str,
        to: ExecutionStatus,
        run_status: RunStatus,
        *,
        from_statuses: frozenset[ExecutionStatus] | tuple[ExecutionStatus, ...],
        expected_snapshot_id: str | None = None,
        operation: str,
        **changes: object,
    ) -> TransitionResult:
        """Append a snapshot ``to`` if the latest is in ``from_statuses`` (and is
        ``expected_snapshot_id`` when given); raise a typed error otherwise."""
        (result,) = await self.append_many([
            Transition(
                run_id=run_id,
                new_snapshot_id=new_id("snapshot"),
                engine_status=to,
                run_status=run_status,
                from_statuses=tuple(from_statuses),
                expected_snapshot_id=expected_snapshot_id,
                **changes,  # type: ignore[arg-type]
            )
        ])
        self.raise_unless_applied(result, expected_snapshot_id, operation)
        return result

    async def append_many(self, transitions: Sequence[Transition]) -> list[TransitionResult]:
        """Append many snapshots in one statement (shared with concurrent callers). Nothing is
        raised for a run that moved on: each result says whether it applied, the caller decides."""
        return await self.r.transition_many(transitions)

    @staticmethod
    def raise_unless_applied(result: TransitionResult, expected_snapshot_id: str | None, operation: str) -> None:
        if result.applied:
            return
        if result.latest_snapshot_id is None:
            raise NotFoundError("run", result.run_id)
        if expected_snapshot_id is not None and result.latest_snapshot_id != expected_snapshot_id:
            raise StaleSnapshotError(
                result.run_id, expected_snapshot_id, result.latest_snapshot_id, str(result.latest_status)
            )
        raise InvalidTransitionError(result.run_id, str(result.latest_status), operation)

    async def after_transition(self, previous_snapshot_id: str | None, previous_status: str | None,
                               snapshot: Snapshot) -> None:
        """Re-arm heartbeat timeouts: cancel the previous snapshot's job, schedule the new one's
        (plus ``extra`` jobs), in one batched Redis call. After the snapshot's commit: a failure is
        logged (the run's next heartbeat or the leader's re-arm schedules the job again)."""
        await self.r.after_commit("re-arm", self.r.change_jobs(*self.rearm(previous_snapshot_id, previous_status,
                                                                            snapshot)))

    def rearm(self, previous_snapshot_id: str | None, previous_status: str | None,
              snapshot: Snapshot) -> tuple[list[str], list[JobSpec]]:
        cancel: list[str] = []
        schedule: list[JobSpec] = []
        if (previous_snapshot_id and previous_status
                and self.r.settings.heartbeat_timeout_s(ExecutionStatus(previous_status))):
            cancel.append(engine_jobs.heartbeat_id(snapshot.run_id, previous_snapshot_id))
        timeout = self.r.settings.heartbeat_timeout_s(ExecutionStatus(snapshot.engine_status))
        if timeout is not None:
            schedule.append(engine_jobs.heartbeat(snapshot.run_id, snapshot.id, self.r.clock.now() + timeout))
        return cancel, schedule

    async def heartbeat(self, run_id: str, snapshot_id: str) -> None:
        """Push back the run's timeout; no lock, no PostgreSQL write. A heartbeat for a snapshot
        that is no longer the latest raises :class:`StaleSnapshotError`."""
        moved = await self.r.jobs.reschedule(engine_jobs.heartbeat_id(run_id, snapshot_id), self._deadline_unknown())
        if moved:
            return
        latest = await self.r.repo.runs.latest_snapshot(run_id)
        if latest is None:
            raise NotFoundError("run", run_id)
        snapshot_status = latest.engine_status
        if latest.id != snapshot_id:
            raise StaleSnapshotError(run_id, snapshot_id, latest.id, snapshot_status)
        # The latest snapshot has no heartbeat job: FINISHED or QUEUED (nothing to extend), or its
        # job was lost (a Redis flush or restart, a process that died between the write and the
        # job): arm it again, or nothing would ever notice the worker die.
        if self.r.settings.heartbeat_timeout_s(ExecutionStatus(snapshot_status)) is not None:
            _, schedule = self.rearm(None, None, latest)
            await self.r.change_jobs(schedule=schedule)

    def _deadline_unknown(self) -> float:
        # A heartbeat extends by the longest timeout of the statuses a worker heartbeats in;
        # the job's handler re-checks the real status, so a generous deadline is safe.
        s = self.r.settings
        return self.r.clock.now() + max(s.executing_timeout_s, s.pending_executing_timeout_s)

    SAME_EXECUTION_WALK = 16  # an execution's own moves after a snapshot it holds are two or three

    async def latest_since(self, run_id: str, snapshot_id: str) -> tuple[Snapshot, bool]:
        """The run's latest snapshot, and whether it continues the execution that held
        ``snapshot_id``: every snapshot after it is that attempt's wait (EXECUTING_WITH_WAITPOINTS)
        or its continuation in place (EXECUTING with no checkpoint), the last maybe its suspension.
        A worker whose answer was lost tells by this its own move from a restore of the run
        elsewhere (same attempt number, after a suspension it never saw) or a retry."""
        chain = await self.r.repo.runs.snapshots_from(run_id, snapshot_id, self.SAME_EXECUTION_WALK)
        if not chain or chain[0].id != snapshot_id or len(chain) == self.SAME_EXECUTION_WALK:
            return await self.latest(run_id), False
        held, *after = chain
        same = all(s.attempt_number == held.attempt_number and (
            (s.engine_status in (ExecutionStatus.EXECUTING_WITH_WAITPOINTS, ExecutionStatus.EXECUTING)
             and s.checkpoint_id is None)  # a restore's EXECUTING carries the checkpoint it restores
            or (s.engine_status == ExecutionStatus.SUSPENDED and i == len(after) - 1)) for i, s in enumerate(after))
        return chain[-1], same and held.engine_status in (ExecutionStatus.EXECUTING,
                                                           ExecutionStatus.EXECUTING_WITH_WAITPOINTS)

    async def latest(self, run_id: str) -> Snapshot:
        snapshot = await self.r.repo.runs.latest_snapshot(run_id)
        if snapshot is None:
            raise NotFoundError("run", run_id)
        return snapshot
